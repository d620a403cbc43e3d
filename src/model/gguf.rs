//! GGUF files (llama.cpp's format): header, metadata → [`ModelDims`], tensors by name.
//! candle's `gguf_file` reads the container (it bounds every count and length by the file size);
//! this file maps GGUF keys and tensor names into attnscope's vocabulary.

pub use super::backing::Backing;
use super::config::{Arch, GemmaSettings, ModelDims, RopeScaling, RopeStyle};
use super::error::{Error, Result};
use super::family::gguf_name;
use super::weights::{BlockType, Logical, Mapped, Raw, TensorSource};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use memmap2::Mmap;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Tensors every layer has at least: two norms, q, k, v, o, gate, up, down.
const TENSORS_PER_LAYER: usize = 9;

/// Walks the metadata and tensor infos of a GGUF file (without allocating by any count in it)
/// and checks `general.alignment` (GGUF stores it as a u32 power of two: anything else would make
/// the tensor data start somewhere else than the writer meant, or divide by zero inside candle)
/// and that every tensor's block type is one attnscope reads (named with the tensor if not).
/// A file that ends early or is malformed passes here: candle's reader reports that.
///
/// Returns the tensors of a type attnscope reads itself (IQ4_NL, IQ4_XS: candle's reader refuses
/// their ids): each one's name, the byte offset of its type id, and its type.
pub fn check_header(b: &[u8]) -> std::result::Result<(Vec<OwnTyped>, usize), String> {
    let mut own = Vec::new();
    let mut c = Cur(b, 4);
    // `None` below: the header ends early or is malformed (candle's reader says so)
    let Some((n_tensors, n_kv)) = header_counts(&mut c) else {
        return Ok((own, b.len()));
    };
    if check_metadata(&mut c, n_kv)?.is_none()
        || check_tensor_infos(&mut c, n_tensors, &mut own)?.is_none()
    {
        return Ok((own, b.len()));
    }
    Ok((own, c.1))
}

/// A cursor over a GGUF header's bytes: the bytes and the position; every read is `None`
/// past the end.
struct Cur<'a>(&'a [u8], usize);

impl Cur<'_> {
    /// The next `n` bytes.
    fn take(&mut self, n: u64) -> Option<&[u8]> {
        let n = usize::try_from(n).ok()?;
        let end = self.1.checked_add(n)?;
        let s = self.0.get(self.1..end)?;
        self.1 = end;
        Some(s)
    }
    /// A little-endian u32.
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|s| u32::from_le_bytes(s.try_into().expect("4 bytes")))
    }
    /// A little-endian u64.
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|s| u64::from_le_bytes(s.try_into().expect("8 bytes")))
    }
    /// Skips a metadata value of type `ty` (arrays nested at most 4 deep).
    fn skip(&mut self, ty: u32, depth: u32) -> Option<()> {
        match ty {
            0 | 1 | 7 => self.take(1).map(drop),
            2 | 3 => self.take(2).map(drop),
            4..=6 => self.take(4).map(drop),
            10..=12 => self.take(8).map(drop),
            8 => {
                let n = self.u64()?;
                self.take(n).map(drop)
            }
            9 if depth < 4 => {
                let (et, count) = (self.u32()?, self.u64()?);
                // each element takes at least one byte: a count beyond the file is malformed
                if count > (self.0.len() - self.1) as u64 {
                    return None;
                }
                (0..count).try_for_each(|_| self.skip(et, depth + 1))
            }
            _ => None,
        }
    }
}

/// The version (2 or 3; another is `None`), then the tensors' and the metadata's counts.
fn header_counts(c: &mut Cur) -> Option<(u64, u64)> {
    let version = c.u32()?;
    if !(2..=3).contains(&version) {
        return None;
    }
    Some((c.u64()?, c.u64()?))
}

