//! Hugging Face model folders: `config.json`, `*.safetensors` (one file or shards with
//! `model.safetensors.index.json`), `tokenizer.json`; and hub ids through `hf-hub`.

use super::config::{Arch, GemmaSettings, ModelDims, RopeScaling, RopeStyle};
use super::error::{Error, Result};
use super::family::{hf_name, Window};
pub use super::hf_config::HfConfig;
use super::weights::{Logical, Raw, TensorSource};
use serde::Deserialize;
use std::path::{Path, PathBuf};

mod mapped;

pub struct HfFolder {
    pub dir: PathBuf,
    pub config: HfConfig,
    pub files: Vec<PathBuf>,
    /// The settings config.json leaves out and that were given transformers' defaults (said as
    /// warnings when the model loads).
    pub defaulted: Vec<String>,
    /// The base model's prefix of a checkpoint saved with a task head (`bert.`, `roberta.`,
    /// `distilbert.`: `BertForMaskedLM` and the like), stripped from its names.
    prefix: Option<&'static str>,
    /// Every tensor's place in the files (their headers, read at open), the files mapped once:
    /// F16 and BF16 tensors are handed out as these bytes, the others read from them.
    table: mapped::Table,
}

/// Task heads saved beside an encoder's base model (`BertForMaskedLM`'s `cls.predictions`,
/// RoBERTa's `lm_head`, DistilBERT's `vocab_*` and classifiers...): the forward reads none, and
/// they do not change the base model's numbers.
const TASK_HEADS: [&str; 10] = [
    "cls.",
    "lm_head.",
    "classifier.",
    "pre_classifier.",
    "qa_outputs.",
    "vocab_transform.",
    "vocab_layer_norm.",
    "vocab_projector.",
    "dropout.",
    "pooler_head.",
];

/// An encoder's settings that transformers' config classes give defaults (`BertConfig`,
/// `RobertaConfig`, `DistilBertConfig`: `layer_norm_eps` 1e-12, `max_position_embeddings` 512)
/// filled in where config.json leaves them out, as transformers reads it; returns what was
/// filled in, in words.
fn encoder_defaults(v: &mut serde_json::Value) -> Vec<String> {
    let Some(m) = v.as_object_mut() else {
        return Vec::new();
    };
    let mut filled = Vec::new();
    for (keys, default) in [
        (
            &["layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps"][..],
            serde_json::json!(1e-12),
        ),
        (
            &["max_position_embeddings", "n_positions"][..],
            serde_json::json!(512),
        ),
    ] {
        if keys.iter().all(|k| m.get(*k).is_none_or(|x| x.is_null())) {
            filled.push(format!(
                "config.json has no `{}`; transformers' default for the architecture, {default}, is used",
                keys[0]
            ));
            m.insert(keys[0].into(), default);
        }
    }
    filled
}

/// A folder's config.json (DistilBERT's keys under BERT's names, an encoder's missing settings
/// given transformers' defaults), and what was defaulted, in words.
fn read_config(dir: &Path) -> Result<(HfConfig, Vec<String>)> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        return Err(Error::NoConfig { path: dir.into() });
    }
    let mut raw: serde_json::Value = read_json(&cfg_path)?;
    let model_type = raw
        .get("model_type")
        .and_then(|t| t.as_str())
        .map(str::to_string);
    let model_type = model_type.as_deref();
    // a family's own config keys under the ones attnscope reads (DistilBERT's `dim`...)
    if let Some(rename) = model_type
        .and_then(super::family::parse)
        .and_then(|f| f.hf.config_keys)
    {
        rename(&mut raw);
    }
    let defaulted = if model_type
        .and_then(Arch::parse)
        .is_some_and(|a| a.is_encoder())
    {
        encoder_defaults(&mut raw)
    } else {
        Vec::new()
    };
    let config: HfConfig = serde_json::from_value(raw).map_err(|e| Error::BadValue {
        key: "config.json".into(),
        path: cfg_path.clone(),
        reason: format!("not valid JSON of the expected form: {e}"),
    })?;
    Ok((config, defaulted))
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::BadValue {
        key: "(file)".into(),
        path: path.into(),
        reason: format!("not valid JSON of the expected form: {e}"),
    })
}

