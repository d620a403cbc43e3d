//! What a model needs in memory at each `--memory` setting and text length (the memory model
//! `info` prints), and the default setting chosen from it and the machine's free memory.
//!
//! Peak resident memory of an `inspect` = a fixed part (the executable, the tokenizer's maps,
//! the allocator's slack) + the weights as the setting holds them + the forward's buffers at
//! `n` tokens. The weights: `low` reads the projections' blocks from the mapped file (their
//! pages become resident as the products read them: the file's bytes, no more); `fast` holds
//! them packed (f32 panels of the kernel's width, or the AMX tiles' integers and scales). Both
//! read the output head from the file's blocks (its pages resident once the logits are
//! computed); the embeddings' rows are dropped after the lookup. The constants were fitted to
//! peaks measured with `/usr/bin/time -v` (docs/precision.md#memory).

use super::config::ModelDims;
use super::weights::{Memory, PanelLayout, Precision};
use crate::kernels::amx::{scaled::PackedScaled, PackedBf16};
use crate::kernels::gemm::PackedB;
use crate::kernels::int8::PackedQ8;
use serde::Serialize;

/// The fixed part of a run's peak: the executable, the tokenizer and vocabulary maps, the
/// allocator's own: `FIXED_BYTES + FIXED_PER_TOKEN_TYPE × vocabulary` (fitted to an `inspect`
/// of a few tokens minus its weights: 28 MB for SmolLM2's 49,152 tokens, 42-53 MB for Qwen2.5's
/// 151,936, 93 MB for Gemma 3's 262,144).
pub const FIXED_BYTES: u64 = 15_000_000;
/// Bytes of the fixed part per vocabulary entry (see [`FIXED_BYTES`]).
pub const FIXED_PER_TOKEN_TYPE: u64 = 300;

/// One fused projection as the forward multiplies it: `W: [n, k]`, its bytes in the file, and
/// whether every part's blocks are integers and scales the AMX path reads (`offsets` when some
/// part has them).
#[derive(Clone, Debug, Serialize)]
pub struct Projection {
    pub n: usize,
    pub k: usize,
    pub file_bytes: u64,
    /// `Some(offsets)` when the AMX path reads every part as integers and scales.
    pub scaled: Option<bool>,
    /// Whether `--memory low` reads every part from its blocks (else it packs f32 panels).
    pub low: bool,
}

/// What a model's weights take, from its file's tensor table and its shape.
#[derive(Clone, Debug, Serialize)]
pub struct Footprint {
    pub dims_d_model: usize,
    pub dims_d_ff: usize,
    pub qkv_width: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub vocab: usize,
    /// The fused projections (q|k|v, o, gate|up, down of every layer).
    pub projections: Vec<Projection>,
    /// Bytes of the output head's blocks (resident once the logits are computed).
    pub head_bytes: u64,
    /// f32 values of everything else held in memory (norms, biases).
    pub small_bytes: u64,
}

impl Footprint {
    /// Resident bytes of the weights at `memory` for `precision` on this CPU, the output head
    /// included.
    pub fn weights(&self, memory: Memory, precision: Precision) -> u64 {
        self.projections_bytes(memory, precision) + self.head_bytes + self.small_bytes
    }

    /// Resident bytes of the projections at `memory` for `precision` on this CPU.
    pub fn projections_bytes(&self, memory: Memory, precision: Precision) -> u64 {
        let layout = PanelLayout::of(precision);
        let packed = |p: &Projection| -> u64 {
            let (n, k) = (p.n, p.k);
            let f32_panels =
                PackedB::packed_len(n, k, crate::kernels::gemm::Isa::detect()) as u64 * 4;
            match layout {
                PanelLayout::F32(_) => f32_panels,
                PanelLayout::Scaled(_) => match p.scaled {
                    Some(off) => PackedScaled::packed_len(n, k, off) as u64 * 2,
                    None => f32_panels,
                },
                PanelLayout::Bf16 { splits } => PackedBf16::packed_len(n, k, splits) as u64 * 2,
                PanelLayout::Int8(_) if k.is_multiple_of(crate::kernels::int8::BLOCK) => {
                    PackedQ8::packed_len(n, k) as u64
                }
                PanelLayout::Int8(_) => f32_panels,
            }
        };
        self.projections
            .iter()
            .map(|p| match memory {
                Memory::Low if p.low => p.file_bytes,
                _ => packed(p),
            })
            .sum()
    }

