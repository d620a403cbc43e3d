//! GGUF files (llama.cpp's format): header, metadata → [`ModelDims`], tensors by name.
//! candle's `gguf_file` reads the container (it bounds every count and length by the file size);
//! this file maps GGUF keys and tensor names into attnscope's vocabulary.

use super::config::{Arch, ModelDims, RopeStyle};
use super::error::{Error, Result};
use super::weights::{Logical, Mapped, Raw, TensorSource};
use candle_core::quantized::gguf_file::{Content, Value};
use memmap2::Mmap;
use std::sync::Arc;
use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

/// The bytes behind a GGUF file: a read-only memory map, or a buffer (tests, fuzzing).
pub enum Backing {
    Map(Mmap),
    Bytes(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Map(m) => m,
            Backing::Bytes(b) => b,
        }
    }
}

impl Backing {
    /// Drops resident pages of `start..start + len` (a no-op for buffers).
    pub fn release(&self, start: usize, len: usize) {
        if let Backing::Map(m) = self {
            // SAFETY: read-only file-backed mapping: MADV_DONTNEED only drops pages that are
            // read back from the file on the next access; no data can be lost.
            let _ = unsafe { m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, len) };
        }
    }
}

pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    map: Arc<Backing>,
    pub file_size: u64,
    pub version: u32,
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
            return Err(Error::WrongMagic { path: path.into(), magic: head.to_vec() });
        }
        if head.len() < 8 {
            return Err(Error::BadGguf { path: path.into(), reason: format!("the file ends after {} bytes, inside the header", head.len()) });
        }
        let version = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if !(2..=3).contains(&version) {
            return Err(Error::GgufVersion { path: path.into(), version });
        }
        let content = Content::read(&mut std::io::Cursor::new(&map[..])).map_err(|e| Error::BadGguf { path: path.into(), reason: e.to_string() })?;
        if content.tensor_data_offset > file_size {
            return Err(Error::BadGguf { path: path.into(), reason: format!("tensor data would start at byte {}, past the end of the file ({file_size} bytes)", content.tensor_data_offset) });
        }
        Ok(GgufFile { path: path.into(), content, map: Arc::new(map), file_size, version })
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
            _ => Err(Error::MissingKey { key: "general.architecture".into(), path: self.path.clone(), arch: "qwen2 or llama".into() }),
        }
    }

    pub fn name(&self) -> Option<String> {
        match self.md("general.name") {
            Some(Value::String(s)) => Some(s.clone()),
            _ => None,
        }
    }

    fn uint(&self, key: &str, arch: &str) -> Result<usize> {
        let v = self.md(key).ok_or_else(|| Error::MissingKey { key: key.into(), path: self.path.clone(), arch: arch.into() })?;
        let n = match v {
            Value::U8(x) => *x as u64,
            Value::U16(x) => *x as u64,
            Value::U32(x) => *x as u64,
            Value::U64(x) => *x,
            Value::I8(x) if *x >= 0 => *x as u64,
            Value::I16(x) if *x >= 0 => *x as u64,
            Value::I32(x) if *x >= 0 => *x as u64,
            Value::I64(x) if *x >= 0 => *x as u64,
            _ => return Err(Error::BadValue { key: key.into(), path: self.path.clone(), reason: format!("expected a non-negative integer, found {v:?}") }),
        };
        usize::try_from(n).map_err(|_| Error::BadValue { key: key.into(), path: self.path.clone(), reason: format!("{n} does not fit") })
    }

    fn float(&self, key: &str) -> Option<f32> {
        self.md(key).and_then(|v| v.to_f32().ok().or_else(|| v.to_f64().ok().map(|x| x as f32)))
    }

    /// The model's dimensions, from `{arch}.*` keys.
    pub fn dims(&self) -> Result<(ModelDims, Vec<String>)> {
        let a = self.arch_string()?;
        let arch = Arch::parse(&a).ok_or_else(|| Error::UnknownArch { arch: a.clone(), path: self.path.clone() })?;
        let mut warnings = Vec::new();
        let n_heads = self.uint(&format!("{a}.attention.head_count"), &a)?;
        let d_model = self.uint(&format!("{a}.embedding_length"), &a)?;
        let head_dim = match self.uint(&format!("{a}.attention.key_length"), &a) {
            Ok(k) => k,
            Err(_) if n_heads > 0 => d_model / n_heads,
            Err(e) => return Err(e),
        };
        let vocab_size = match self.md("tokenizer.ggml.tokens") {
            Some(Value::Array(t)) => t.len(),
            _ => self.uint(&format!("{a}.vocab_size"), &a)?,
        };
        let rope_base = match self.float(&format!("{a}.rope.freq_base")) {
            Some(b) => b,
            None => {
                // llama.cpp's default; said out loud because it changes every pattern
                warnings.push(format!("{a}.rope.freq_base is missing; using llama.cpp's default 10000"));
                10000.0
            }
        };
        let rms_eps = self.float(&format!("{a}.attention.layer_norm_rms_epsilon")).ok_or_else(|| Error::MissingKey {
            key: format!("{a}.attention.layer_norm_rms_epsilon"),
            path: self.path.clone(),
            arch: a.clone(),
        })?;
        let dims = ModelDims {
            arch,
            n_layers: self.uint(&format!("{a}.block_count"), &a)?,
            d_model,
            n_heads,
            n_kv_heads: self.uint(&format!("{a}.attention.head_count_kv"), &a).unwrap_or(n_heads),
            head_dim,
            d_ff: self.uint(&format!("{a}.feed_forward_length"), &a)?,
            vocab_size,
            context_len: self.uint(&format!("{a}.context_length"), &a)?,
            rope_base,
            rope_style: match arch {
                Arch::Qwen2 => RopeStyle::Neox,
                Arch::Llama => RopeStyle::Interleaved,
            },
            rms_eps,
            tied_embeddings: !self.content.tensor_infos.contains_key("output.weight"),
        };
        dims.validate().map_err(|reason| Error::BadValue { key: format!("{a}.*"), path: self.path.clone(), reason })?;
        Ok((dims, warnings))
    }

    /// Tensor types and how many tensors have each, e.g. `{"Q4K": 120, "F32": 121}`.
    pub fn tensor_types(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for t in self.content.tensor_infos.values() {
            *m.entry(format!("{:?}", t.ggml_dtype)).or_insert(0) += 1;
        }
        m
    }

    pub fn metadata(&self) -> &std::collections::HashMap<String, Value> {
        &self.content.metadata
    }
}

