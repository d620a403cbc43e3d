//! `attnscope capture`: run a model and save the captured hook tensors to a file.

use super::common::{emit, parse_index_list, usage, write_new_file, ModelArgs, TextArgs};
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use crate::model::forward::RunOptions;
use crate::render::tensorfile::{to_npz, to_safetensors, NamedTensor};
use std::collections::BTreeMap;
use std::path::PathBuf;

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

pub fn run(a: Args) -> anyhow::Result<()> {
    let format = a.format.unwrap_or(if a.out.extension().is_some_and(|e| e == "npz") { Format::Npz } else { Format::Safetensors });
    if a.out.exists() && !a.force {
        return Err(anyhow::Error::new(crate::model::Error::Exists { path: a.out.clone() }));
    }
    let hooks = Hook::parse_list(&a.hooks).map_err(usage)?;
    let text = a.text.read()?;
    let model = a.model.load()?;
    let tokens = model.encode(&text, a.model.bos)?;
    let n = tokens.len();
    let d = &model.dims;
    let layers = parse_index_list(&a.layers, d.n_layers, "layer")?;
    let heads = parse_index_list(&a.heads, d.n_heads, "head")?;
    let queries = match a.queries.as_str() {
        "all" => Queries::All,
        "last" => Queries::Last,
        s => Queries::List(parse_index_list(s, n, "query position")?),
    };
    let spec = CaptureSpec { hooks, layers: Some(layers), heads: Some(heads), queries };
    let mut cache = AttnCache::new(&spec, n);
    model.forward(&tokens, &RunOptions::default(), &mut cache)?;
    let texts = model.token_texts(&tokens);
    let tensors: Vec<NamedTensor<'_>> = cache.iter().map(|c| NamedTensor { name: &c.name, shape: &c.shape, data: &c.data }).collect();
    let bytes = match format {
        Format::Safetensors => {
            let md = BTreeMap::from([
                ("token_ids".to_string(), serde_json::to_string(&tokens)?),
                ("token_strings".to_string(), serde_json::to_string(&texts)?),
                ("model".to_string(), model.info.name.clone()),
                ("model_description".to_string(), model.info.description.clone().unwrap_or_default()),
                ("precision".to_string(), model.info.precision.name().to_string()),
                ("queries".to_string(), serde_json::to_string(&spec.queries.resolve(n))?),
                ("heads".to_string(), serde_json::to_string(&spec.heads)?),
                ("producer".to_string(), format!("attnscope {}", env!("CARGO_PKG_VERSION"))),
            ]);
            to_safetensors(&tensors, &md)
        }
        Format::Npz => {
            let ids: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
            let mut all = tensors;
            let shape = [n];
            all.push(NamedTensor { name: "token_ids", shape: &shape, data: &ids });
            to_npz(&all)
        }
    };
    write_new_file(&a.out, &bytes, a.force)?;
    emit(&format!(
        "wrote {} tensors ({:.1} MB) for {n} tokens of {} ({} precision) to {}\n",
        cache.entries.len(),
        bytes.len() as f64 / 1e6,
        model.info.name,
        model.info.precision.name(),
        a.out.display()
    ))
}
