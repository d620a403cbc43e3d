//! The analyses behind `Model`'s calls, each the library's command of the same name
//! (`attnscope::commands`): its options from Python's arguments (with the CLI's rules and
//! messages), its report handed back as Python objects, never through command-line arguments
//! or JSON text. Generation and embeddings are here too (`generate`, `embed`).

use crate::engine::{count, engine, parse_target, to_object, to_py};
use crate::model::Model;
use attnscope::analysis::vocab::Target;
use attnscope::analysis::LESSON_SENTENCE;
use attnscope::model::Error as ModelError;
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

/// `Model.generate`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn generate(
    this: &Model,
    py: Python<'_>,
    text: Option<String>,
    ids: Option<Vec<u32>>,
    chat: bool,
    system: Option<String>,
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
) -> PyResult<(Vec<u32>, Vec<u32>, String)> {
    if let Some(ids) = &ids {
        this.check_ids(ids)?;
    }
    let m = this.inner.clone();
    engine(py, move || {
        let prompt = match (text, ids) {
            (Some(t), None) if chat => m.chat_ids(&t, system.as_deref())?,
            (Some(t), None) => m.encode_with(&t, None)?,
            (None, Some(ids)) if !chat => ids,
            _ => {
                return Err(anyhow::Error::new(ModelError::NotApplicable(
                    "generate: give a text, or token ids without chat=True".into(),
                )))
            }
        };
        let o = attnscope::model::generate::GenOptions {
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            ..Default::default()
        };
        let g = attnscope::commands::generate::run(&m, &prompt, &o, |_| {})?;
        let gen = g.generated.iter().map(|t| t.id).collect();
        Ok((g.prompt_ids.clone(), gen, serde_json::to_string(&g)?))
    })
}

/// `Model.embed`'s body (its documentation is there, in the Python surface).
pub(crate) fn embed<'py>(
    this: &Model,
    py: Python<'py>,
    texts: Vec<String>,
    pairs: Vec<Option<String>>,
    normalize: Option<bool>,
) -> PyResult<Bound<'py, PyAny>> {
    if texts.len() != pairs.len() {
        return Err(PyValueError::new_err(format!(
            "{} texts but {} pair entries",
            texts.len(),
            pairs.len()
        )));
    }
    let m = this.inner.clone();
    let n = texts.len();
    let dm = m.dims.d_model;
    let inputs: Vec<attnscope::model::forward::EmbedInput> = texts
        .into_iter()
        .zip(pairs)
        .map(|(text, pair)| attnscope::model::forward::EmbedInput { text, pair })
        .collect();
    let opts = attnscope::commands::embed::EmbedOptions { inputs, normalize };
    let e = engine(py, move || {
        Ok(attnscope::commands::embed::run(&m, &opts, &|| {})?.embeddings)
    })?;
    Ok(PyArray1::from_vec(py, e).reshape([n, dm])?.into_any())
}

/// `Model.inspect`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn inspect<'py>(
    this: &Model,
    py: Python<'py>,
    text: &str,
    pair: Option<String>,
    query: Option<usize>,
    layer: Option<usize>,
    heads: String,
    layers: Option<String>,
    top: Option<usize>,
    concentrated: f32,
    bos: bool,
) -> PyResult<Bound<'py, PyAny>> {
    let req = attnscope::commands::inspect::InspectOptions {
        query,
        layer,
        heads,
        layers,
        top,
        concentrated,
    };
    let (m, text) = (this.inner.clone(), text.to_string());
    let v = engine(py, move || {
        use attnscope::commands::inspect::{run, InspectInput};
        let input = match &pair {
            Some(b) => {
                let (tokens, ty, seg) = m.encode_pair_segments(&text, b)?;
                InspectInput {
                    tokens,
                    types: Some(ty),
                    segments: Some(seg),
                }
            }
            None => InspectInput {
                tokens: m.encode(&text, bos)?,
                ..Default::default()
            },
        };
        Ok(run(&m, &input, &req)?.json(None)?)
    })?;
    to_object(py, &v)
}

