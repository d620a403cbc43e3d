//! `attnscope capture`: run a model and save the captured hook tensors to a file.

use super::common::{emit, parse_index_list, usage, ModelArgs, TextArgs};
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Observer, Queries};
use crate::model::forward::RunOptions;
use crate::render::tensorfile::{TensorFormat, TensorWriter};
use anyhow::Context;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Format {
    Safetensors,
    Npz,
}

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    text: TextArgs,
    /// Output file (.safetensors or .npz).
    #[arg(long, short = 'o')]
    out: PathBuf,
    /// Hooks to capture: pattern, scores, q, k, v, rot_q, rot_k, z, attn_out, resid (pre and
    /// post), resid_pre, resid_post, all.
    #[arg(long, default_value = "pattern")]
    hooks: String,
    /// Layers: all, 0-3, 0,12,23.
    #[arg(long, default_value = "all")]
    layers: String,
    /// Query heads (for pattern, scores, q, rot_q, z): all, 0-3, 1,5.
    #[arg(long, default_value = "all")]
    heads: String,
    /// Query positions kept: all, last, or a list such as 0,5,17.
    #[arg(long, default_value = "all")]
    queries: String,
    /// File format; by default from the extension of --out (safetensors otherwise).
    #[arg(long, value_enum)]
    format: Option<Format>,
    /// Replace --out if it exists.
    #[arg(long)]
    force: bool,
}

/// The forward's observer for `capture`: an [`AttnCache`] that, after each layer, writes that
/// layer's tensors to the file and lets them go, so memory holds one layer's capture at most.
struct StreamToFile<W: std::io::Write + std::io::Seek> {
    cache: AttnCache,
    writer: Option<TensorWriter<W>>,
    error: Option<std::io::Error>,
    bytes: u64,
    bar: indicatif::ProgressBar,
}