/// The `n_kv` metadata entries skipped, `general.alignment` checked (a power of two, stored as
/// an integer). `Ok(None)`: the header ends early or is malformed.
fn check_metadata(c: &mut Cur, n_kv: u64) -> std::result::Result<Option<()>, String> {
    for _ in 0..n_kv {
        let Some(klen) = c.u64() else {
            return Ok(None);
        };
        let Some(key) = c.take(klen).map(|k| k.to_vec()) else {
            return Ok(None);
        };
        let Some(ty) = c.u32() else {
            return Ok(None);
        };
        if key == b"general.alignment" {
            let v = match ty {
                0 => c.take(1).map(|s| s[0] as i64),
                1 => c.take(1).map(|s| s[0] as i8 as i64),
                2 => c.take(2).map(|s| u16::from_le_bytes([s[0], s[1]]) as i64),
                3 => c.take(2).map(|s| i16::from_le_bytes([s[0], s[1]]) as i64),
                4 => c.u32().map(|v| v as i64),
                5 => c.u32().map(|v| v as i32 as i64),
                _ => return Err(format!("general.alignment has value type {ty}; GGUF stores it as an unsigned 32-bit integer")),
            };
            let Some(v) = v else {
                return Ok(None);
            };
            if v < 1 || (v as u64).count_ones() != 1 {
                return Err(format!("general.alignment is {v}; it must be a power of two (1, 2, 4, ..., usually 32)"));
            }
        } else if c.skip(ty, 0).is_none() {
            return Ok(None);
        }
    }
    Ok(Some(()))
}

/// The `n_tensors` tensor infos (name, n_dims, dims, type, offset): a block type candle's
/// reader does not know is named here with its tensor (candle says only "unknown dtype for
/// tensor 20"); the types attnscope reads itself are collected in `own`. `Ok(None)`: the
/// header ends early or is malformed.
fn check_tensor_infos(
    c: &mut Cur,
    n_tensors: u64,
    own: &mut Vec<OwnTyped>,
) -> std::result::Result<Option<()>, String> {
    for _ in 0..n_tensors {
        let Some(nlen) = c.u64() else {
            return Ok(None);
        };
        let Some(name) = c
            .take(nlen)
            .map(|k| String::from_utf8_lossy(k).into_owned())
        else {
            return Ok(None);
        };
        let Some(n_dims) = c.u32() else {
            return Ok(None);
        };
        if c.take(8 * n_dims as u64).is_none() {
            return Ok(None);
        }
        let at = c.1;
        let Some(ty) = c.u32() else {
            return Ok(None);
        };
        if let Some(t) = BlockType::own(ty) {
            own.push(OwnTyped { name, at, ty: t });
            if c.u64().is_none() {
                return Ok(None);
            }
            continue;
        }
        if let Some(what) = unread_block_type(ty) {
            return Err(format!(
                "tensor `{name}` has block type {ty} ({what}), which attnscope cannot read; it \
                 reads F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL and \
                 IQ4_XS: use a file quantized to one of them (e.g. Q4_K_M or Q8_0)"
            ));
        }
        if c.u64().is_none() {
            return Ok(None);
        }
    }
    Ok(Some(()))
}

/// A tensor whose block type attnscope reads itself, as [`check_header`] found it.
#[derive(Clone, Debug)]
pub struct OwnTyped {
    /// The tensor's name.
    pub name: String,
    /// Where its type id lies in the file.
    pub at: usize,
    /// Its type.
    pub ty: BlockType,
}

/// The name of a GGML block type that attnscope does not read (`None` for those it reads).
fn unread_block_type(ty: u32) -> Option<&'static str> {
    Some(match ty {
        0..=3 | 6..=15 | 20 | 23 | 30 => return None,
        4 | 5 => "Q4_2/Q4_3, removed from GGML in 2023",
        16 => "IQ2_XXS",
        17 => "IQ2_XS",
        18 => "IQ3_XXS",
        19 => "IQ1_S",
        21 => "IQ3_S",
        22 => "IQ2_S",
        24 => "I8",
        25 => "I16",
        26 => "I32",
        27 => "I64",
        28 => "F64",
        29 => "IQ1_M",
        34 => "TQ1_0",
        35 => "TQ2_0",
        39 => "MXFP4",
        _ => "a type id no GGML version defines",
    })
}

pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    map: Arc<Backing>,
    pub file_size: u64,
    pub version: u32,
    /// The architecture and fused-tensor sizes, read from the metadata once, on the first
    /// tensor asked for.
    layout: Option<Layout>,
    /// The tensors of a type candle's reader does not know (IQ4_NL, IQ4_XS), by name: their
    /// `content.tensor_infos` entry holds a stand-in type.
    own_types: std::collections::HashMap<String, BlockType>,
}