impl HfFolder {
    pub fn open(dir: &Path) -> Result<Self> {
        let (config, defaulted) = read_config(dir)?;
        let index = dir.join("model.safetensors.index.json");
        let mut files: Vec<PathBuf> = if index.is_file() {
            #[derive(Deserialize)]
            struct Index {
                weight_map: std::collections::BTreeMap<String, String>,
            }
            let idx: Index = read_json(&index)?;
            let mut f: Vec<PathBuf> = idx.weight_map.values().map(|f| dir.join(f)).collect();
            f.sort();
            f.dedup();
            f
        } else {
            let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
                .collect()
        };
        files.sort();
        if files.is_empty() {
            return Err(Error::MissingTensor {
                name: "*.safetensors".into(),
                path: dir.into(),
                arch: config.model_type.clone().unwrap_or_default(),
                found: 0,
            });
        }
        for f in &files {
            check_safetensors_header(f)?;
        }
        // the loader boundary: a panic in the safetensors reader is the file's, not a crash
        let table = super::guard::quietly(|| mapped::Table::open(&files)).map_err(|msg| {
            Error::LoaderPanic {
                path: files[0].clone(),
                msg,
            }
        })??;
        let encoder = config
            .model_type
            .as_deref()
            .and_then(Arch::parse)
            .is_some_and(|a| a.is_encoder());
        // the prefixes under which transformers saves an encoder's base model beside a task head
        let mut prefixes = super::family::FAMILIES
            .iter()
            .filter_map(|f| f.hf.base_prefix);
        let prefix = prefixes.find(|p| {
            encoder
                && table
                    .entry(&format!("{p}embeddings.word_embeddings.weight"))
                    .is_some()
        });
        Ok(HfFolder {
            dir: dir.into(),
            config,
            files,
            defaulted,
            prefix,
            table,
        })
    }

    /// Refuses q/k/v biases in the file that transformers does not apply: Qwen2's attention
    /// always has them, Mistral's and Phi-3's never, the other RoPE families' only with
    /// `attention_bias: true` (Seed-OSS's default; the others' is false). The forward adds any
    /// bias the file has,
    /// so such a file would give other numbers than transformers', silently.
    fn check_qkv_biases(&self, r: &ConfigReader) -> Result<()> {
        let arch = r.arch;
        if arch == Arch::Qwen2 || arch.learned_positions() || arch.is_encoder() {
            return Ok(());
        }
        let name = format!(
            "{}{}",
            self.prefix.unwrap_or(""),
            hf_name_for(Some(arch), &Logical::QBias(0))
        );
        if self.table.entry(&name).is_none() {
            return Ok(());
        }
        // transformers' default: true for Seed-OSS, false for the others
        let default = arch == Arch::SeedOss;
        let said = r.set("attention_bias").and_then(|v| v.as_bool());
        let reason = match (arch, said.unwrap_or(default)) {
            (Arch::Mistral | Arch::Phi3, _) => format!(
                "; the file has q/k/v biases ({name}), which transformers' {} never applies: \
                 remove them from the file, or load it as a family that has them",
                r.a
            ),
            (_, true) => return Ok(()),
            _ => format!(
                "; the file has q/k/v biases ({name}), which transformers applies only with \
                 `attention_bias: true`: set it if they belong to the model, else remove them"
            ),
        };
        let value = r
            .set("attention_bias")
            .cloned()
            .unwrap_or(serde_json::Value::Bool(false));
        Err(r.unsupported("attention_bias", &value, &reason))
    }

    pub fn arch_string(&self) -> String {
        self.config
            .model_type
            .clone()
            .unwrap_or_else(|| "(no model_type)".into())
    }

