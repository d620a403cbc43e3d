//! `attnscope explain`: one attention step, printed so a student can redo it on paper.

use super::common::{emit, usage};
use attnscope::reference::walkthrough::{head_split, walkthrough, Walkthrough};
use attnscope::reference::{dot, saturation};
use attnscope::render::table::{mask_grid, title, Align, Table};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The words, one position each (split on whitespace).
    #[arg(long, default_value = "Hà Nội là thủ đô")]
    text: String,
    /// Width of the vectors (and of the one head): q, k, v have d numbers each.
    #[arg(long, default_value_t = 4)]
    d: usize,
    /// Seed of the small one-decimal inputs and weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Query heads, for the multi-head / GQA split (default: Qwen2.5-0.5B).
    #[arg(long, default_value_t = 14)]
    heads: usize,
    /// Key/value heads shared by the query heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Model width split among the heads.
    #[arg(long, default_value_t = 896, value_parser = attnscope::analysis::request::at_least_one)]
    d_model: usize,
    /// Print every matrix as one JSON document instead.
    #[arg(long)]
    json: bool,
    /// The lesson's last chapter instead: a toy RNN against a toy attention layer over n tokens
    /// (sequential steps, path length, and the gradient of the last output with respect to the
    /// first input, measured).
    #[arg(long)]
    rnn: bool,
    /// Sequence lengths for --rnn.
    #[arg(long, default_value = "4,16,64,256,512", requires = "rnn")]
    lengths: String,
    /// Spectral radius of the RNN's recurrent matrix for --rnn (W = rho · orthogonal).
    #[arg(long, default_value_t = 0.9, requires = "rnn")]
    rho: f64,
    /// The lesson's self-check questions, answered with numbers computed now on --model and your
    /// --text (cost, head width, GQA sharing, your sentence's mask, row sums, and whether the
    /// highest weight explains the prediction).
    #[arg(long, conflicts_with = "rnn")]
    quiz: bool,
    #[command(flatten)]
    model: super::common::ModelArgs,
}

/// A quiz question, its answer and the numbers behind it.
type Answer = (&'static str, String, serde_json::Value);

/// `explain --quiz`: each question with its answer computed on the spot.
fn quiz(a: &Args) -> anyhow::Result<()> {
    let model = a.model.load()?;
    let d = &model.dims;
    let tokens = model.encode(&a.text, a.model.bos)?;
    let texts: Vec<String> = model
        .token_texts(&tokens)
        .iter()
        .map(|t| attnscope::model::tokenize::visible(t))
        .collect();
    let (rows, logits) = quiz_rows(&model, &tokens)?;
    let answers = [
        quiz_cost(&model),
        quiz_head_width(d),
        quiz_gqa(d),
        quiz_mask(&texts),
        rows,
        quiz_explanation(&model, &tokens, &logits)?,
    ];
    let qs: Vec<serde_json::Value> = answers
        .into_iter()
        .map(|(q, answer, numbers)| json!({"question": q, "answer": answer, "numbers": numbers}))
        .collect();
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(
                &json!({"model": model.info.name, "text": a.text, "questions": qs})
            )?
        ));
    }
    let mut s = title(&format!(
        "Self-check, answered on {} and \"{}\"",
        model.info.name, a.text
    ));
    for (i, q) in qs.iter().enumerate() {
        s += &format!(
            "{}. {}\n   {}\n\n",
            i + 1,
            q["question"].as_str().unwrap_or(""),
            q["answer"].as_str().unwrap_or("").replace('\n', "\n   ")
        );
    }
    emit(&s)
}