    /// The forward's own buffers at `n` tokens (`inspect`: one logits row), f32: the layer's
    /// live buffers (two of the residual stream's width, q|k|v and its rotated copy, gate|up),
    /// and the attention's score blocks (1,024 keys per head, per thread).
    pub fn activations(&self, n: usize) -> u64 {
        let (d, ff, qkv) = (
            self.dims_d_model as u64,
            self.dims_d_ff as u64,
            self.qkv_width as u64,
        );
        let per_token = 4 * (2 * d + 2 * qkv + 2 * ff);
        let threads = rayon::current_num_threads() as u64;
        let scores = 4 * 1024 * 64 * self.n_heads as u64 * threads.min(8);
        n as u64 * per_token + scores
    }

    /// Peak resident bytes of an `inspect` of `n` tokens at `memory`: the fixed part, the
    /// projections and the larger of the forward's buffers and the output head (the forward's
    /// buffers are freed before the logits bring the head's pages in).
    pub fn need(&self, memory: Memory, precision: Precision, n: usize) -> u64 {
        FIXED_BYTES
            + FIXED_PER_TOKEN_TYPE * self.vocab as u64
            + self.projections_bytes(memory, precision)
            + self.decoded_bytes(memory, precision)
            + self.small_bytes
            + self.head_bytes.max(self.activations(n))
    }

    /// `low` on the AMX tiles decodes each projection's blocks into the tiles' integers and
    /// scales inside its product: each worker thread holds a run of decoded panels of about
    /// [`DECODE_BYTES`](crate::kernels::amx::scaled::DECODE_BYTES) (never more than the largest
    /// such matrix), 0 on the other kernels.
    pub fn decoded_bytes(&self, memory: Memory, precision: Precision) -> u64 {
        if memory != Memory::Low || !matches!(PanelLayout::of(precision), PanelLayout::Scaled(_)) {
            return 0;
        }
        let per_thread = crate::kernels::amx::scaled::DECODE_BYTES as u64;
        let workers = rayon::current_num_threads() as u64;
        self.largest_decoded().min(workers * per_thread)
    }

    /// The largest projection `low` decodes for the AMX tiles, whole (bytes of its tiles).
    fn largest_decoded(&self) -> u64 {
        self.projections
            .iter()
            .filter(|p| p.low && p.k.is_multiple_of(crate::kernels::amx::scaled::GROUP))
            .filter_map(|p| {
                p.scaled
                    .map(|off| PackedScaled::packed_len(p.n, p.k, off) as u64 * 2)
            })
            .max()
            .unwrap_or(0)
    }
}

/// The footprint of a decoder of shape `dims` whose projection parts are `parts(layer)`: for
/// each fused projection (q|k|v, o, gate|up, down) its parts' `(rows, bytes in the file, GGUF
/// type or None for floats)`.
pub fn footprint(
    dims: &ModelDims,
    parts: impl Fn(usize) -> [Vec<(usize, u64, Option<super::weights::BlockType>)>; 4],
    head_bytes: u64,
) -> Footprint {
    let (d, hd) = (dims.d_model, dims.head_dim);
    let qkv_width = (dims.n_heads + 2 * dims.n_kv_heads) * hd;
    let mut projections = Vec::with_capacity(4 * dims.n_layers);
    for l in 0..dims.n_layers {
        let ks = [d, dims.n_heads * hd, d, dims.d_ff];
        for (fused, k) in parts(l).into_iter().zip(ks) {
            let n = fused.iter().map(|p| p.0).sum();
            let file_bytes = fused.iter().map(|p| p.1).sum();
            let kinds: Vec<Option<bool>> = fused
                .iter()
                .map(|p| p.2.and_then(super::weights::scaled_kind_of))
                .collect();
            let scaled = kinds
                .iter()
                .all(|x| x.is_some())
                .then(|| kinds.contains(&Some(true)));
            let low = fused
                .iter()
                .all(|p| p.2.is_some_and(super::weights::low_supported));
            projections.push(Projection {
                n,
                k,
                file_bytes,
                scaled,
                low,
            });
        }
    }
    let small_bytes = 4 * (dims.n_layers * (2 * d + qkv_width + 4 * hd) + d) as u64;
    Footprint {
        dims_d_model: d,
        dims_d_ff: dims.d_ff,
        qkv_width,
        n_layers: dims.n_layers,
        n_heads: dims.n_heads,
        vocab: dims.vocab_size,
        projections,
        head_bytes,
        small_bytes,
    }
}