/// `Model.faithfulness`'s body (its documentation is there, in the Python surface).
pub(crate) fn faithfulness<'py>(
    this: &Model,
    py: Python<'py>,
    text: &str,
    target: Option<String>,
    replace_with: Option<String>,
    bos: bool,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::commands::faithfulness::{run, FaithOptions};
    let mut req = FaithOptions {
        target: parse_target(target, "target")?.unwrap_or(Target::Next),
        ..Default::default()
    };
    if let Some(r) = replace_with {
        req.replacement = r;
    }
    let (m, text) = (this.inner.clone(), text.to_string());
    let report = engine(py, move || {
        let tokens = m.encode(&text, bos)?;
        run(&m, &tokens, &req, &mut |_, _| {})
    })?;
    to_object(py, &report)
}

/// `Model.compare`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn compare<'py>(
    this: &Model,
    py: Python<'py>,
    text: String,
    other_text: Option<String>,
    other: Option<PyRef<'py, Model>>,
    query: Option<i64>,
    top: i64,
    html: Option<std::path::PathBuf>,
    force: bool,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::commands::compare::{
        compare_sides, text_label, CompareOptions, Mode, SideInput,
    };
    let opts = CompareOptions {
        query: query.map(|q| count(q, "query")).transpose()?,
        top: match count(top, "top")? {
            0 => return Err(PyValueError::new_err("top=0: list at least 1 head")),
            t => t,
        },
        bos: false,
    };
    let (mode, (b, b_spec), other_text) = match (other_text, other) {
        (Some(t), None) => (Mode::Texts, (this.inner.clone(), this.spec.clone()), t),
        (None, Some(o)) => (
            Mode::Models,
            (o.inner.clone(), o.spec.clone()),
            text.clone(),
        ),
        _ => {
            return Err(PyValueError::new_err(
                "give other_text (two texts on this model) or other (a second model), not both",
            ))
        }
    };
    let sides = [
        (this.inner.clone(), this.spec.clone(), text),
        (b, b_spec, other_text),
    ];
    let report = engine(py, move || {
        // the page's path checked before the runs, written after them
        let output = html
            .as_deref()
            .map(|p| attnscope::render::Output::check(p, force, &[]))
            .transpose()?;
        let [a, b] = sides.each_ref().map(|(m, name, text)| SideInput {
            model: m,
            name,
            text,
            label: match mode {
                Mode::Texts => text_label(text),
                _ => format!("model {name}"),
            },
        });
        let report = compare_sides(mode, [a, b], &opts)?;
        if let Some(out) = output {
            out.write(attnscope::render::compare_page::page(&report).as_bytes())?;
        }
        Ok(report)
    })?;
    let dict = to_object(py, &report)?;
    for (k, side) in [("a", &report.a), ("b", &report.b)] {
        let (l, h) = (side.rows.len(), side.rows.first().map_or(0, Vec::len));
        let keys = side
            .rows
            .first()
            .and_then(|r| r.first())
            .map_or(0, Vec::len);
        let flat: Vec<f32> = side.rows.iter().flatten().flatten().copied().collect();
        let rows = PyArray1::from_vec(py, flat).reshape([l, h, keys])?;
        dict.get_item(k)?.set_item("rows", rows)?;
    }
    Ok(dict)
}

/// `Model.capture`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn capture(
    this: &Model,
    py: Python<'_>,
    text: String,
    path: std::path::PathBuf,
    hooks: String,
    layers: String,
    heads: String,
    queries: String,
    force: bool,
) -> PyResult<String> {
    use attnscope::commands::capture::{capture, CaptureRequest};
    let req = CaptureRequest {
        hooks,
        layers,
        heads,
        queries,
        force,
        ..CaptureRequest::new(path)
    };
    let m = this.inner.clone();
    let report = engine(py, move || {
        req.check()?;
        let tokens = m.encode(&text, false)?;
        let plan = req.plan(&m, tokens.len())?;
        capture(&m, &tokens, None, &req, plan, &mut |_| {})
    })?;
    // the model was loaded before: no load time
    Ok(report.message(0.0, report.seconds).trim_end().to_string())
}