/// Question 1: the cost of four times the length.
fn quiz_cost(model: &attnscope::model::Model) -> Answer {
    let d = &model.dims;
    let (n1, n2) = (2048f64, 8192f64);
    let per_head = |n: f64| n * n * 4.0;
    let all = |n: f64| per_head(n) * (d.n_layers * d.n_heads) as f64;
    (
        "The text grows from 2,048 to 8,192 tokens. How much bigger is the attention-score matrix?",
        format!(
            "(8192 / 2048)² = {:.0}x: each head's scores go from {} to {} (f32), and all {} layers × {} heads of {} from {} to {}. Four times the length, sixteen times the attention.",
            (n2 / n1).powi(2),
            super::cost::human_bytes(per_head(n1)),
            super::cost::human_bytes(per_head(n2)),
            d.n_layers,
            d.n_heads,
            model.info.name,
            super::cost::human_bytes(all(n1)),
            super::cost::human_bytes(all(n2))
        ),
        json!({"ratio": (n2 / n1).powi(2), "bytes_per_head": [per_head(n1), per_head(n2)], "bytes_all_heads": [all(n1), all(n2)]}),
    )
}

/// Question 2: each head's width.
fn quiz_head_width(d: &attnscope::model::config::ModelDims) -> Answer {
    let split = d.d_model as f64 / d.n_heads as f64;
    (
        "How many numbers does each head work with?",
        if d.head_dim * d.n_heads == d.d_model {
            format!(
                "{} / {} = {} per head: the heads split the model's width.",
                d.d_model, d.n_heads, d.head_dim
            )
        } else {
            format!(
                "{} per head; here the heads do not split the width ({} / {} = {split:.1}).",
                d.head_dim, d.d_model, d.n_heads
            )
        },
        json!({"d_model": d.d_model, "n_heads": d.n_heads, "head_dim": d.head_dim}),
    )
}

/// Question 3: grouped-query attention's sharing and what it saves.
fn quiz_gqa(d: &attnscope::model::config::ModelDims) -> Answer {
    (
        "How many query heads share each key/value set, and what does it save?",
        format!(
            "{} query heads, {} key/value sets: {}. The keys and values kept per token shrink {}x ({} instead of {} numbers per layer).",
            d.n_heads,
            d.n_kv_heads,
            d.gqa_sentence(),
            d.n_heads / d.n_kv_heads,
            2 * d.n_kv_heads * d.head_dim,
            2 * d.n_heads * d.head_dim
        ),
        json!({"n_heads": d.n_heads, "n_kv_heads": d.n_kv_heads, "group": d.n_heads / d.n_kv_heads}),
    )
}

/// Question 4: the causal mask of the user's sentence (its tokens' `texts`).
fn quiz_mask(texts: &[String]) -> Answer {
    let n = texts.len();
    let masked = n * (n - 1) / 2;
    let shown: Vec<String> = texts.iter().take(10).cloned().collect();
    (
        "What does the causal mask do to your sentence?",
        format!(
            "It has {n} tokens: of the {} scores, the {masked} above the diagonal ({:.0}%) are set to -inf before the softmax, so token i sees tokens 0..=i only (its row has i + 1 weights).\n{}",
            n * n,
            100.0 * masked as f64 / (n * n) as f64,
            mask_grid(&shown)
        ),
        json!({"tokens": texts, "scores": n * n, "masked": masked}),
    )
}

/// Question 5: the rows' sums and the masked weights, measured on every layer and head; and the
/// last position's logits.
fn quiz_rows(
    model: &attnscope::model::Model,
    tokens: &[u32],
) -> anyhow::Result<(Answer, Vec<f32>)> {
    let (d, n) = (&model.dims, tokens.len());
    let r = attnscope::commands::explain::rows(model, tokens)?;
    let (worst_sum, worst_masked) = (r.max_row_sum_error, r.max_masked_weight);
    let answer = (
        "After the softmax, do the rows sum to 1, and are the masked weights 0?",
        format!("Measured on all {} layers × {} heads × {n} rows: the sums are 1 to within {worst_sum:.1e}, and the largest masked weight is {worst_masked}.", d.n_layers, d.n_heads),
        json!({"max_row_sum_error": worst_sum, "max_masked_weight": worst_masked}),
    );
    Ok((answer, r.logits))
}