/// GGUF's name for a logical weight.
pub fn gguf_name(l: &Logical) -> String {
    match l {
        Logical::Embed => "token_embd.weight".into(),
        Logical::FinalNorm => "output_norm.weight".into(),
        Logical::LmHead => "output.weight".into(),
        Logical::AttnNorm(i) => format!("blk.{i}.attn_norm.weight"),
        Logical::Q(i) => format!("blk.{i}.attn_q.weight"),
        Logical::QBias(i) => format!("blk.{i}.attn_q.bias"),
        Logical::K(i) => format!("blk.{i}.attn_k.weight"),
        Logical::KBias(i) => format!("blk.{i}.attn_k.bias"),
        Logical::V(i) => format!("blk.{i}.attn_v.weight"),
        Logical::VBias(i) => format!("blk.{i}.attn_v.bias"),
        Logical::O(i) => format!("blk.{i}.attn_output.weight"),
        Logical::MlpNorm(i) => format!("blk.{i}.ffn_norm.weight"),
        Logical::Gate(i) => format!("blk.{i}.ffn_gate.weight"),
        Logical::Up(i) => format!("blk.{i}.ffn_up.weight"),
        Logical::Down(i) => format!("blk.{i}.ffn_down.weight"),
    }
}

impl TensorSource for GgufFile {
    fn get(&mut self, l: &Logical) -> Result<Option<Raw>> {
        let name = gguf_name(l);
        if !self.content.tensor_infos.contains_key(&name) {
            return Ok(None);
        }
        let info = &self.content.tensor_infos[&name];
        let bad = |reason: String| Error::BadGguf { path: self.path.clone(), reason: format!("tensor `{name}`: {reason}") };
        let dims = info.shape.dims().to_vec();
        let n: usize = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d)).ok_or_else(|| bad(format!("dimensions {dims:?} overflow")))?;
        let (bs, ts) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        let cols = dims.last().copied().unwrap_or(1);
        if cols % bs != 0 {
            return Err(bad(format!("rows of {cols} values are not whole {:?} blocks of {bs}", info.ggml_dtype)));
        }
        let len = n / bs * ts;
        let start = self.content.tensor_data_offset.checked_add(info.offset).ok_or_else(|| bad("offset overflows".into()))?;
        let end = start.checked_add(len as u64).ok_or_else(|| bad("size overflows".into()))?;
        if end > self.file_size {
            return Err(bad(format!("needs bytes {start}..{end} but the file has {} bytes; it is truncated", self.file_size)));
        }
        Ok(Some(Raw::Mapped(Mapped { map: self.map.clone(), offset: start as usize, len, dtype: info.ggml_dtype, dims })))
    }
    fn path(&self) -> &Path {
        &self.path
    }
    fn count(&self) -> usize {
        self.content.tensor_infos.len()
    }
    fn arch_name(&self) -> String {
        self.arch_string().unwrap_or_else(|_| "?".into())
    }
}
