//! A Hugging Face folder's safetensors read from their own mapped bytes: the header of each file
//! gives every tensor's type, shape and place before any tensor is read. F16 and BF16 tensors
//! are handed to the loader as the file's bytes ([`Mapped`], as GGUF's F16/BF16 tensors are),
//! decoded a panel at a time where they are multiplied, so the weights resident are the file's
//! size, not an f32 copy of it; the same headers give the memory model a folder is checked
//! against before it loads ([`HfFolder::footprint`]).

use super::super::config::{Arch, ModelDims};
use super::super::error::{Error, Result};
use super::super::gguf::Backing;
use super::super::memory::{self, Footprint};
use super::super::weights::{BlockType, Logical, Mapped};
use super::{fused_part, hf_name_for, HfFolder};
use candle_core::quantized::GgmlDType;
use safetensors::Dtype;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// One tensor as its file's header places it.
#[derive(Clone, Debug)]
pub(super) struct Entry {
    /// Index of its file in [`Table::maps`].
    file: usize,
    /// Its first byte in the file.
    start: usize,
    /// Its length in bytes.
    len: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// Every tensor of a folder's safetensors files, by name, with the files mapped read-only (once:
/// F16/BF16 tensors are handed out as these bytes, the others read from them by candle).
pub(super) struct Table {
    maps: Vec<Arc<Backing>>,
    /// By name; a name in several files is the last file's.
    entries: HashMap<String, Entry>,
    /// Every file's tensors, file after file (a name in several files once per file).
    listed: Vec<(String, Dtype)>,
}

/// The block type a safetensors float type is read as from the file's bytes (`None`: read as
/// a tensor and converted at load, as F32 is).
pub(super) fn half_type(d: Dtype) -> Option<BlockType> {
    match d {
        Dtype::F16 => Some(BlockType::Ggml(GgmlDType::F16)),
        Dtype::BF16 => Some(BlockType::Ggml(GgmlDType::BF16)),
        _ => None,
    }
}

/// The first tensor (in the order of its bytes) of a safetensors file's header whose shape and
/// type do not fill its data offsets exactly, described with its name; `None` when every one
/// fits (or the header cannot be read as JSON: the crate's own message says so then).
fn misfit_tensor(file: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Info {
        dtype: Dtype,
        shape: Vec<usize>,
        data_offsets: (usize, usize),
    }
    let n = usize::try_from(u64::from_le_bytes(file.get(..8)?.try_into().ok()?)).ok()?;
    let header: HashMap<String, serde_json::Value> =
        serde_json::from_slice(file.get(8..8usize.checked_add(n)?)?).ok()?;
    let mut infos: Vec<(String, Info)> = header
        .into_iter()
        .filter(|(name, _)| name != "__metadata__")
        .filter_map(|(name, v)| Some((name, serde_json::from_value(v).ok()?)))
        .collect();
    infos.sort_by_key(|(_, i)| i.data_offsets);
    infos.into_iter().find_map(|(name, i)| {
        let (s, e) = i.data_offsets;
        let bits = i
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .and_then(|count| count.checked_mul(i.dtype.bitsize()));
        let size = match bits {
            Some(b) if b % 8 == 0 => format!("{} bytes", b / 8),
            Some(b) => format!("{b} bits, not a whole number of bytes"),
            None => "more bytes than a usize counts".into(),
        };
        let fits = bits.is_some_and(|b| b % 8 == 0 && e.checked_sub(s) == Some(b / 8));
        (!fits).then(|| {
            format!(
                "tensor `{name}` has shape {:?} of {:?} ({size}), but its data_offsets [{s}, {e}] hold {} bytes",
                i.shape,
                i.dtype,
                e.saturating_sub(s)
            )
        })
    })
}

impl Table {
    /// Maps `files` and reads their headers (checked by the safetensors crate: offsets within
    /// the file, in order, matching each tensor's type and shape). A file that cannot be opened,
    /// mapped or read is refused in the words of candle's multi-file reader (naming the first
    /// file, and the file in the reason).
    pub(super) fn open(files: &[PathBuf]) -> Result<Table> {
        let mut maps = Vec::with_capacity(files.len());
        let mut entries = HashMap::new();
        let mut listed = Vec::new();
        for (i, path) in files.iter().enumerate() {
            // the file in the reason when it is not the one named first
            let bad_because = |reason: String| Error::BadSafetensors {
                path: files[0].clone(),
                reason: if i == 0 {
                    reason
                } else {
                    format!("{}: {reason}", path.display())
                },
            };
            let bad = |e: candle_core::Error| bad_because(super::super::error::candle_message(&e));
            let file = std::fs::File::open(path).map_err(|e| bad(e.into()))?;
            // SAFETY: mapped read-only; attnscope never writes to a model's files while they are
            // open (a concurrent external writer could change what is read, as with any mmap)
            let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| bad(e.into()))?;
            let (n, meta) = safetensors::SafeTensors::read_metadata(&map).map_err(|e| {
                // the crate's "invalid shape, data type, or offset for tensor" names none
                match misfit_tensor(&map) {
                    Some(which) => bad_because(format!("{e}: {which}")),
                    None => bad(e.into()),
                }
            })?;
            for (name, info) in meta.tensors() {
                listed.push((name.clone(), info.dtype));
                let (a, b) = info.data_offsets;
                entries.insert(
                    name,
                    Entry {
                        file: i,
                        start: 8 + n + a,
                        len: b - a,
                        dtype: info.dtype,
                        shape: info.shape.clone(),
                    },
                );
            }
            maps.push(Arc::new(Backing::Map(map)));
        }
        Ok(Table {
            maps,
            entries,
            listed,
        })
    }