/// Question 6: is the most-attended token the one the prediction (from `logits`) depends on?
fn quiz_explanation(
    model: &attnscope::model::Model,
    tokens: &[u32],
    logits: &[f32],
) -> anyhow::Result<Answer> {
    use attnscope::analysis::vocab::{permutation_p, spearman};
    let n = tokens.len();
    let f = attnscope::commands::explain::attention_against_deletion(model, tokens)?;
    let rows = &f.tokens;
    let top_attn = rows
        .iter()
        .max_by(|x, y| x.attention_last.total_cmp(&y.attention_last))
        .expect("a token");
    let top_loo = rows
        .iter()
        .filter(|r| r.loo.is_some())
        .min_by(|x, y| x.loo.unwrap_or(0.0).total_cmp(&y.loo.unwrap_or(0.0)));
    let sc: Vec<f64> = rows.iter().map(|r| r.attention_last as f64).collect();
    let imp: Vec<f64> = rows
        .iter()
        .map(|r| -(r.loo.unwrap_or(0.0) as f64))
        .collect();
    let (rho, p) = (spearman(&sc, &imp), permutation_p(&sc, &imp, spearman));
    let next = attnscope::analysis::vocab::next_token_top_k(logits, 1).remove(0);
    let answer = match top_loo {
        Some(t) => format!(
            "Not by itself. The model predicts {:?} next. The last layer's attention (head mean) is highest on token {} {:?} ({:.3}), but deleting token {} {:?} changes the prediction most (Δ log p = {:+.3}). Over all {n} tokens, attention against deletion: Spearman ρ = {} (permutation p = {}). {}",
            attnscope::model::tokenize::visible(&model.tokenizer.token_text(next.id)),
            top_attn.pos,
            attnscope::model::tokenize::visible(&top_attn.text),
            top_attn.attention_last,
            t.pos,
            attnscope::model::tokenize::visible(&t.text),
            t.loo.unwrap_or(0.0),
            rho.map(|r| format!("{r:+.2}")).unwrap_or_else(|| "undefined".into()),
            p.map(|p| format!("{p:.2}")).unwrap_or_else(|| "—".into()),
            if top_attn.pos == t.pos { "Here they agree on the top token; the ranking still says how far the agreement goes." } else { "Here the most-attended token is not the one the prediction depends on." }
        ),
        None => "A one-token text has nothing to occlude; give a longer --text.".into(),
    };
    Ok((
        "Is a high attention weight an explanation?",
        answer,
        json!({"next_token": next.id, "top_attention_pos": top_attn.pos, "top_deletion_pos": top_loo.map(|t| t.pos), "spearman": rho, "spearman_p": p, "n": n}),
    ))
}