/// What [`TensorSource::get`] needs to name and cut a tensor.
#[derive(Clone, Copy, Debug)]
struct Layout {
    arch: Option<Arch>,
    /// Rows of q, of k (= of v) and of the gate (= of up) inside Phi-3's and GPT-2's fused
    /// `attn_qkv` / `ffn_up`.
    fused: Option<(usize, usize, usize)>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let f = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: mapped read-only; attnscope never writes model files (a concurrent external
        // writer could change what is read, as with any mmap; the cache is only ever renamed into).
        let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io(path, e))?;
        Self::from_backing(path, Backing::Map(map))
    }

    /// A GGUF file held in memory; `name` stands in for the path in messages.
    pub fn from_bytes(name: &Path, bytes: Vec<u8>) -> Result<Self> {
        Self::from_backing(name, Backing::Bytes(bytes))
    }

    fn from_backing(path: &Path, map: Backing) -> Result<Self> {
        let file_size = map.len() as u64;
        let head = &map[..map.len().min(8)];
        if head.len() < 4 || &head[..4] != b"GGUF" {
            return Err(Error::WrongMagic {
                path: path.into(),
                magic: head.to_vec(),
            });
        }
        if head.len() < 8 {
            return Err(Error::BadGguf {
                path: path.into(),
                reason: format!(
                    "the file ends after {} bytes, inside the header",
                    head.len()
                ),
            });
        }
        let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if !(2..=3).contains(&version) {
            return Err(Error::GgufVersion {
                path: path.into(),
                version,
            });
        }
        // candle divides by the alignment without looking at it, and names no unknown block
        // type's tensor: check both first
        let (own, infos_end) = check_header(&map).map_err(|reason| Error::BadGguf {
            path: path.into(),
            reason,
        })?;
        // candle refuses the ids of IQ4_NL and IQ4_XS: it reads a copy of the header (up to the
        // last tensor info: the tensor data starts after it) with a stand-in of its own there
        let patched = (!own.is_empty()).then(|| {
            let mut h = map[..infos_end].to_vec();
            for t in &own {
                h[t.at..t.at + 4].copy_from_slice(&(GgmlDType::Q4_0 as u32).to_le_bytes());
            }
            h
        });
        let header: &[u8] = patched.as_deref().unwrap_or(&map[..]);
        let content =
            match super::guard::quietly(|| Content::read(&mut std::io::Cursor::new(header))) {
                Ok(r) => r.map_err(|e| Error::BadGguf {
                    path: path.into(),
                    reason: super::error::candle_message(&e),
                })?,
                Err(msg) => {
                    return Err(Error::BadGguf {
                        path: path.into(),
                        reason: format!("the GGUF reader failed ({msg})"),
                    })
                }
            };
        if content.tensor_data_offset > file_size {
            return Err(Error::BadGguf { path: path.into(), reason: format!("tensor data would start at byte {}, past the end of the file ({file_size} bytes)", content.tensor_data_offset) });
        }
        Ok(GgufFile {
            path: path.into(),
            content,
            map: Arc::new(map),
            file_size,
            version,
            layout: None,
            own_types: own.into_iter().map(|t| (t.name, t.ty)).collect(),
        })
    }

    /// Drops the file pages read while loading from this process's memory (they stay in the
    /// page cache, and are read again if a quantized embedding row is looked up): after
    /// dequantization they would otherwise count ~the file size towards the resident memory.
    pub fn release_pages(&self) {
        self.map.release(0, self.map.len());
    }

    fn md(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    pub fn arch_string(&self) -> Result<String> {
        match self.md("general.architecture") {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(Error::MissingKey {
                key: "general.architecture".into(),
                path: self.path.clone(),
                arch: "qwen2 or llama".into(),
            }),
        }
    }

    pub fn name(&self) -> Option<String> {
        match self.md("general.name") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn uint(&self, key: &str, arch: &str) -> Result<usize> {
        let v = self.md(key).ok_or_else(|| Error::MissingKey {
            key: key.into(),
            path: self.path.clone(),
            arch: arch.into(),
        })?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => {
                return Err(Error::BadValue {
                    key: key.into(),
                    path: self.path.clone(),
                    reason: format!("expected a non-negative integer, found {v:?}"),
                })
            }
        };
        usize::try_from(n).map_err(|_| Error::BadValue {
            key: key.into(),
            path: self.path.clone(),
            reason: format!("{n} does not fit"),
        })
    }

    fn float(&self, key: &str) -> Option<f32> {
        self.md(key).and_then(|v| {
            v.to_f32()
                .ok()
                .or_else(|| v.to_f64().ok().map(|x| x as f32))
        })
    }

    /// The model's dimensions, from `{arch}.*` keys.
    pub fn dims(&self) -> Result<(ModelDims, Vec<String>)> {
        let a = self.arch_string()?;
        let arch =
            Arch::parse(&a).ok_or_else(|| Error::unknown_arch(a.clone(), self.path.clone()))?;
        let mut warnings = Vec::new();
        let n_heads = self.uint(&format!("{a}.attention.head_count"), &a)?;
        let d_model = self.uint(&format!("{a}.embedding_length"), &a)?;
        let head_dim = self.head_dim(&a, n_heads, d_model)?;
        let vocab_size = self.vocab_size(&a)?;
        let rope_base = self.rope_base(&a, arch, &mut warnings);
        let rms_eps = self.norm_eps(&a, arch)?;
        self.refuse_unimplemented(&a, arch)?;
        let n_layers = self.uint(&format!("{a}.block_count"), &a)?;
        let rotary_dim = self.rotary_dim(&a, arch, head_dim)?;
        let window = self.sliding_window(&a, arch)?;
        let gemma = if arch.is_gemma() {
            let shape = (n_layers, d_model, n_heads, head_dim);
            Some(self.gemma_settings(&a, arch, window, shape, rope_base)?)
        } else {
            None
        };
        let n_kv_heads = self
            .uint(&format!("{a}.attention.head_count_kv"), &a)
            .unwrap_or(n_heads);
        let d_ff = self.uint(&format!("{a}.feed_forward_length"), &a)?;
        let context_len = self.uint(&format!("{a}.context_length"), &a)?;
        let rope_style = self.rope_style(arch)?;
        let dims = ModelDims {
            arch,
            n_layers,
            d_model,
            n_heads,
            n_kv_heads,
            head_dim,
            d_ff,
            vocab_size,
            context_len,
            rope_base,
            rope_scaling: RopeScaling::Default,
            sliding_window: window,
            rotary_dim,
            gemma,
            rope_style,
            rms_eps,
            tied_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
            type_vocab: 0,
            position_pad: None,
        };
        dims.validate().map_err(|reason| Error::BadValue {
            key: format!("{a}.*"),
            path: self.path.clone(),
            reason,
        })?;
        self.check_layer_count(&a, &dims)?;
        Ok((dims, warnings))
    }

    /// `{arch}.attention.key_length`, or `d_model / n_heads` when the file leaves it out.
    fn head_dim(&self, a: &str, n_heads: usize, d_model: usize) -> Result<usize> {
        match self.uint(&format!("{a}.attention.key_length"), a) {
            Ok(k) => Ok(k),
            Err(_) if n_heads > 0 => Ok(d_model / n_heads),
            Err(e) => Err(e),
        }
    }

    /// The tokenizer's token count, or `{arch}.vocab_size` when the file has no token list.
    fn vocab_size(&self, a: &str) -> Result<usize> {
        match self.md("tokenizer.ggml.tokens") {
            Some(Value::Array(t)) => Ok(t.len()),
            _ => self.uint(&format!("{a}.vocab_size"), a),
        }
    }

    /// `{arch}.rope.freq_base`, or llama.cpp's default 10000 (with a warning, except for GPT-2,
    /// which has no RoPE).
    fn rope_base(&self, a: &str, arch: Arch, warnings: &mut Vec<String>) -> f32 {
        match self.float(&format!("{a}.rope.freq_base")) {
            Some(b) => b,
            // GPT-2 has learned positions, no RoPE
            None if arch.learned_positions() => 10000.0,
            None => {
                // llama.cpp's default; said out loud because it changes every pattern
                warnings.push(format!(
                    "{a}.rope.freq_base is missing; using llama.cpp's default 10000"
                ));
                10000.0
            }
        }
    }

    /// The normalization's epsilon: LayerNorm's for GPT-2, RMSNorm's for the others.
    fn norm_eps(&self, a: &str, arch: Arch) -> Result<f32> {
        // GPT-2 normalizes with LayerNorm, the others with RMSNorm
        let eps_key = match &arch.family().gguf {
            Some(g) => format!("{a}.{}", g.eps_key),
            None => format!("{a}.attention.layer_norm_rms_epsilon"),
        };
        self.float(&eps_key).ok_or_else(|| Error::MissingKey {
            key: eps_key.clone(),
            path: self.path.clone(),
            arch: a.to_string(),
        })
    }

    /// How the family's GGUF converter lays out q/k for RoPE; the families read only from
    /// Hugging Face folders are refused here.
    fn rope_style(&self, arch: Arch) -> Result<RopeStyle> {
        // the family's file says how its converter lays out q/k (llama.cpp's rope types), or
        // that it is read from Hugging Face folders only (Mistral, the encoders)
        match &arch.family().gguf {
            Some(g) => Ok(g.rope),
            None => Err(Error::unknown_arch(
                format!("{} (in GGUF; use the Hugging Face folder)", arch.name()),
                self.path.clone(),
            )),
        }
    }

    /// Refuses the metadata that changes the numbers and that this forward does not implement:
    /// scaled RoPE, and the window, soft-cap and scale keys of a family that does not read them.
    fn refuse_unimplemented(&self, a: &str, arch: Arch) -> Result<()> {
        // metadata that changes the numbers and that this forward does not implement
        let unsupported = |key: &str, value: String, reason: &str| Error::Unsupported {
            key: key.into(),
            value,
            path: self.path.clone(),
            reason: reason.into(),
        };
        let shown = |v: &Value| match v {
            Value::String(s) => format!("{s:?}"),
            other => format!("{other:?}"),
        };
        let key = format!("{a}.rope.scaling.type");
        if let Some(v) = self.md(&key) {
            if !matches!(v, Value::String(s) if s == "none") {
                return Err(unsupported(&key, shown(v), "; attnscope implements unscaled RoPE and Llama 3's per-frequency factors (rope_freqs.weight)"));
            }
        }
        let key = format!("{a}.rope.scaling.factor");
        if let Some(f) = self.float(&key) {
            if f != 1.0 && f != 0.0 {
                return Err(unsupported(&key, f.to_string(), ""));
            }
        }
        // what this family's forward implements is read below; the rest is refused by name
        let implemented: &[&str] = arch.family().gguf.as_ref().map_or(&[], |g| g.reads);
        for k in [
            "attention.sliding_window",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "attention.query_pre_attn_scalar",
            "attention.scale",
            "attention.sliding_window_pattern",
        ] {
            let key = format!("{a}.{k}");
            if let Some(v) = self.md(&key).filter(|_| !implemented.contains(&k)) {
                return Err(unsupported(&key, shown(v), ""));
            }
        }
        Ok(())
    }

    /// The dimensions RoPE rotates: every one of a head's, or Phi-3's partial rotary factor; a
    /// `rope.dimension_count` otherwise different from `head_dim` is refused (GPT-2 has no RoPE).
    fn rotary_dim(&self, a: &str, arch: Arch, head_dim: usize) -> Result<usize> {
        let unsupported = |key: &str, value: String, reason: &str| Error::Unsupported {
            key: key.into(),
            value,
            path: self.path.clone(),
            reason: reason.into(),
        };
        let key = format!("{a}.rope.dimension_count");
        let mut rotary_dim = head_dim;
        let gguf = arch.family().gguf.as_ref();
        // GPT-2 has no RoPE
        let no_rope = gguf.is_some() && arch.learned_positions();
        if let Ok(rot) = self.uint(&key, a) {
            if gguf.is_some_and(|g| g.partial_rotary) && rot > 0 && rot <= head_dim && rot % 2 == 0
            {
                // Phi-3's partial rotary factor
                rotary_dim = rot;
            } else if rot != head_dim && !no_rope {
                return Err(unsupported(
                    &key,
                    rot.to_string(),
                    &format!("; attnscope rotates every dimension of a head (head_dim {head_dim})"),
                ));
            }
        }
        Ok(rotary_dim)
    }

    /// `attention.sliding_window`, where the file has it. A window of 0 keys is refused, but
    /// for Phi-3: llama.cpp's converter writes 0 for a config without a window (Phi-4's
    /// `sliding_window: null`; `Phi3MiniModel.set_gguf_parameters`) and llama.cpp reads it as none.
    fn sliding_window(&self, a: &str, arch: Arch) -> Result<Option<usize>> {
        let window_key = format!("{a}.attention.sliding_window");
        Ok(match self.md(&window_key) {
            Some(_) => match self.uint(&window_key, a)? {
                0 if arch
                    .family()
                    .gguf
                    .as_ref()
                    .is_some_and(|g| g.window_zero_is_none) =>
                {
                    None
                }
                0 => {
                    return Err(Error::BadValue {
                        key: window_key,
                        path: self.path.clone(),
                        reason: "a window of 0 keys".into(),
                    })
                }
                w => Some(w),
            },
            None => None,
        })
    }

    /// Gemma's settings: which layers slide (the file's `sliding_window_pattern`, else Gemma 2
    /// alternates and Gemma 3 has every 6th layer full), the query scale, the soft-caps, the
    /// embeddings' √d_model and the sliding layers' RoPE base. `shape`: `(n_layers, d_model,
    /// n_heads, head_dim)`.
    fn gemma_settings(
        &self,
        a: &str,
        arch: Arch,
        window: Option<usize>,
        (n_layers, d_model, n_heads, head_dim): (usize, usize, usize, usize),
        rope_base: f32,
    ) -> Result<GemmaSettings> {
        let gemma = arch.family().gemma.as_ref().expect("a Gemma family");
        if window.is_none() {
            return Err(Error::MissingKey {
                key: format!("{a}.attention.sliding_window"),
                path: self.path.clone(),
                arch: a.to_string(),
            });
        }
        // no pattern key in llama.cpp's files: Gemma 2 alternates (even layers slide), Gemma 3
        // has every 6th layer full, as transformers and llama.cpp take them
        // (llama.cpp's `sliding_window_pattern` key, where a file has it, is either N or one
        // flag per layer, true where the layer slides)
        let pattern_key = format!("{a}.attention.sliding_window_pattern");
        let sliding_layers: Vec<bool> = match self.md(&pattern_key) {
            Some(Value::Array(flags)) => {
                let flags: Option<Vec<bool>> = flags.iter().map(|f| f.to_bool().ok()).collect();
                match flags {
                    Some(f) if f.len() == n_layers => f,
                    _ => {
                        return Err(Error::BadValue {
                            key: pattern_key,
                            path: self.path.clone(),
                            reason: format!("expected {n_layers} true/false flags, one per layer"),
                        })
                    }
                }
            }
            other => {
                let pattern = match other {
                    Some(_) => self.uint(&pattern_key, a)?.max(1),
                    None => gemma.pattern,
                };
                (0..n_layers).map(|i| (i + 1) % pattern != 0).collect()
            }
        };
        // `attention.scale` (llama.cpp's key) is the multiplier itself; where the file says
        // nothing, llama.cpp's rule: 1/√head_dim, except the 27B models (Gemma 2: 46 layers,
        // Gemma 3: 62), which scale by 1/√(d_model / heads) (their query_pre_attn_scalar)
        let big = n_layers == gemma.big_layers;
        let scalar = if big {
            (d_model / n_heads.max(1)) as f64
        } else {
            head_dim as f64
        };
        let query_scale = self
            .float(&format!("{a}.attention.scale"))
            .unwrap_or(scalar.powf(-0.5) as f32);
        Ok(GemmaSettings {
            embed_scale: (d_model as f64).sqrt() as f32,
            query_scale,
            attn_softcap: self.float(&format!("{a}.attn_logit_softcapping")),
            final_softcap: self.float(&format!("{a}.final_logit_softcapping")),
            sliding_layers,
            // Gemma 3's local base is fixed at 10000 (llama.cpp, and transformers' default)
            rope_base_sliding: gemma.local_base.unwrap_or(rope_base),
            norms_include_one: true,
        })
    }

    /// Every count checked against what the file holds before anything is sized by it: the
    /// layers need their tensors.
    fn check_layer_count(&self, a: &str, dims: &ModelDims) -> Result<()> {
        let arch = dims.arch;
        // every count is checked against what the file holds before anything is sized by it
        let tensors = self.content.tensor_infos.len();
        // Phi-3 fuses q|k|v and gate|up: 6 tensors a layer
        let per_layer = arch
            .family()
            .gguf
            .as_ref()
            .map_or(TENSORS_PER_LAYER, |g| g.tensors_per_layer);
        if dims.n_layers.saturating_mul(per_layer) > tensors {
            return Err(Error::BadValue {
                key: format!("{a}.block_count"),
                path: self.path.clone(),
                reason: format!("{} layers need at least {} tensors, but the file holds {tensors}; the file is corrupt or truncated", dims.n_layers, dims.n_layers.saturating_mul(per_layer)),
            });
        }
        Ok(())
    }

    /// Tensor types and how many tensors have each, e.g. `{"Q4K": 120, "F32": 121}`.
    pub fn tensor_types(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for name in self.content.tensor_infos.keys() {
            if let Some(t) = self.block_type(name) {
                *m.entry(format!("{t:?}")).or_insert(0) += 1;
            }
        }
        m
    }

    /// The block type of tensor `name` (`None` if the file has no such tensor).
    pub fn block_type(&self, name: &str) -> Option<BlockType> {
        let info = self.content.tensor_infos.get(name)?;
        Some(
            self.own_types
                .get(name)
                .copied()
                .unwrap_or(info.ggml_dtype.into()),
        )
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }
}