/// `Model.ablate`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ablate<'py>(
    this: &Model,
    py: Python<'py>,
    text: &str,
    method: &str,
    target: Option<String>,
    positions: Option<String>,
    mlp: bool,
    bos: bool,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::analysis::intervene::DEFAULT_BATCH_ROWS;
    use attnscope::commands::ablate::{run, AblateOptions};
    let method = attnscope::commands::view::ablate_method(method).map_err(to_py)?;
    let target = parse_target(target, "target")?.unwrap_or(Target::Next);
    let (m, text) = (this.inner.clone(), text.to_string());
    let report = engine(py, move || {
        let tokens = m.encode(&text, bos)?;
        let positions = positions
            .as_deref()
            .map(|s| attnscope::analysis::request::parse_index_list(s, tokens.len(), "position"))
            .transpose()?;
        let opts = AblateOptions {
            method,
            target,
            positions,
            mlp,
            batch_rows: DEFAULT_BATCH_ROWS,
        };
        run(&m, &tokens, &opts, |_, _| {})
    })?;
    to_object(py, &report)
}

/// `Model.patch`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn patch<'py>(
    this: &Model,
    py: Python<'py>,
    clean: &str,
    corrupt: &str,
    hook: &str,
    answer: Option<String>,
    wrong: Option<String>,
    bos: bool,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::analysis::intervene::DEFAULT_BATCH_ROWS;
    use attnscope::analysis::vocab::PatchHook;
    use attnscope::commands::patch::{run, PatchInput, PatchOptions};
    // TransformerLens's spellings too (resid_pre, hook_resid_pre, attn.hook_z, ...)
    let spelled = hook.replace('_', "-");
    let bare = spelled
        .trim_start_matches("attn.")
        .trim_start_matches("hook-");
    let hook = match bare {
        "resid-pre" => PatchHook::ResidPre,
        "attn-out" => PatchHook::AttnOut,
        "mlp-out" => PatchHook::MlpOut,
        "z" => PatchHook::Z,
        "pattern" | "attn" => PatchHook::Pattern,
        h => {
            return Err(PyValueError::new_err(format!(
                "unknown hook {h:?}: valid values are resid-pre, attn-out, mlp-out, z, pattern"
            )))
        }
    };
    let (answer, wrong) = (
        parse_target(answer, "answer")?,
        parse_target(wrong, "wrong")?,
    );
    for (t, what) in [(&answer, "answer"), (&wrong, "wrong")] {
        if matches!(t, Some(Target::Next)) {
            return Err(PyValueError::new_err(format!(
                "{what}=\"next\": give a token id or a token's text (the default, None, is already the run's top token)"
            )));
        }
    }
    for (text, what) in [(clean, "clean"), (corrupt, "corrupt")] {
        if text.trim().is_empty() {
            return Err(PyValueError::new_err(format!(
                "{what} is empty (or only whitespace); give the {what} text"
            )));
        }
    }
    let opts = PatchOptions {
        hook,
        answer,
        wrong,
        batch_rows: DEFAULT_BATCH_ROWS,
    };
    let (m, clean, corrupt) = (this.inner.clone(), clean.to_string(), corrupt.to_string());
    let report = engine(py, move || {
        let input = PatchInput {
            clean: m.encode(&clean, bos)?,
            corrupt: m.encode(&corrupt, bos)?,
        };
        run(&m, &input, &opts, |_, _| {})
    })?;
    to_object(py, &report)
}

/// `Model.heads`'s body (its documentation is there, in the Python surface).
pub(crate) fn heads<'py>(
    this: &Model,
    py: Python<'py>,
    text: Option<String>,
    random_repeat: Option<usize>,
    seed: u64,
    bos: bool,
    pair: Option<String>,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::analysis::heads::random_repeat_tokens;
    use attnscope::commands::heads::{document, run, HeadsInput};
    let m = this.inner.clone();
    let doc = engine(py, move || {
        let mut extra = serde_json::Map::new();
        let (tokens, types) = match (random_repeat, text, pair) {
            (Some(nr), None, None) => {
                extra.insert("random_repeat".into(), nr.into());
                extra.insert("seed".into(), seed.into());
                (random_repeat_tokens(&m, nr, seed, bos)?, None)
            }
            (None, text, Some(b)) => {
                let (t, ty) = m.encode_pair(text.as_deref().unwrap_or(LESSON_SENTENCE), &b)?;
                (t, Some(ty))
            }
            (None, text, None) => (
                m.encode(text.as_deref().unwrap_or(LESSON_SENTENCE), bos)?,
                None,
            ),
            (Some(_), _, _) => {
                return Err(attnscope::analysis::request::usage(
                    "give a text (or a pair) or random_repeat, not both",
                ))
            }
        };
        let texts = vec![tokens];
        document(&m, &run(&m, &HeadsInput { texts, types })?, extra)
    })?;
    to_object(py, &doc)
}