/// `explain --rnn`: the table of the lesson's last chapter.
fn rnn(a: &Args) -> anyhow::Result<()> {
    let ns: Vec<usize> = a
        .lengths
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| (2..=4096).contains(&n))
        })
        .collect::<Option<_>>()
        .ok_or_else(|| {
            usage(format!(
                "--lengths {} must be a list of lengths in 2..=4096, e.g. 4,16,64",
                a.lengths
            ))
        })?;
    if !(a.rho > 0.0 && a.rho <= 2.0) {
        return Err(usage(format!(
            "--rho {} is out of range: use 0 < rho <= 2",
            a.rho
        )));
    }
    let d = a.d.clamp(2, 64);
    let rows = attnscope::reference::rnn::compare(&ns, d, a.rho, a.seed);
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(
                &serde_json::json!({"d": d, "rho": a.rho, "seed": a.seed, "rows": rows})
            )?
        ));
    }
    let mut s = attnscope::render::table::title(
        "Why attention replaced recurrent networks (toy RNN against toy attention, measured)",
    );
    s += &format!("width d = {d}; RNN h_t = tanh(W h_(t-1) + U x_t) with W = {} · orthogonal; attention y = Σ α_nj W_V x_j; seed {}\n", a.rho, a.seed);
    s += "‖∂y/∂x₁‖: how much the last output still depends on the first token (chain rule, exact)\n\n";
    let mut t = attnscope::render::table::Table::new([
        ("n", attnscope::render::table::Align::Right),
        (
            "sequential steps RNN / attn",
            attnscope::render::table::Align::Right,
        ),
        (
            "path x₁→y RNN / attn",
            attnscope::render::table::Align::Right,
        ),
        (
            "‖∂y/∂x₁‖ RNN (tanh)",
            attnscope::render::table::Align::Right,
        ),
        ("linear RNN", attnscope::render::table::Align::Right),
        ("= rhoⁿ⁻¹‖U‖", attnscope::render::table::Align::Right),
        ("attention", attnscope::render::table::Align::Right),
    ]);
    for r in &rows {
        t.row([
            r.n.to_string(),
            format!(
                "{} / {}",
                r.rnn_sequential_steps, r.attention_sequential_steps
            ),
            format!("{} / {}", r.rnn_path_length, r.attention_path_length),
            format!("{:.3e}", r.rnn_tanh_gradient),
            format!("{:.3e}", r.rnn_linear_gradient),
            format!("{:.3e}", r.rnn_linear_closed_form),
            format!("{:.3e}", r.attention_gradient),
        ]);
    }
    s += &t.render();
    s += "\nThe RNN must run its n steps one after another, and the first token's influence passes through n - 1\n";
    s += "Jacobians, so it shrinks geometrically (exactly rhoⁿ⁻¹ for the linear RNN). Attention reaches every token\n";
    s += "in one step of one matmul: the first token's gradient shrinks at most with its attention weight.\n";
    emit(&s)
}

fn num(x: f32, decimals: usize) -> String {
    if x == f32::NEG_INFINITY {
        "-inf".into()
    } else {
        format!("{x:.decimals$}")
    }
}

fn matrix(
    name: &str,
    what: &str,
    m: &[f32],
    row_labels: &[String],
    col_labels: &[String],
    decimals: usize,
) -> String {
    let cols = col_labels.len();
    let mut t = Table::new(
        std::iter::once((String::new(), Align::Left))
            .chain(col_labels.iter().map(|c| (c.clone(), Align::Right))),
    );
    for (label, r) in row_labels.iter().zip(m.chunks(cols)) {
        t.row(std::iter::once(label.clone()).chain(r.iter().map(|&x| num(x, decimals))));
    }
    format!(
        "{name} ({} × {cols}): {what}\n{}\n",
        row_labels.len(),
        t.render()
    )
}

fn json_matrix(m: &[f32], cols: usize) -> serde_json::Value {
    json!(m
        .chunks(cols)
        .map(|r| r
            .iter()
            .map(|&x| if x == f32::NEG_INFINITY {
                json!("-inf")
            } else {
                json!(x)
            })
            .collect::<Vec<_>>())
        .collect::<Vec<_>>())
}