/// GGUF's name for a logical weight of an `arch` model (its family's table: Phi-3 and GPT-2
/// keep q|k|v in one `attn_qkv` tensor, and Phi-3 gate|up in one `ffn_up`).
pub fn gguf_name_for(arch: Arch, l: &Logical) -> String {
    match &arch.family().gguf {
        Some(g) => (g.name)(l),
        None => gguf_name(l),
    }
}

impl GgufFile {
    /// The layout, read once.
    fn layout(&mut self) -> Result<Layout> {
        if let Some(l) = self.layout {
            return Ok(l);
        }
        let arch = Arch::parse(&self.arch_name());
        let fused = match arch {
            Some(arch) if arch.family().gguf.as_ref().is_some_and(|g| g.fused_qkv) => {
                let a = arch.name();
                let n_heads = self.uint(&format!("{a}.attention.head_count"), a)?;
                let d_model = self.uint(&format!("{a}.embedding_length"), a)?;
                let n_kv = self
                    .uint(&format!("{a}.attention.head_count_kv"), a)
                    .unwrap_or(n_heads);
                let hd = self
                    .uint(&format!("{a}.attention.key_length"), a)
                    .unwrap_or(d_model / n_heads.max(1));
                let ff = self.uint(&format!("{a}.feed_forward_length"), a)?;
                Some((n_heads * hd, n_kv * hd, ff))
            }
            _ => None,
        };
        let l = Layout { arch, fused };
        self.layout = Some(l);
        Ok(l)
    }
}