    pub fn dims(&self) -> Result<ModelDims> {
        let c = &self.config;
        let a = self.arch_string();
        let arch = Arch::parse(&a)
            .ok_or_else(|| Error::unknown_arch(a.clone(), self.dir.join("config.json")))?;
        let r = ConfigReader {
            c,
            cfg: self.dir.join("config.json"),
            arch,
            a,
        };
        let rope = r.rope_parameters()?;
        let rope_base = r.rope_base(rope.params)?;
        let rope_scaling = r.rope_scaling(rope.params, rope.key)?;
        r.refuse_foreign_settings()?;
        let head_dim = c
            .head_dim
            .unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
        let rotary_dim = r.rotary_dim(rope.params, head_dim)?;
        r.check_activation()?;
        let sliding_window = r.sliding_window()?;
        let sliding_layers = r.sliding_layers(sliding_window)?;
        self.check_qkv_biases(&r)?;
        let position_pad = r.position_pad()?;
        let context_len = r.context_len(position_pad)?;
        let dims = ModelDims {
            arch,
            n_layers: c.num_hidden_layers,
            d_model: c.hidden_size,
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
            head_dim,
            d_ff: r.d_ff()?,
            vocab_size: c.vocab_size,
            context_len,
            rope_base,
            rope_scaling,
            sliding_window,
            rotary_dim,
            gemma: match sliding_layers {
                Some(layers) => {
                    Some(r.gemma_settings(layers, rope.sliding_base, rope_base, head_dim)?)
                }
                None => None,
            },
            // every HF checkpoint uses transformers' rotate_half: pairs (i, i + d/2)
            rope_style: RopeStyle::Neox,
            rms_eps: r.norm_eps()? as f32,
            tied_embeddings: c.tie_word_embeddings,
            type_vocab: r.type_vocab()?,
            position_pad,
        };
        dims.validate().map_err(|reason| Error::BadValue {
            key: "config.json".into(),
            path: self.dir.join("config.json"),
            reason,
        })?;
        Ok(dims)
    }

    /// The chat template (a string, or the entry named "default" of a list) from
    /// tokenizer_config.json, and the EOS id from config.json.
    pub fn chat_template(&self) -> (Option<String>, Option<u32>) {
        let cfg = std::fs::read_to_string(self.dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok());
        let tpl = cfg.as_ref().and_then(|v| match v.get("chat_template")? {
            serde_json::Value::String(s) => Some(s.clone()),
            serde_json::Value::Array(a) => a
                .iter()
                .find(|e| e.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|e| e.get("template")?.as_str().map(String::from)),
            _ => None,
        });
        let eos = self
            .config
            .eos_token_id
            .as_ref()
            .and_then(|v| v.as_u64().or_else(|| v.as_array()?.first()?.as_u64()))
            .map(|x| x as u32);
        (tpl, eos)
    }

    /// `add_bos_token` from tokenizer_config.json (false if absent) and the BOS id.
    pub fn bos(&self) -> (bool, Option<u32>) {
        let add = std::fs::read_to_string(self.dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|v| v.get("add_bos_token").and_then(|b| b.as_bool()))
            .unwrap_or(false);
        let id = self
            .config
            .bos_token_id
            .as_ref()
            .and_then(|v| v.as_u64())
            .map(|x| x as u32);
        (add, id)
    }

    /// The padding token's text from `tokenizer_config.json` (`pad_token`, else `eos_token`).
    pub fn pad_token(&self) -> Option<String> {
        let v = std::fs::read_to_string(self.dir.join("tokenizer_config.json"))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())?;
        let text = |key: &str| match v.get(key)? {
            serde_json::Value::String(s) => Some(s.clone()),
            o => o.get("content")?.as_str().map(str::to_string),
        };
        text("pad_token").or_else(|| text("eos_token"))
    }

    pub fn tensor_types(&self) -> std::collections::BTreeMap<String, usize> {
        let mut m = std::collections::BTreeMap::new();
        for (_, dtype) in self.table.listed() {
            *m.entry(format!("{dtype:?}")).or_insert(0) += 1;
        }
        m
    }
}

/// A folder's config.json read for [`HfFolder::dims`]: each method reads one concern and refuses,
/// naming the key, a setting attnscope does not implement.
struct ConfigReader<'a> {
    c: &'a HfConfig,
    /// config.json's path, for the messages.
    cfg: PathBuf,
    arch: Arch,
    /// `model_type` as written.
    a: String,
}

/// The RoPE parameters a config gives: the set for every (or every full-attention) layer, the key
/// it was read from, and Gemma 3's base for its sliding layers.
struct RopeParameters<'a> {
    params: Option<&'a serde_json::Value>,
    key: &'static str,
    sliding_base: Option<f64>,
}

impl<'a> ConfigReader<'a> {
    fn unsupported(&self, key: &str, value: &serde_json::Value, reason: &str) -> Error {
        Error::Unsupported {
            key: key.into(),
            value: value.to_string(),
            path: self.cfg.clone(),
            reason: reason.into(),
        }
    }

    fn bad_value(&self, key: &str, reason: String) -> Error {
        Error::BadValue {
            key: key.into(),
            path: self.cfg.clone(),
            reason,
        }
    }

    fn missing(&self, key: &str, arch: &str) -> Error {
        Error::MissingKey {
            key: key.into(),
            path: self.cfg.clone(),
            arch: arch.into(),
        }
    }