impl<W: std::io::Write + std::io::Seek> Observer for StreamToFile<W> {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        self.error.is_none() && self.cache.wants(layer, hook)
    }
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        self.cache.tensor(layer, hook, shape, data);
    }
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        self.cache
            .attention_block(layer, hook, q_start, shape, data);
    }
    fn layer_done(&mut self, layer: usize) {
        let keys: Vec<(usize, Hook)> = self
            .cache
            .entries
            .range((layer, Hook::ALL[0])..=(layer, Hook::ALL[Hook::ALL.len() - 1]))
            .map(|(k, _)| *k)
            .collect();
        for key in keys {
            let c = self.cache.entries.remove(&key).expect("listed above");
            if self.error.is_none() {
                if let Some(w) = self.writer.as_mut() {
                    match w.write(&c.name, &c.data) {
                        Ok(()) => self.bytes += c.data.len() as u64 * 4,
                        Err(e) => self.error = Some(e),
                    }
                }
            }
        }
        self.bar.inc(1);
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let format = a
        .format
        .unwrap_or(if a.out.extension().is_some_and(|e| e == "npz") {
            Format::Npz
        } else {
            Format::Safetensors
        });
    if a.out.exists() && !a.force {
        return Err(anyhow::Error::new(crate::model::Error::Exists {
            path: a.out.clone(),
        }));
    }
    let hooks = Hook::parse_list(&a.hooks).map_err(usage)?;
    let text = a.text.read()?;
    let model = a.model.load()?;
    let tokens = model.encode(&text, a.model.bos)?;
    let n = tokens.len();
    let d = &model.dims;
    if n > d.context_len {
        return Err(anyhow::Error::new(crate::model::Error::TooLong {
            n_tokens: n,
            limit: d.context_len,
            model: model.info.name.clone(),
        }));
    }
    let layers = parse_index_list(&a.layers, d.n_layers, "layer")?;
    let heads = parse_index_list(&a.heads, d.n_heads, "head")?;
    let queries = match a.queries.as_str() {
        "all" => Queries::All,
        "last" => Queries::Last,
        s => Queries::List(parse_index_list(s, n, "query position")?),
    };
    let spec = CaptureSpec {
        hooks,
        layers: Some(layers),
        heads: Some(heads),
        queries,
    };
    // every tensor's name and shape, in file order, before the forward
    let mut order = spec.tensors(d, n);
    if format == Format::Npz {
        order.push(("token_ids".into(), vec![n]));
    }
    let total_bytes: f64 = order
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as f64 * 4.0)
        .sum();
    let texts = model.token_texts(&tokens);
    let md = BTreeMap::from([
        ("token_ids".to_string(), serde_json::to_string(&tokens)?),
        ("token_strings".to_string(), serde_json::to_string(&texts)?),
        ("model".to_string(), model.info.name.clone()),
        (
            "model_description".to_string(),
            model.info.description.clone().unwrap_or_default(),
        ),
        (
            "precision".to_string(),
            model.info.precision.name().to_string(),
        ),
        (
            "queries".to_string(),
            serde_json::to_string(&spec.queries.resolve(n))?,
        ),
        ("heads".to_string(), serde_json::to_string(&spec.heads)?),
        (
            "producer".to_string(),
            format!("attnscope {}", env!("CARGO_PKG_VERSION")),
        ),
    ]);
    // write into a temporary file beside the target, renamed over it only when complete
    let dir = a
        .out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut builder = tempfile::Builder::new();
    builder.prefix(".attnscope-capture-");
    #[cfg(unix)]
    {
        // the mode of an ordinary new file (0666 less the umask), not the temporary file's 0600
        use std::os::unix::fs::PermissionsExt;
        builder.permissions(std::fs::Permissions::from_mode(0o666));
    }
    let tmp = builder
        .tempfile_in(dir)
        .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
    let file = std::io::BufWriter::with_capacity(4 << 20, tmp.as_file().try_clone()?);
    let tf = match format {
        Format::Safetensors => TensorFormat::Safetensors,
        Format::Npz => TensorFormat::Npz,
    };
    let n_tensors = order.len();
    let writer = TensorWriter::new(file, tf, order, &md)
        .with_context(|| format!("writing {}", a.out.display()))?;
    let terminal = std::io::stderr().is_terminal();
    let bar = if terminal {
        indicatif::ProgressBar::new(d.n_layers as u64)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "capture {msg} [{bar:30}] layer {pos}/{len} ({elapsed})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar.set_message(format!("{n} tokens, {:.1} GB", total_bytes / 1e9));
    if !terminal && total_bytes > 100e6 {
        eprintln!("attnscope: capturing {n_tensors} tensors ({:.1} GB) over {} layers of {n} tokens into {}", total_bytes / 1e9, d.n_layers, a.out.display());
    }
    let mut obs = StreamToFile {
        cache: AttnCache::new(&spec, n),
        writer: Some(writer),
        error: None,
        bytes: 0,
        bar,
    };
    model.forward(&tokens, &RunOptions::default(), &mut obs)?;
    obs.bar.finish_and_clear();
    if let Some(e) = obs.error.take() {
        return Err(anyhow::Error::new(e).context(format!("writing {}", a.out.display())));
    }
    let mut w = obs.writer.take().expect("set above");
    if tf == TensorFormat::Npz {
        let ids: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        w.write("token_ids", &ids)?;
    }
    w.finish()
        .with_context(|| format!("writing {}", a.out.display()))?
        .into_inner()
        .map_err(|e| e.into_error())
        .with_context(|| format!("writing {}", a.out.display()))?;
    let size = tmp.as_file().metadata()?.len();
    if a.force {
        tmp.persist(&a.out)
            .map_err(|e| e.error)
            .with_context(|| format!("renaming the capture to {}", a.out.display()))?;
    } else {
        // never replaces a file that appeared meanwhile
        tmp.persist_noclobber(&a.out).map_err(|e| {
            if e.error.kind() == std::io::ErrorKind::AlreadyExists {
                anyhow::Error::new(crate::model::Error::Exists {
                    path: a.out.clone(),
                })
            } else {
                anyhow::Error::new(e.error)
                    .context(format!("renaming the capture to {}", a.out.display()))
            }
        })?;
    }
    emit(&format!(
        "wrote {n_tensors} tensors ({:.1} MB) for {n} tokens of {} ({} precision) to {}\n",
        size as f64 / 1e6,
        model.info.name,
        model.info.precision.name(),
        a.out.display()
    ))
}