impl Layout {
    /// gate|up in one `ffn_up` (Phi-3).
    fn gate_up_fused(&self) -> bool {
        self.arch
            .and_then(|a| a.family().gguf.as_ref())
            .is_some_and(|g| g.fused_gate_up)
    }
    /// Where a fused tensor holds `l`: `(first row, rows, rows of the whole tensor)`.
    fn fused_rows(&self, l: &Logical) -> Option<(usize, usize, usize)> {
        let (nq, nk, ff) = self.fused?;
        match l {
            Logical::Q(_) | Logical::QBias(_) => Some((0, nq, nq + 2 * nk)),
            Logical::K(_) | Logical::KBias(_) => Some((nq, nk, nq + 2 * nk)),
            Logical::V(_) | Logical::VBias(_) => Some((nq + nk, nk, nq + 2 * nk)),
            Logical::Gate(_) if self.gate_up_fused() => Some((0, ff, 2 * ff)),
            Logical::Up(_) if self.gate_up_fused() => Some((ff, ff, 2 * ff)),
            _ => None,
        }
    }
}

impl GgufFile {
    /// Tensor `name`'s bytes in the file, checked: `(offset, len, block type, dims)`; refused
    /// when its size overflows, its rows are not whole blocks, or the file ends before it.
    fn tensor_bytes(&self, name: &str) -> Result<(usize, usize, BlockType, Vec<usize>)> {
        let info = &self.content.tensor_infos[name];
        let bad = |reason: String| Error::BadGguf {
            path: self.path.clone(),
            reason: format!("tensor `{name}`: {reason}"),
        };
        let dims = info.shape.dims().to_vec();
        let n: usize = dims
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
        let ty = self
            .own_types
            .get(name)
            .copied()
            .unwrap_or(info.ggml_dtype.into());
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let cols = dims.last().copied().unwrap_or(1);
        if cols % bs != 0 {
            return Err(bad(format!(
                "rows of {cols} values are not whole {ty:?} blocks of {bs}"
            )));
        }
        let len = (n / bs).checked_mul(ts).ok_or_else(|| {
            bad(format!(
                "{n} values of {ty:?} take more bytes than a file can hold"
            ))
        })?;
        let start = self
            .content
            .tensor_data_offset
            .checked_add(info.offset)
            .ok_or_else(|| bad("offset overflows".into()))?;
        let end = start
            .checked_add(len as u64)
            .ok_or_else(|| bad("size overflows".into()))?;
        if end > self.file_size {
            return Err(bad(format!(
                "needs bytes {start}..{end} but the file has {} bytes; it is truncated",
                self.file_size
            )));
        }
        Ok((start as usize, len, ty, dims))
    }