    /// The tensor `name`'s header entry.
    pub(super) fn entry(&self, name: &str) -> Option<&Entry> {
        self.entries.get(name)
    }

    /// Every file's tensors with their types, file after file (a name in several files once
    /// per file).
    pub(super) fn listed(&self) -> &[(String, Dtype)] {
        &self.listed
    }

    /// Tensor `name` read by candle from its file's bytes, as its safetensors reader reads it
    /// (any type, converted as candle converts it).
    pub(super) fn load(&self, name: &str) -> candle_core::Result<candle_core::Tensor> {
        use candle_core::safetensors::Load;
        let e = self
            .entries
            .get(name)
            .ok_or_else(|| candle_core::Error::CannotFindTensor {
                path: name.to_string(),
            })?;
        let bytes = &self.maps[e.file][e.start..e.start + e.len];
        safetensors::tensor::TensorView::new(e.dtype, e.shape.clone(), bytes)?
            .load(&candle_core::Device::Cpu)
    }

    /// Tensor `name` (rows `r0..r0 + rows` of it, or all of it) as its file's F16/BF16 bytes;
    /// `None` for another type, a scalar, or rows it does not have.
    pub(super) fn half(&self, name: &str, rows: Option<(usize, usize)>) -> Option<Mapped> {
        let e = self.entries.get(name)?;
        let dtype = half_type(e.dtype)?;
        let cols = *e.shape.last()?;
        let (offset, len, dims) = match rows {
            None => (e.start, e.len, e.shape.clone()),
            Some((r0, n)) => {
                if e.shape.len() != 2 || r0 + n > e.shape[0] {
                    return None;
                }
                (e.start + r0 * cols * 2, n * cols * 2, vec![n, cols])
            }
        };
        Some(Mapped {
            map: self.maps[e.file].clone(),
            offset,
            len,
            dtype,
            dims,
        })
    }
}

impl HfFolder {
    /// The header entry of the tensor that holds logical weight `l`, and whether the loader
    /// reads it from the file's bytes (F16/BF16 outside GPT-2, whose Conv1D weights are
    /// transposed at load).
    fn entry_of(&self, arch: Option<Arch>, l: &Logical) -> Option<(&Entry, bool)> {
        if let Some(part) = arch.and_then(|a| a.family().hf.conv1d) {
            let (name, _, _) = part(&self.config, l);
            return self.table.entry(&name).map(|e| (e, false));
        }
        let name = format!("{}{}", self.prefix.unwrap_or(""), hf_name_for(arch, l));
        let e = self.table.entry(&name).or_else(|| {
            fused_part(&self.config, l).and_then(|(fused, _, _)| self.table.entry(&fused))
        })?;
        Some((e, half_type(e.dtype).is_some()))
    }

    /// The memory model of this folder's decoder of shape `dims`, from its files' headers
    /// alone (no tensor read): F16/BF16 projections as their bytes (what `--memory low` keeps),
    /// F32 ones packed; an F32 embedding held whole, and the pages of F32 tensors that loading
    /// reads (resident until the folder is closed).
    pub fn footprint(&self, dims: &ModelDims) -> Footprint {
        let arch = Some(dims.arch);
        let elem = |d: Dtype| d.bitsize() as u64 / 8;
        let mut float_file_bytes = 0u64;
        let mut part = |l: Logical| -> (usize, u64, Option<BlockType>) {
            let shape = l.shape(dims);
            let elems: usize = shape.iter().product();
            match self.entry_of(arch, &l) {
                Some((e, mapped)) => {
                    let bytes = elems as u64 * elem(e.dtype);
                    if !mapped {
                        float_file_bytes += bytes;
                    }
                    (
                        shape[0],
                        bytes,
                        mapped.then(|| half_type(e.dtype)).flatten(),
                    )
                }
                None => (0, 0, None),
            }
        };
        let gpt2 = dims.arch.learned_positions();
        let mut projections = Vec::with_capacity(dims.n_layers);
        for l in 0..dims.n_layers {
            projections.push([
                vec![
                    part(Logical::Q(l)),
                    part(Logical::K(l)),
                    part(Logical::V(l)),
                ],
                vec![part(Logical::O(l))],
                if gpt2 {
                    vec![part(Logical::Up(l))]
                } else {
                    vec![part(Logical::Gate(l)), part(Logical::Up(l))]
                },
                vec![part(Logical::Down(l))],
            ]);
        }
        let table_bytes = |l: &Logical| {
            self.entry_of(arch, l).map(|(e, mapped)| {
                let elems: u64 = l.shape(dims).iter().product::<usize>() as u64;
                (elems * elem(e.dtype), elems * 4, mapped)
            })
        };
        let tied = dims.tied_embeddings || dims.arch.is_encoder();
        let embed = table_bytes(&Logical::Embed);
        let head = if tied {
            embed
        } else {
            table_bytes(&Logical::LmHead)
        };
        // a float embedding is held whole as f32 (and is the head when tied); mapped rows are
        // dropped after the lookup
        let mut dense = 0u64;
        if let Some((file, f32_bytes, false)) = embed {
            dense += f32_bytes;
            float_file_bytes += file;
        }
        let head_bytes = match head {
            Some((_, _, false)) if tied => 0,
            Some((file, f32_bytes, false)) => {
                float_file_bytes += file;
                f32_bytes
            }
            // an encoder never reads its head (the tied embedding stands in, unused)
            Some((file, _, true)) if !dims.arch.is_encoder() => file,
            _ => 0,
        };
        let mut fp = memory::footprint(dims, |l| projections[l].clone(), head_bytes);
        fp.small_bytes += dense + float_file_bytes;
        fp
    }
}