    /// A key outside the typed fields, when it is set (not null).
    fn set(&self, k: &str) -> Option<&'a serde_json::Value> {
        self.c.extra.get(k).filter(|v| !v.is_null())
    }

    /// RoPE: transformers 5's `rope_parameters`, or the hub's `rope_theta` + `rope_scaling`; one
    /// flat set of them for every layer (Gemma 3's per-layer-type sets: the full layers' set,
    /// and the sliding layers' base).
    fn rope_parameters(&self) -> Result<RopeParameters<'a>> {
        let c = self.c;
        let (mut params, mut key) = match (&c.rope_parameters, &c.rope_scaling) {
            (Some(p), _) if !p.is_null() => (Some(p), "rope_parameters"),
            (_, Some(p)) if !p.is_null() => (Some(p), "rope_scaling"),
            _ => (None, ""),
        };
        // Gemma 3 (transformers 5): one set per layer type; the hub: `rope_local_base_freq`
        let mut sliding_base = c.extra.get("rope_local_base_freq").and_then(|v| v.as_f64());
        let per_type = (self.arch.family().gemma.as_ref()).is_some_and(|g| g.local_base.is_some());
        if let (true, Some(p)) = (per_type, params) {
            if let (Some(full), Some(local)) = (p.get("full_attention"), p.get("sliding_attention"))
            {
                let kind = local.get("rope_type").and_then(|t| t.as_str());
                if kind.is_some_and(|k| k != "default") {
                    return Err(self.unsupported(
                        "rope_parameters.sliding_attention.rope_type",
                        &local["rope_type"],
                        "; attnscope implements the default RoPE on sliding layers",
                    ));
                }
                sliding_base = local.get("rope_theta").and_then(|v| v.as_f64());
                params = Some(full);
                key = "rope_parameters.full_attention";
            }
        }
        if let Some(p) = params {
            let flat = p.is_object()
                && (p.get("rope_type").is_some()
                    || p.get("type").is_some()
                    || p.get("rope_theta").is_some());
            if !flat {
                return Err(self.unsupported(
                    key,
                    p,
                    "; attnscope reads one set of RoPE parameters for every layer",
                ));
            }
        }
        Ok(RopeParameters {
            params,
            key,
            sliding_base,
        })
    }

    /// RoPE's base (`rope_theta`); GPT-2's learned positions use none.
    fn rope_base(&self, params: Option<&serde_json::Value>) -> Result<f32> {
        let theta = params
            .and_then(|p| p.get("rope_theta"))
            .and_then(|v| v.as_f64())
            .or(self.c.rope_theta);
        match theta {
            Some(t) => Ok(t as f32),
            // GPT-2 has learned positions and no RoPE: the base is never used
            None if self.arch.learned_positions() => Ok(10000.0),
            None => Err(self.missing("rope_theta", &self.a)),
        }
    }

    /// The RoPE type: the default, or llama3's scaling with its four checked parameters.
    fn rope_scaling(&self, params: Option<&serde_json::Value>, pkey: &str) -> Result<RopeScaling> {
        let rope_type = params.and_then(|p| p.get("rope_type").or_else(|| p.get("type")));
        match rope_type.map(|t| (t, t.as_str())) {
            None | Some((_, Some("default"))) => Ok(RopeScaling::Default),
            Some((_, Some("llama3"))) => {
                let p = params.expect("a rope type comes from the parameters");
                let num = |k: &str| -> Result<f32> {
                    p.get(k)
                        .and_then(|v| v.as_f64())
                        .map(|x| x as f32)
                        .ok_or_else(|| self.missing(&format!("{pkey}.{k}"), "llama3-scaled"))
                };
                let (factor, low_freq_factor, high_freq_factor, original_context) = (
                    num("factor")?,
                    num("low_freq_factor")?,
                    num("high_freq_factor")?,
                    num("original_max_position_embeddings")?,
                );
                if !(factor > 0.0
                    && low_freq_factor > 0.0
                    && high_freq_factor > low_freq_factor
                    && original_context > 0.0)
                {
                    return Err(self.bad_value(pkey, "llama3 scaling needs factor > 0, low_freq_factor > 0, high_freq_factor > low_freq_factor and original_max_position_embeddings > 0".into()));
                }
                Ok(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_context,
                })
            }
            Some((v, _)) => Err(self.unsupported(
                &format!("{pkey}.rope_type"),
                v,
                "; attnscope implements the default RoPE and llama3 scaling",
            )),
        }
    }

    /// Settings of other families that change every number (Gemma's own are read later).
    fn refuse_foreign_settings(&self) -> Result<()> {
        let reads = self.arch.family().hf.reads;
        for k in [
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "query_pre_attn_scalar",
            "embedding_multiplier",
            "residual_multiplier",
            "attention_multiplier",
            "logits_scaling",
        ] {
            if let Some(v) = self.set(k).filter(|_| !reads.contains(&k)) {
                return Err(self.unsupported(k, v, ""));
            }
        }
        Ok(())
    }

    /// Partial rotary (Phi-3): only the first `factor · head_dim` dimensions of a head rotate.
    fn rotary_dim(&self, params: Option<&serde_json::Value>, head_dim: usize) -> Result<usize> {
        let factor = params
            .and_then(|p| p.get("partial_rotary_factor"))
            .or(self.set("partial_rotary_factor"));
        match factor {
            None => Ok(head_dim),
            Some(f) => match f.as_f64() {
                Some(x) if x > 0.0 && x <= 1.0 && (x * head_dim as f64).fract() == 0.0 => {
                    Ok((x * head_dim as f64) as usize)
                }
                _ => Err(self.bad_value(
                    "partial_rotary_factor",
                    format!("{f} is not a factor in (0, 1] giving a whole number of the {head_dim} dimensions of a head"),
                )),
            },
        }
    }

    /// The MLP's activation and the attention's kind, as each family implements them (its
    /// file's checks).
    fn check_activation(&self) -> Result<()> {
        for c in self.arch.family().hf.checks {
            if let Some(v) = self.set(c.key).filter(|v| !c.want.accepts(v)) {
                return Err(self.unsupported(c.key, v, c.why));
            }
        }
        Ok(())
    }

    /// The sliding window, for the families that have one on every (or Gemma's sliding) layer.
    fn sliding_window(&self) -> Result<Option<usize>> {
        let Some(v) = self.set("sliding_window") else {
            return Ok(None);
        };
        match self.arch.family().hf.window {
            Window::Read => match v.as_u64() {
                Some(w) if w > 0 => Ok(Some(w as usize)),
                _ => Err(self.bad_value(
                    "sliding_window",
                    format!("{v} is not a positive whole number"),
                )),
            },
            // Qwen configs carry a window with `use_sliding_window: false`: then it is unused
            Window::UnlessUsed => {
                if self.set("use_sliding_window").and_then(|u| u.as_bool()) == Some(true) {
                    return Err(self.unsupported(
                        "use_sliding_window",
                        &true.into(),
                        "; attnscope implements Mistral's window on every layer, not Qwen's per-layer windows",
                    ));
                }
                Ok(None)
            }
            Window::Refused => Err(self.unsupported(
                "sliding_window",
                v,
                &format!(
                    "; for a {} model attnscope attends to every earlier token",
                    self.arch.family().name
                ),
            )),
        }
    }

    /// Gemma's per-layer kinds (true: sliding), from `layer_types` or the hub's pattern; other
    /// families must have one kind on every layer.
    fn sliding_layers(&self, sliding_window: Option<usize>) -> Result<Option<Vec<bool>>> {
        if !self.arch.is_gemma() {
            if let Some(v) = self.set("layer_types") {
                let expected = if sliding_window.is_some() {
                    "sliding_attention"
                } else {
                    "full_attention"
                };
                let all_full = v
                    .as_array()
                    .is_some_and(|a| a.iter().all(|t| t.as_str() == Some(expected)));
                if !all_full {
                    return Err(self.unsupported(
                        "layer_types",
                        v,
                        "; attnscope attends to every earlier token in every layer",
                    ));
                }
            }
            return Ok(None);
        }
        let n = self.c.num_hidden_layers;
        let layers: Vec<bool> = match self.set("layer_types") {
            Some(v) => {
                let a = v.as_array().filter(|a| a.len() == n).ok_or_else(|| {
                    self.bad_value("layer_types", format!("expected a list of {n} layer types"))
                })?;
                a.iter()
                    .map(|t| match t.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(self.unsupported(
                            "layer_types",
                            v,
                            "; attnscope knows sliding_attention and full_attention",
                        )),
                    })
                    .collect::<Result<_>>()?
            }
            None => {
                // the hub's style: Gemma 2 alternates (even layers slide); Gemma 3 has
                // `sliding_window_pattern` N (every Nth layer is full)
                let pattern = self
                    .set("sliding_window_pattern")
                    .or(self.set("_sliding_window_pattern"))
                    .and_then(|v| v.as_u64())
                    .unwrap_or(self.arch.family().gemma.as_ref().map_or(6, |g| g.pattern) as u64)
                    as usize;
                (0..n).map(|i| (i + 1) % pattern.max(1) != 0).collect()
            }
        };
        if sliding_window.is_none() && layers.iter().any(|&b| b) {
            return Err(self.missing("sliding_window", &self.a));
        }
        Ok(Some(layers))
    }

    /// RoBERTa: positions from padding_idx + 1 (transformers' create_position_ids_from_input_ids).
    fn position_pad(&self) -> Result<Option<usize>> {
        match self.arch.family().hf.position_pad {
            true => match self.set("pad_token_id").map(|v| v.as_u64()) {
                Some(Some(p)) if p < 1 << 20 => Ok(Some(p as usize)),
                None => Ok(Some(1)),
                Some(_) => Err(self.bad_value(
                    "pad_token_id",
                    "not a whole number (RoBERTa's positions count from it)".into(),
                )),
            },
            false => Ok(None),
        }
    }

    /// The norms' epsilon; a config without one is refused naming the key its family's
    /// config.json writes (GPT-2's `layer_norm_epsilon`, an encoder's `layer_norm_eps`).
    fn norm_eps(&self) -> Result<f64> {
        self.c.rms_norm_eps.ok_or_else(|| {
            let key = self.arch.family().hf.eps_key;
            Error::MissingKey {
                key: key.into(),
                path: self.cfg.clone(),
                arch: self.a.clone(),
            }
        })
    }

    /// The longest text: the position table, less RoBERTa's padding positions.
    fn context_len(&self, position_pad: Option<usize>) -> Result<usize> {
        let context_len = self.c.max_position_embeddings.unwrap_or(32768);
        let Some(p) = position_pad else {
            return Ok(context_len);
        };
        context_len
            .checked_sub(p + 1)
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                self.bad_value(
                    "max_position_embeddings",
                    format!(
                        "{context_len} positions leave none for a text after RoBERTa's padding_idx {p} + 1"
                    ),
                )
            })
    }

    /// The MLP's width (GPT-2's default: 4 × the model's).
    fn d_ff(&self) -> Result<usize> {
        match (self.c.intermediate_size, self.arch.family().hf.d_ff_default) {
            (Some(ff), _) => Ok(ff),
            (None, Some(times)) => Ok(times * self.c.hidden_size),
            (None, None) => Err(self.missing("intermediate_size", &self.a)),
        }
    }

    /// Gemma's scalings, soft-caps and per-layer windows.
    fn gemma_settings(
        &self,
        layers: Vec<bool>,
        sliding_base: Option<f64>,
        rope_base: f32,
        head_dim: usize,
    ) -> Result<GemmaSettings> {
        let f = |k: &str| self.set(k).and_then(|v| v.as_f64());
        Ok(GemmaSettings {
            embed_scale: (self.c.hidden_size as f64).sqrt() as f32,
            query_scale: f("query_pre_attn_scalar")
                .map(|q| q.powf(-0.5) as f32)
                .unwrap_or(1.0 / (head_dim as f32).sqrt()),
            attn_softcap: f("attn_logit_softcapping").map(|x| x as f32),
            final_softcap: f("final_logit_softcapping").map(|x| x as f32),
            sliding_layers: layers,
            // Gemma 3's sliding layers have a base of their own, which config.json must give
            rope_base_sliding: match self.arch.family().gemma.as_ref().and_then(|g| g.local_base) {
                Some(_) => sliding_base
                    .ok_or_else(|| self.missing("rope_local_base_freq", &self.a))?
                    as f32,
                None => rope_base,
            },
            norms_include_one: false,
        })
    }

    /// Token-type embeddings (BERT, RoBERTa; none elsewhere).
    fn type_vocab(&self) -> Result<usize> {
        match self.arch.family().token_types {
            true => match self.set("type_vocab_size").map(|v| v.as_u64()) {
                None => Ok(2),
                Some(Some(t)) if (1..=1024).contains(&t) => Ok(t as usize),
                Some(_) => {
                    Err(self.bad_value("type_vocab_size", "not a whole number in 1..=1024".into()))
                }
            },
            false => Ok(0),
        }
    }
}