    /// Rows `first..first + rows` of a fused tensor of `all` rows (llama.cpp's q|k|v or
    /// gate|up in one matrix) at `offset`: its byte range and dims. Rows are whole blocks, so
    /// a row range is a byte range; a tensor of another row count is refused.
    fn fused_part(
        &self,
        name: String,
        (offset, ty, dims): (usize, BlockType, Vec<usize>),
        (first, rows, all): (usize, usize, usize),
    ) -> Result<(usize, usize, Vec<usize>)> {
        let (bs, ts) = (ty.block_size(), ty.type_size());
        let (got_rows, row_len) = match dims.as_slice() {
            [r, c] => (*r, (c / bs) * ts),
            [r] if bs == 1 => (*r, ts),
            _ => (0, 0),
        };
        if got_rows != all {
            return Err(Error::ShapeMismatch {
                name,
                path: self.path.clone(),
                // the fused rows the config implies, each as long as the file's
                want: std::iter::once(all)
                    .chain(dims.iter().skip(1).copied())
                    .collect(),
                got: dims,
            });
        }
        let mut dims = dims;
        dims[0] = rows;
        Ok((offset + first * row_len, rows * row_len, dims))
    }
}

impl TensorSource for GgufFile {
    fn get(&mut self, l: &Logical) -> Result<Option<Raw>> {
        let layout = self.layout()?;
        let name = match layout.arch {
            Some(a) => gguf_name_for(a, l),
            None => gguf_name(l),
        };
        if !self.content.tensor_infos.contains_key(&name) {
            return Ok(None);
        }
        let (offset, len, ty, dims) = self.tensor_bytes(&name)?;
        let (offset, len, dims) = match layout.fused_rows(l) {
            Some(part) => self.fused_part(name, (offset, ty, dims), part)?,
            None => (offset, len, dims),
        };
        Ok(Some(Raw::Mapped(Mapped {
            map: self.map.clone(),
            offset,
            len,
            dtype: ty,
            dims,
        })))
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn count(&self) -> usize {
        self.content.tensor_infos.len()
    }
    fn names(&self) -> Vec<String> {
        self.content.tensor_infos.keys().cloned().collect()
    }
    fn arch_name(&self) -> String {
        self.arch_string().unwrap_or_else(|_| "?".into())
    }
}