/// The setting `ATTNSCOPE_MEMORY` asks for (`low` or `fast`; unset or empty: none); another
/// value is refused.
pub fn from_env() -> super::Result<Option<Memory>> {
    match std::env::var("ATTNSCOPE_MEMORY") {
        Ok(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|e: String| super::Error::NotApplicable(format!("ATTNSCOPE_MEMORY: {e}"))),
        _ => Ok(None),
    }
}

/// The machine's memory that a new process can have without swapping (`MemAvailable`), in
/// bytes; `None` where /proc/meminfo does not say. `ATTNSCOPE_MEM_AVAILABLE` (bytes, or with a
/// decimal `K`/`M`/`G` suffix: `800M`, `1.5G`) stands in for it, to see what a smaller machine
/// would be told (the tests use it); a value that is not a size is refused.
pub fn available() -> super::Result<Option<u64>> {
    if let Ok(v) = std::env::var("ATTNSCOPE_MEM_AVAILABLE") {
        if !v.trim().is_empty() {
            return parse_size(&v).map(Some).ok_or_else(|| {
                super::Error::NotApplicable(format!(
                    "ATTNSCOPE_MEM_AVAILABLE is `{v}`; give a size in bytes, or with K, M or G \
                     (e.g. 800M, 1.5G)"
                ))
            });
        }
    }
    let from_proc = || -> Option<u64> {
        let s = std::fs::read_to_string("/proc/meminfo").ok()?;
        let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Ok(from_proc())
}

/// `1234`, `800M`, `1.5G`, `64k` (decimal: K = 1e3 bytes) as bytes; `None` if it is not one.
pub fn parse_size(v: &str) -> Option<u64> {
    let v = v.trim();
    let (num, mul) = match v.char_indices().last()? {
        (i, 'k' | 'K') => (&v[..i], 1e3),
        (i, 'm' | 'M') => (&v[..i], 1e6),
        (i, 'g' | 'G') => (&v[..i], 1e9),
        _ => (v, 1.0),
    };
    let x: f64 = num.trim().parse().ok()?;
    (x.is_finite() && x >= 0.0 && x * mul < 1.8e19).then_some((x * mul) as u64)
}

/// The text length the load-time check sizes an `inspect` at: the memory model's shortest row.
pub const FIT_TOKENS: usize = 128;

/// Refuses a model whose `inspect` of [`FIT_TOKENS`] tokens at `memory` would need more than
/// the machine's available memory `avail` (`None`: unknown, not checked), saying what it needs,
/// what the machine has, and whether `--memory low` would fit. Checked before the weights load.
pub fn check_fits(
    fp: &Footprint,
    memory: Memory,
    precision: Precision,
    avail: Option<u64>,
) -> super::Result<()> {
    let Some(a) = avail else { return Ok(()) };
    let need = fp.need(memory, precision, FIT_TOKENS);
    if need <= a {
        return Ok(());
    }
    let gb = |b: u64| b as f64 / 1e9;
    let low = fp.need(Memory::Low, precision, FIT_TOKENS);
    let what_then = if memory == Memory::Fast
        && precision == Precision::Exact
        && fp.projections.iter().any(|p| p.low)
        && low <= a
    {
        format!("--memory low needs {:.2} GB and fits", gb(low))
    } else {
        "use a smaller model or a file quantized to fewer bits, or free memory".to_string()
    };
    Err(super::Error::NotApplicable(format!(
        "the model needs {:.2} GB for an inspect of {FIT_TOKENS} tokens at --memory {memory} \
         (--precision {precision}; its weights {:.2} GB), but the machine has {:.2} GB available \
         ({}); {what_then}",
        gb(need),
        gb(fp.weights(memory, precision)),
        gb(a),
        if std::env::var("ATTNSCOPE_MEM_AVAILABLE").is_ok_and(|v| !v.trim().is_empty()) {
            "ATTNSCOPE_MEM_AVAILABLE"
        } else {
            "MemAvailable"
        },
    )))
}

/// The default `--memory`: `fast` when its peak at 2,048 tokens takes at most half of the
/// machine's available memory, else `low`; with the reason, as `info` says it.
pub fn choose(fp: &Footprint, precision: Precision, avail: Option<u64>) -> (Memory, String) {
    let gb = |b: u64| b as f64 / 1e9;
    if precision == Precision::Fast {
        return (
            Memory::Fast,
            "--precision fast holds its own packed projections".into(),
        );
    }
    if !fp.projections.iter().any(|p| p.low) {
        return (
            Memory::Fast,
            "no projection is in quantized blocks low could read".into(),
        );
    }
    let fast = fp.need(Memory::Fast, precision, 2048);
    match avail {
        Some(a) if fast <= a / 2 => (
            Memory::Fast,
            format!(
                "fast needs {:.2} GB at 2,048 tokens, within half of the {:.1} GB available",
                gb(fast),
                gb(a)
            ),
        ),
        Some(a) => (
            Memory::Low,
            format!(
                "fast would need {:.2} GB at 2,048 tokens, more than half of the {:.1} GB available",
                gb(fast),
                gb(a)
            ),
        ),
        None => (
            Memory::Low,
            "the machine's free memory is unknown (no /proc/meminfo)".into(),
        ),
    }
}

/// What `info` says of a model without loading its weights: where it is, its shape and its
/// memory model, from the GGUF's metadata and tensor table or a folder's config and
/// safetensors headers.
pub struct Plan {
    /// The alias, or the path as given.
    pub name: String,
    pub path: std::path::PathBuf,
    /// `gguf` or `safetensors`.
    pub format: &'static str,
    /// Bytes of the model's files.
    pub file_size: u64,
    pub dims: ModelDims,
    pub footprint: Footprint,
}

/// The [`Plan`] of `spec` (an alias, a `.gguf` file, a folder or a hub id, fetched as loading
/// would): no tensor is read.
pub fn plan(spec: &str, progress: bool) -> super::Result<Plan> {
    let (source, name, _) = super::resolve(spec, progress)?;
    Ok(match source {
        super::Source::Gguf(path) => {
            let g = super::gguf::GgufFile::open(&path)?;
            let (dims, _) = g.dims()?;
            Plan {
                name,
                path,
                format: "gguf",
                file_size: g.file_size,
                footprint: super::gguf_footprint(&g, &dims),
                dims,
            }
        }
        super::Source::Folder(dir) => {
            let f = super::hf::HfFolder::open(&dir)?;
            let dims = f.dims()?;
            Plan {
                name,
                format: "safetensors",
                file_size: f
                    .files
                    .iter()
                    .filter_map(|p| std::fs::metadata(p).ok())
                    .map(|m| m.len())
                    .sum(),
                footprint: f.footprint(&dims),
                path: dir,
                dims,
            }
        }
    })
}

/// The setting a load of `fp` at `precision` takes when `asked` (`--memory`) is `None`:
/// `ATTNSCOPE_MEMORY` for `exact`, else [`choose`]'s.
pub fn setting(
    fp: &Footprint,
    precision: Precision,
    asked: Option<Memory>,
    avail: Option<u64>,
) -> super::Result<Memory> {
    let asked = match asked {
        None if precision == Precision::Exact => from_env()?,
        m => m,
    };
    Ok(asked.unwrap_or_else(|| choose(fp, precision, avail).0))
}