/// Reads a safetensors header length and checks it fits the file, for a clear error before mmap.
fn check_safetensors_header(path: &Path) -> Result<()> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let size = f.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut head = [0u8; 9];
    let mut n = 0;
    while n < 9 {
        match f.read(&mut head[n..]).map_err(|e| Error::io(path, e))? {
            0 => break,
            k => n += k,
        }
    }
    if n < 9 {
        return Err(Error::BadSafetensors {
            path: path.into(),
            reason: format!("the file is only {size} bytes long"),
        });
    }
    let len = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
    if head[8] != b'{' {
        return Err(Error::WrongMagic {
            path: path.into(),
            magic: head.to_vec(),
        });
    }
    if len > size.saturating_sub(8) {
        return Err(Error::BadSafetensors {
            path: path.into(),
            reason: format!("the header claims {len} bytes but the file has {size}"),
        });
    }
    Ok(())
}

/// Hugging Face's name for a logical weight of an `arch` model (its family's table: Gemma names
/// its norms differently, GPT-2 and the encoders everything their own way).
pub fn hf_name_for(arch: Option<Arch>, l: &Logical) -> String {
    match arch {
        Some(a) => (a.family().hf.name)(l),
        None => hf_name(l),
    }
}

/// Phi-3's fused projections: the fused tensor, the part's first row and its row count.
fn fused_part(c: &HfConfig, l: &Logical) -> Option<(String, usize, usize)> {
    let hd = c
        .head_dim
        .unwrap_or(c.hidden_size / c.num_attention_heads.max(1));
    let (nq, nk) = (
        c.num_attention_heads * hd,
        c.num_key_value_heads.unwrap_or(c.num_attention_heads) * hd,
    );
    let ff = c.intermediate_size.unwrap_or(4 * c.hidden_size);
    let qkv = |i: &usize| format!("model.layers.{i}.self_attn.qkv_proj.weight");
    let gu = |i: &usize| format!("model.layers.{i}.mlp.gate_up_proj.weight");
    match l {
        Logical::Q(i) => Some((qkv(i), 0, nq)),
        Logical::K(i) => Some((qkv(i), nq, nk)),
        Logical::V(i) => Some((qkv(i), nq + nk, nk)),
        Logical::Gate(i) => Some((gu(i), 0, ff)),
        Logical::Up(i) => Some((gu(i), ff, ff)),
        _ => None,
    }
}