/// `Model.sinks`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments)]
pub(crate) fn sinks<'py>(
    this: &Model,
    py: Python<'py>,
    text: Option<String>,
    max_tokens: Option<usize>,
    key_block: usize,
    top: usize,
    bos: bool,
    file: Option<std::path::PathBuf>,
) -> PyResult<Bound<'py, PyAny>> {
    use attnscope::commands::sinks::{run, SinksInput, SinksOptions};
    let opts = SinksOptions {
        key_block,
        top,
        bos,
        ..Default::default()
    };
    let m = this.inner.clone();
    let report = engine(py, move || {
        // a file is read as far as max_tokens tokens can reach, as `attnscope sinks --file`
        let input = SinksInput {
            file,
            text,
            max_tokens,
        };
        Ok(run(&m, &input, &opts, false)?.1)
    })?;
    to_object(py, &report)
}

/// `Model.attribute`'s body (its documentation is there, in the Python surface).
pub(crate) fn attribute<'py>(
    this: &Model,
    py: Python<'py>,
    ids: Vec<u32>,
    method: &str,
    target: Option<String>,
    wrong: Option<String>,
    steps: usize,
) -> PyResult<(String, Bound<'py, PyAny>)> {
    use attnscope::analysis::vocab::Target;
    use attnscope::commands::attribute::{run, AttributeOptions};
    this.check_ids(&ids)?;
    let method = method.parse().map_err(PyValueError::new_err)?;
    let parse = |t: Option<String>| -> PyResult<Option<Target>> {
        t.map(|t| t.parse::<Target>().map_err(PyValueError::new_err))
            .transpose()
    };
    let opts = AttributeOptions {
        method,
        target: parse(target)?.unwrap_or(Target::Next),
        wrong: parse(wrong)?,
        steps,
    };
    let m = this.inner.clone();
    let r = engine(py, move || run(&m, &ids, &opts, &mut |_, _| {}))?;
    let scores: Vec<f32> = r.tokens.iter().map(|t| t.score).collect();
    let json = serde_json::to_string(&r).map_err(|e| PyRuntimeError::new_err(e.to_string()))?;
    Ok((json, PyArray1::from_vec(py, scores).into_any()))
}

/// `Model.attribute_generation`'s body (its documentation is there, in the Python surface).
#[allow(clippy::too_many_arguments, clippy::type_complexity)]
pub(crate) fn attribute_generation<'py>(
    this: &Model,
    py: Python<'py>,
    text: String,
    method: &str,
    chat: bool,
    system: Option<String>,
    max_new_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    steps: usize,
) -> PyResult<(
    Vec<String>,
    usize,
    Bound<'py, PyAny>,
    Vec<f32>,
    Vec<u32>,
    Vec<Vec<f32>>,
)> {
    use attnscope::commands::generate::{attribution, run};
    let method: attnscope::analysis::vocab::Method =
        method.parse().map_err(PyValueError::new_err)?;
    let m = this.inner.clone();
    let (r, attention) = engine(py, move || {
        let prompt = if chat {
            m.chat_ids(&text, system.as_deref())?
        } else {
            m.encode_with(&text, None)?
        };
        let o = attnscope::model::generate::GenOptions {
            max_new_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            ..Default::default()
        };
        let g = run(&m, &prompt, &o, |_| {})?;
        let answer: Vec<u32> = g.generated.iter().map(|t| t.id).collect();
        let r = attribution(&m, &prompt, &answer, method, steps, &mut |_, _| {})?;
        let attention = g.generated.into_iter().map(|t| t.attention).collect();
        Ok((r, attention))
    })?;
    let (rows, cols) = (r.matrix.len(), r.answer_len());
    let flat: Vec<f32> = r.matrix.iter().flatten().copied().collect();
    let matrix = PyArray1::from_vec(py, flat)
        .reshape([rows, cols])?
        .into_any();
    Ok((
        this.inner.token_texts(&r.ids),
        r.prompt_len,
        matrix,
        r.logprobs,
        r.ids,
        attention,
    ))
}