/// The "why √d" measurement: (d, scaled max, scaled entropy, unscaled max, unscaled entropy).
fn sqrt_d_rows(n_keys: usize) -> Vec<(usize, f32, f32, f32, f32)> {
    [4usize, 64, 1024]
        .iter()
        .map(|&d| {
            let (sm, se) = saturation(d, n_keys, 500, true, 42);
            let (um, ue) = saturation(d, n_keys, 500, false, 42);
            (d, sm, se, um, ue)
        })
        .collect()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.rnn {
        return rnn(&a);
    }
    if a.quiz {
        return quiz(&a);
    }
    let words: Vec<String> = a.text.split_whitespace().map(String::from).collect();
    if words.is_empty() {
        return Err(usage(
            "--text has no words; give a few words separated by spaces",
        ));
    }
    if words.len() > 64 {
        return Err(usage(format!(
            "--text has {} words; explain is for working by hand, use at most 64",
            words.len()
        )));
    }
    if a.d == 0 || a.d > 64 {
        return Err(usage(format!(
            "--d {} is out of range: use 1..=64 (a width you can follow by hand)",
            a.d
        )));
    }
    let split = head_split(a.d_model, a.heads, a.kv_heads).map_err(usage)?;
    let w = walkthrough(&words, a.d, a.seed);
    let sat = sqrt_d_rows(16);
    if a.json {
        let d = a.d;
        let doc = json!({
            "words": w.words, "d": d, "seed": a.seed,
            "X": json_matrix(&w.x, d), "W_Q": json_matrix(&w.w_q, d), "W_K": json_matrix(&w.w_k, d), "W_V": json_matrix(&w.w_v, d),
            "Q": json_matrix(&w.q, d), "K": json_matrix(&w.k, d), "V": json_matrix(&w.v, d),
            "raw_scores": json_matrix(&w.steps.raw_scores, words.len()),
            "scale": 1.0 / (d as f64).sqrt(),
            "scaled_scores": json_matrix(&w.steps.scaled_scores, words.len()),
            "masked_scores": json_matrix(&w.steps.masked_scores, words.len()),
            "weights": json_matrix(&w.steps.pattern, words.len()),
            "Y": json_matrix(&w.steps.out, d),
            "mask": (0..words.len()).map(|i| (0..words.len()).map(|j| j <= i).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "sqrt_d": sat.iter().map(|&(d, sm, se, um, ue)| json!({"d": d, "scaled": {"max_weight": sm, "entropy": se}, "unscaled": {"max_weight": um, "entropy": ue}})).collect::<Vec<_>>(),
            "heads": {"d_model": a.d_model, "n_heads": a.heads, "n_kv_heads": a.kv_heads, "head_dim": a.d_model / a.heads,
                      "kv_set_of_head": (0..a.heads).map(|h| attnscope::reference::kv_head(h, a.heads / a.kv_heads)).collect::<Vec<_>>(), "summary": split},
        });
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    emit(&render(&w, &sat, &split, &a))
}

fn render(w: &Walkthrough, sat: &[(usize, f32, f32, f32, f32)], split: &str, a: &Args) -> String {
    let (n, d) = (w.words.len(), w.d);
    let words = &w.words;
    let mut s = String::new();
    s += &title("One attention step, by hand");
    s += &format!(
        "{n} positions ({}), vectors of d = {d}, one head; inputs and weights are one-decimal numbers from seed {}.\n\n",
        words.join(", "),
        w.seed
    );
    s += &inputs_section(w);
    s += &scores_section(w);
    s += &title("Causal mask");
    s += &mask_grid(words);
    s += "\n";
    s += &scale_section(sat);
    s += &title("Many heads, shared keys and values");
    s += &format!(
        "d_model {} split into {} heads: each head attends with its own {}-dim q, k, v, and the {} head outputs are concatenated back to {} and mixed by W_O.\n",
        a.d_model,
        a.heads,
        a.d_model / a.heads,
        a.heads,
        a.d_model
    );
    s += &format!(
        "With {} key/value heads (grouped-query attention) each KV set serves {} query heads (kv_head = head / {}):\n{split}\n",
        a.kv_heads,
        a.heads / a.kv_heads,
        a.heads / a.kv_heads
    );
    s
}

/// The inputs, the weights, Q, K and V, and one score worked out by hand (the last query
/// against the first key).
fn inputs_section(w: &Walkthrough) -> String {
    let (n, d) = (w.words.len(), w.d);
    let dims: Vec<String> = (0..d).map(|j| format!("{j}")).collect();
    let words = &w.words;
    let mut s = String::new();
    s += &matrix(
        "X",
        "the input vector of each word, one row per position",
        &w.x,
        words,
        &dims,
        1,
    );
    let wl: Vec<String> = (0..d).map(|j| format!("{j}")).collect();
    s += &matrix("W_Q", "query weights; q = W_Q x", &w.w_q, &wl, &dims, 1);
    s += &matrix("W_K", "key weights; k = W_K x", &w.w_k, &wl, &dims, 1);
    s += &matrix("W_V", "value weights; v = W_V x", &w.w_v, &wl, &dims, 1);
    s += &matrix(
        "Q",
        "row i is q_i = W_Q x_i: what position i is looking for",
        &w.q,
        words,
        &dims,
        2,
    );
    s += &matrix(
        "K",
        "row j is k_j = W_K x_j: what position j offers to be found by",
        &w.k,
        words,
        &dims,
        2,
    );
    s += &matrix(
        "V",
        "row j is v_j = W_V x_j: what position j hands over",
        &w.v,
        words,
        &dims,
        2,
    );
    // one entry worked out in full: the last query against the first key
    let (i, j) = (n - 1, 0);
    let qi = &w.q[i * d..][..d];
    let kj = &w.k[j * d..][..d];
    let terms: Vec<String> = qi
        .iter()
        .zip(kj)
        .map(|(a, b)| format!("({a:.2})·({b:.2})"))
        .collect();
    s += &format!(
        "One score by hand: q_{i}·k_{j} (\"{}\" looking at \"{}\") = {} = {:.4}\n\n",
        words[i],
        words[j],
        terms.join(" + "),
        dot(qi, kj)
    );
    s
}

/// The scores, scaled, masked and softmaxed (the last row by hand), and the output Y.
fn scores_section(w: &Walkthrough) -> String {
    let (n, d) = (w.words.len(), w.d);
    let dims: Vec<String> = (0..d).map(|j| format!("{j}")).collect();
    let words = &w.words;
    let i = n - 1;
    let mut s = String::new();
    s += &matrix(
        "Scores Q·Kᵀ",
        "entry (i, j) = q_i·k_j; rows are queries, columns keys",
        &w.steps.raw_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        &format!("Scaled scores Q·Kᵀ / √{d}"),
        &format!("divided by √d = {:.4}", (d as f32).sqrt()),
        &w.steps.scaled_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        "Masked scores",
        "the causal mask: a word may not look at later words, their scores become -inf",
        &w.steps.masked_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        "Weights = softmax(masked scores)",
        "each row sums to 1; masked entries are exactly 0",
        &w.steps.pattern,
        words,
        words,
        4,
    );
    // the softmax of the last row, by hand
    let row = &w.steps.masked_scores[i * n..][..n];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    s += &format!(
        "Softmax of row {i} by hand: subtract the max {max:.4}, exponentiate: [{}], sum {sum:.4}, divide: [{}]\n\n",
        exps.iter().map(|e| format!("{e:.4}")).collect::<Vec<_>>().join(", "),
        exps.iter().map(|e| format!("{:.4}", e / sum)).collect::<Vec<_>>().join(", ")
    );
    s += &matrix(
        "Y = weights · V",
        "row i is the weighted sum of the value vectors position i may see",
        &w.steps.out,
        words,
        &dims,
        4,
    );
    s
}

/// Why divide by √d: the softmax's max weight and entropy with and without the scale, per d.
fn scale_section(sat: &[(usize, f32, f32, f32, f32)]) -> String {
    let mut s = String::new();
    s += &title("Why divide by √d");
    s += "Softmax of q·k over 16 keys, q and k with independent N(0,1) entries, mean of 500 draws:\n";
    let mut t = Table::new([
        ("d", Align::Right),
        ("max weight, q·k/√d", Align::Right),
        ("entropy (nats)", Align::Right),
        ("max weight, q·k", Align::Right),
        ("entropy (nats)", Align::Right),
    ]);
    for &(d, sm, se, um, ue) in sat {
        t.row([
            d.to_string(),
            format!("{sm:.3}"),
            format!("{se:.3}"),
            format!("{um:.3}"),
            format!("{ue:.3}"),
        ]);
    }
    s += &t.render();
    s += &format!(
        "q·k has variance d, so without the scale the scores spread out as d grows and softmax puts almost everything on one key\n(entropy → 0; uniform would be ln 16 = {:.3}). Dividing by √d keeps the spread, and the weights, the same for every d.\n\n",
        16f32.ln()
    );
    s
}