impl HfFolder {
    /// Tensor `name` as the safetensors reader gives it; a panic inside the reader comes back
    /// as an error (the loader boundary).
    fn load_tensor(&self, name: &str) -> Result<candle_core::Tensor> {
        let bad = |reason: String| Error::BadSafetensors {
            path: self.dir.clone(),
            reason: format!("tensor `{name}`: {reason}"),
        };
        match super::guard::quietly(|| self.table.load(name)) {
            Ok(t) => t.map_err(|e| bad(super::error::candle_message(&e))),
            Err(msg) => Err(bad(format!("the safetensors reader failed ({msg})"))),
        }
    }
}

impl TensorSource for HfFolder {
    fn get(&mut self, l: &Logical) -> Result<Option<Raw>> {
        let arch = Arch::parse(&self.arch_string());
        if let Some(part) = arch.and_then(|a| a.family().hf.conv1d) {
            let (name, cols, transposed) = part(&self.config, l);
            if self.table.entry(&name).is_none() {
                return Ok(None);
            }
            let bad = |e: candle_core::Error| Error::BadSafetensors {
                path: self.dir.clone(),
                reason: format!("tensor `{name}`: {}", super::error::candle_message(&e)),
            };
            let mut t = self.load_tensor(&name)?;
            if let Some((start, len)) = cols {
                let last = t.rank() - 1;
                if t.dim(last).map_err(bad)? < start + len {
                    return Err(Error::ShapeMismatch {
                        name,
                        path: self.dir.clone(),
                        got: t.dims().to_vec(),
                        want: vec![self.config.hidden_size, 3 * self.config.hidden_size],
                    });
                }
                t = t.narrow(last, start, len).map_err(bad)?;
            }
            if transposed {
                t = t.t().map_err(bad)?;
            }
            return Ok(Some(Raw::F(t.contiguous().map_err(bad)?)));
        }
        let name = format!("{}{}", self.prefix.unwrap_or(""), hf_name_for(arch, l));
        // F16/BF16: the file's own bytes, decoded where they are read (no f32 copy)
        if let Some(m) = self.table.half(&name, None) {
            return Ok(Some(Raw::Mapped(m)));
        }
        if self.table.entry(&name).is_none() {
            // Phi-3 stores q|k|v and gate|up fused: read the part's rows
            if let Some((fused, start, len)) = fused_part(&self.config, l) {
                if let Some(m) = self.table.half(&fused, Some((start, len))) {
                    return Ok(Some(Raw::Mapped(m)));
                }
                if self.table.entry(&fused).is_some() {
                    let bad = |e: candle_core::Error| Error::BadSafetensors {
                        path: self.dir.clone(),
                        reason: format!("tensor `{fused}`: {}", super::error::candle_message(&e)),
                    };
                    let t = self.load_tensor(&fused)?;
                    if t.dim(0).map_err(bad)? < start + len {
                        return Err(Error::ShapeMismatch {
                            name: fused,
                            path: self.dir.clone(),
                            got: t.dims().to_vec(),
                            want: vec![start + len, self.config.hidden_size],
                        });
                    }
                    return Ok(Some(Raw::F(
                        t.narrow(0, start, len)
                            .map_err(bad)?
                            .contiguous()
                            .map_err(bad)?,
                    )));
                }
            }
            return Ok(None);
        }
        let t = self.load_tensor(&name)?;
        Ok(Some(Raw::F(t)))
    }
    fn path(&self) -> &Path {
        &self.dir
    }
    fn count(&self) -> usize {
        self.table.listed().len()
    }
    fn arch_name(&self) -> String {
        self.arch_string()
    }
    fn names(&self) -> Vec<String> {
        // a fused tensor stands for the parts it is read as
        let mut out = Vec::new();
        for n in self.table.listed().iter().map(|(n, _)| n.clone()) {
            // a checkpoint with a task head: the base model's names without their prefix, and
            // the head's left out (anything else is kept, and refused if the forward skips it)
            let n = match self.prefix {
                Some(p) => match n.strip_prefix(p) {
                    Some(base) => base.to_string(),
                    None if TASK_HEADS.iter().any(|h| n.starts_with(h)) => continue,
                    None => n,
                },
                None => n,
            };
            let split: Option<&[&str]> = if n.ends_with(".self_attn.qkv_proj.weight") {
                Some(&["q_proj", "k_proj", "v_proj"])
            } else if n.ends_with(".mlp.gate_up_proj.weight") {
                Some(&["gate_proj", "up_proj"])
            } else {
                None
            };
            match split {
                Some(parts) => {
                    // `model.layers.0.self_attn.qkv_proj.weight` → `model.layers.0.self_attn`
                    let stem = n.rsplitn(3, '.').nth(2).unwrap_or_default();
                    out.extend(parts.iter().map(|p| format!("{stem}.{p}.weight")));
                }
                None => out.push(n),
            }
        }
        out
    }
}

/// Downloads a hub model (`org/name`) with `hf-hub` into its cache and returns the folder.
pub fn fetch_hub(id: &str) -> Result<PathBuf> {
    let api = hf_hub::api::sync::ApiBuilder::new()
        .with_progress(true)
        .build()
        .map_err(|e| Error::Fetch(format!("cannot set up the Hugging Face hub client: {e}")))?;
    let repo = api.model(id.to_string());
    let offline = |e: hf_hub::api::sync::ApiError| {
        Error::Fetch(format!(
            "cannot download `{id}` from the Hugging Face hub ({e}); this machine may be offline. Download the folder elsewhere (config.json, *.safetensors, tokenizer.json) and pass its path with --model"
        ))
    };
    let cfg = repo.get("config.json").map_err(offline)?;
    repo.get("tokenizer.json").map_err(offline)?;
    let _ = repo.get("tokenizer_config.json");
    match repo.get("model.safetensors.index.json") {
        Ok(index) => {
            let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::Fetch(format!("bad index for {id}: {e}")))?;
            let mut files: Vec<String> = v["weight_map"]
                .as_object()
                .map(|m| {
                    m.values()
                        .filter_map(|x| x.as_str().map(String::from))
                        .collect()
                })
                .unwrap_or_default();
            files.sort();
            files.dedup();
            for f in files {
                repo.get(&f).map_err(offline)?;
            }
        }
        Err(_) => {
            repo.get("model.safetensors").map_err(offline)?;
        }
    }
    Ok(cfg
        .parent()
        .expect("a downloaded file has a folder")
        .to_path_buf())
}
