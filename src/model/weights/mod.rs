//! Weights in memory, one layout for both file formats, and the one place that decides how each
//! weight is stored for a [`Precision`].

use super::config::{Arch, ModelDims, RopeStyle};
use super::error::{Error, Result};
pub use super::logical::Logical;
use crate::kernels::amx::{self, scaled::PackedScaled, PackedBf16};
use crate::kernels::gemm::{self, PackedB};
use crate::kernels::int8::{self, PackedQ8};
use candle_core::quantized::{GgmlDType, GgmlType, QMatMul, QStorage, QTensor};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;
use std::borrow::Cow;
use std::path::Path;
use std::sync::Arc;

mod lowmem;
pub mod matvec;
mod quant;
pub use lowmem::{low_supported, Memory, QuantB};
use quant::*;
pub use quant::{BlockType, KVALUES_IQ4};

/// How weights are held in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// Every product of a weight and an activation exact, summed in f32: the numbers of the
    /// reference implementation (~1e-5). Weights dequantized to f32, or on CPUs with Intel AMX
    /// a quantized file's integers and scales on the tiles (activations as three bf16 parts).
    Exact,
    /// The projections in lower precision, attention in f32: bf16 on Intel AMX tiles where the
    /// CPU has them (weights move by <2e-2), else 8-bit blocks on AVX-512 VNNI or AVX2 (<0.04),
    /// else (no AVX2: `ATTNSCOPE_ISA=scalar`) the exact kernels.
    Fast,
}

impl Precision {
    /// Every precision, `exact` first.
    pub const ALL: [Precision; 2] = [Precision::Exact, Precision::Fast];

    /// The precision's name (`exact`, `fast`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Exact => "exact",
            Precision::Fast => "fast",
        }
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown precision `{s}`; choose exact or fast"))
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A GGUF tensor still in the memory-mapped file: `dtype` blocks, row-major `[rows, cols]`.
#[derive(Clone)]
pub struct Mapped {
    pub map: Arc<super::backing::Backing>,
    pub offset: usize,
    pub len: usize,
    pub dtype: BlockType,
    pub dims: Vec<usize>,
}

impl Mapped {
    fn bytes(&self) -> &[u8] {
        &self.map[self.offset..self.offset + self.len]
    }
    pub(crate) fn cols(&self) -> usize {
        *self
            .dims
            .last()
            .expect("tensors have at least one dimension")
    }
    /// Bytes of one row (rows are whole blocks in every GGUF tensor attnscope loads).
    fn row_bytes(&self) -> usize {
        self.cols() / self.dtype.block_size() * self.dtype.type_size()
    }
    /// Dequantizes rows `r0..r0 + out.len() / cols` into `out`.
    pub(crate) fn rows_to_f32(&self, r0: usize, out: &mut [f32]) -> Result<()> {
        let rb = self.row_bytes();
        let n_rows = out.len() / self.cols();
        dequantize_into(self.dtype, &self.bytes()[r0 * rb..(r0 + n_rows) * rb], out)
    }
    /// The whole tensor as f32, dequantized on every core straight from the mapping.
    pub fn to_f32(&self) -> Result<Tensor> {
        Ok(Tensor::from_vec(
            self.to_vec()?,
            self.dims.clone(),
            &Device::Cpu,
        )?)
    }
    /// The whole tensor as f32 values, row-major.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        let n: usize = self.dims.iter().product();
        let cols = self.cols();
        let rows = n / cols;
        let mut out = vec![0f32; n];
        let threads = std::thread::available_parallelism()
            .map(|x| x.get())
            .unwrap_or(1)
            .min(rows.max(1));
        let per = rows.div_ceil(threads);
        std::thread::scope(|s| -> Result<()> {
            let handles: Vec<_> = out
                .chunks_mut(per * cols)
                .enumerate()
                .map(|(i, chunk)| s.spawn(move || self.rows_to_f32(i * per, chunk)))
                .collect();
            for h in handles {
                h.join().expect("dequantization thread panicked")?;
            }
            Ok(())
        })?;
        self.release_pages();
        Ok(out)
    }
    /// Drops this tensor's file pages from resident memory once they have been read (they stay
    /// in the page cache), so loading never holds the file and the f32 weights at once.
    fn release_pages(&self) {
        const PAGE: usize = 4096;
        let start = self.offset.div_ceil(PAGE) * PAGE;
        let end = (self.offset + self.len) / PAGE * PAGE;
        if end > start {
            self.map.release(start, end - start);
        }
    }
    /// A candle quantized tensor (one copy of the blocks).
    pub fn to_qtensor(&self) -> Result<QTensor> {
        let dtype = self
            .dtype
            .ggml()
            .ok_or_else(|| Error::NoCandleType(format!("{:?}", self.dtype)))?;
        let storage = QStorage::from_data(Cow::Borrowed(self.bytes()), &Device::Cpu, dtype)?;
        Ok(QTensor::new(storage, self.dims.clone())?)
    }
}

/// A tensor as it comes out of a file: quantized in a GGUF mapping, or floating point.
pub enum Raw {
    Mapped(Mapped),
    F(Tensor),
}

impl Raw {
    pub fn dims(&self) -> Vec<usize> {
        match self {
            Raw::Mapped(m) => m.dims.clone(),
            Raw::F(t) => t.dims().to_vec(),
        }
    }
    pub fn to_f32(&self) -> Result<Tensor> {
        Ok(match self {
            Raw::Mapped(m) => m.to_f32()?,
            Raw::F(t) => t.to_dtype(DType::F32)?,
        })
    }
    /// The values as f32, row-major.
    pub fn to_vec(&self) -> Result<Vec<f32>> {
        Ok(match self {
            Raw::Mapped(m) => m.to_vec()?,
            Raw::F(t) => t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?,
        })
    }
}

/// The input embedding: a dense f32 matrix (a float file's), or the quantized rows in the file,
/// dequantized only for the tokens looked up. Both give the same numbers.
pub enum Embedding {
    Dense(Tensor),
    Rows(Mapped),
}

impl Embedding {
    pub fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        match self {
            Embedding::Dense(t) => Ok(t.index_select(&Tensor::new(ids, &Device::Cpu)?, 0)?),
            Embedding::Rows(m) => {
                let cols = m.cols();
                let mut out = vec![0f32; ids.len() * cols];
                for (row, &id) in out.chunks_mut(cols).zip(ids) {
                    m.rows_to_f32(id as usize, row)?;
                }
                // each row looked up brought its neighbourhood of the file in (the kernel maps
                // pages around a fault): 67 MB for the 1,066 distinct tokens of bench's 2,048,
                // resident until the process ends; drop them, as after loading
                m.release_pages();
                Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
            }
        }
    }
}

/// The output projection `[vocab, d_model]`, applied to a few rows only (the logits asked for).
pub enum Head {
    /// f32 in memory (a float file's head).
    Dense(Tensor),
    /// The quantized blocks in the file, dequantized a chunk of vocabulary rows at a time for
    /// every call: the same values as dequantizing it whole, without holding it as f32 (on the
    /// default model a 145 MB mapping instead of 544 MB of f32).
    Rows(Mapped),
    /// `fast`: candle's quantized matmul on the blocks.
    Quant(QMatMul),
}

/// One weight matrix `W: [n, k]` of `y = x Wᵀ`, as held for a [`Precision`].
pub enum Matrix {
    /// f32, packed once for the GEMM kernel ([`crate::kernels::gemm::PackedB`]).
    Packed(PackedB),
    /// 8-bit blocks for the VNNI or AVX2 kernel ([`crate::kernels::int8`]); activations are quantized
    /// to 8-bit blocks too.
    Int8(PackedQ8),
    /// bf16 tiles for the AMX kernel ([`crate::kernels::amx`]): three parts per weight for
    /// `exact` (an f32 product), one for `fast`.
    Amx(PackedBf16),
    /// A quantized file's integers and scales on the AMX tiles, exact
    /// ([`crate::kernels::amx::scaled`]).
    Scaled(PackedScaled),
    /// `--memory low`: the file's own blocks, mapped, dequantized a panel at a time into the
    /// f32 kernel's layout for each product (`lowmem`).
    Quant(QuantB),
}

impl Matrix {
    /// Whether this matrix is packed as `layout` keeps it (a cache file of the `Scaled` layout
    /// holds f32 panels for the matrices whose weights are not integers times scales).
    fn fits(&self, layout: PanelLayout) -> bool {
        match (self, layout) {
            (
                Matrix::Packed(p),
                PanelLayout::F32(isa) | PanelLayout::Scaled(isa) | PanelLayout::Int8(isa),
            ) => p.isa == isa,
            (Matrix::Amx(p), PanelLayout::Bf16 { splits }) => p.splits == splits,
            (Matrix::Scaled(_), PanelLayout::Scaled(_)) => true,
            (Matrix::Int8(_), PanelLayout::Int8(_)) => true,
            // never kept in (nor read from) the packed-weight cache
            (Matrix::Quant(_), _) => false,
            _ => false,
        }
    }

    /// `(n, k)` of `W: [n, k]`.
    fn shape(&self) -> (usize, usize) {
        match self {
            Matrix::Packed(p) => (p.n, p.k),
            Matrix::Amx(p) => (p.n, p.k),
            Matrix::Int8(p) => (p.n, p.k),
            Matrix::Scaled(p) => (p.n, p.k),
            Matrix::Quant(q) => q.shape(),
        }
    }

    /// What a cache entry says of how the matrix is packed: 0 the layout's own panels (f32
    /// panels in the `Scaled` and `Int8` layouts), 1 integers and scales, 2 integers, scales and
    /// offsets, 3 8-bit blocks.
    fn kind(&self) -> u8 {
        match self {
            Matrix::Scaled(p) => 1 + p.has_offsets() as u8,
            Matrix::Int8(_) => 3,
            _ => 0,
        }
    }
}

/// A projection `y = x Wᵀ (+ b)`, possibly several fused along the output (`[W_q; W_k; W_v]`
/// or `[W_gate; W_up]`) into one matrix, so one pass over `x` computes them all.
pub struct Linear {
    pub k: usize,
    pub n: usize,
    mat: Matrix,
    /// `[n]`, zero where a part has no bias
    bias: Option<Vec<f32>>,
    /// `exact`: the parts' mapped blocks (a GGUF's), which a decode step's product of one row
    /// multiplies from ([`Linear::forward_into_as`], [`matvec::decode_from_blocks`])
    decode: Option<matvec::Decoder>,
}

impl Linear {
    /// The packed bytes of this projection if it is packed in `layout` in memory of its own
    /// (not mapped from a cache file): what the packed-weight cache writes.
    /// With the bytes, the entry's kind ([`Matrix`]'s: 0 the layout's own panels, 1 or 2
    /// integers and scales).
    pub fn packed_bytes(&self, layout: PanelLayout) -> Option<(u8, &[u8])> {
        if !self.mat.fits(layout) || self.is_mapped() {
            return None;
        }
        let kind = self.mat.kind();
        match &self.mat {
            Matrix::Packed(p) => Some((kind, p.as_bytes())),
            Matrix::Amx(p) => Some((kind, p.as_bytes())),
            Matrix::Scaled(p) => Some((kind, p.as_bytes())),
            Matrix::Int8(p) => Some((kind, p.as_bytes())),
            Matrix::Quant(_) => None,
        }
    }

    /// Whether this projection runs on the AMX tiles as its file's integers and scales.
    pub fn is_scaled(&self) -> bool {
        matches!(self.mat, Matrix::Scaled(_))
    }

    /// Whether this projection is read from a mapped cache file.
    pub fn is_mapped(&self) -> bool {
        match &self.mat {
            Matrix::Packed(p) => p.is_mapped(),
            Matrix::Amx(p) => p.is_mapped(),
            Matrix::Scaled(p) => p.is_mapped(),
            Matrix::Int8(p) => p.is_mapped(),
            Matrix::Quant(_) => false,
        }
    }

    /// Whether this projection is multiplied straight from the file's blocks (`--memory low`).
    pub fn is_low(&self) -> bool {
        matches!(self.mat, Matrix::Quant(_))
    }

    /// `out[m, n] = x[m, k] · Wᵀ (+ b)`; with `accumulate`, `out += x · Wᵀ` (no bias allowed).
    pub fn forward_into(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        accumulate: bool,
    ) -> Result<()> {
        self.forward_into_as(x, m, out, accumulate, false)
    }

    /// [`Linear::forward_into`], with `from_blocks` (a decode step's forward:
    /// [`crate::model::forward::RunOptions::decode_step`], unless `ATTNSCOPE_DECODE=panels`) a
    /// product of one row multiplied straight from the file's blocks where this projection keeps
    /// them ([`matvec::Decoder`]; the packed path otherwise).
    pub fn forward_into_as(
        &self,
        x: &[f32],
        m: usize,
        out: &mut [f32],
        accumulate: bool,
        from_blocks: bool,
    ) -> Result<()> {
        let (k, n) = (self.k, self.n);
        assert!(
            x.len() >= m * k && out.len() >= m * n,
            "Linear::forward_into: buffers too short"
        );
        match &self.mat {
            // a decode step: one row, straight from the file's blocks
            _ if m == 1 && from_blocks && self.decode.is_some() => {
                let d = self.decode.as_ref().expect("matched just above");
                d.matvec(x, &mut out[..n], accumulate)
            }
            Matrix::Packed(pb) => gemm::gemm(x, k, m, pb, out, n, accumulate),
            Matrix::Int8(pq) => {
                int8::gemm_q8(&int8::QuantA::new(x, m, k, k), pq, out, n, accumulate)
            }
            Matrix::Amx(pa) => amx::gemm(x, k, m, pa, out, n, accumulate),
            Matrix::Scaled(ps) => amx::scaled::gemm(x, k, m, ps, out, n, accumulate),
            Matrix::Quant(q) => q.gemm(x, k, m, 0..k, out, n, accumulate),
        }
        if let Some(b) = &self.bias {
            assert!(!accumulate, "a biased projection cannot accumulate");
            for row in out[..m * n].chunks_mut(n) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        Ok(())
    }

    /// Whether the projection adds a bias (then it cannot accumulate into its output).
    pub fn has_bias(&self) -> bool {
        self.bias.is_some()
    }

    /// `x[m, k] · Wᵀ` without the bias, as a new `[m, n]` buffer: the part of the output that
    /// depends on `x` (norm-based attention measures it per token).
    pub fn forward_unbiased(&self, x: &[f32], m: usize) -> Vec<f32> {
        let (k, n) = (self.k, self.n);
        assert!(
            x.len() >= m * k,
            "Linear::forward_unbiased: input too short"
        );
        let mut out = vec![0f32; m * n];
        match &self.mat {
            Matrix::Packed(pb) => gemm::gemm(x, k, m, pb, &mut out, n, false),
            Matrix::Int8(pq) => {
                int8::gemm_q8(&int8::QuantA::new(x, m, k, k), pq, &mut out, n, false)
            }
            Matrix::Amx(pa) => amx::gemm(x, k, m, pa, &mut out, n, false),
            Matrix::Scaled(ps) => amx::scaled::gemm(x, k, m, ps, &mut out, n, false),
            Matrix::Quant(q) => q.gemm(x, k, m, 0..k, &mut out, n, false),
        }
        out
    }

    /// `x[m, ks.len()] · W[:, ks]ᵀ` without the bias, as a new `[m, n]` buffer: the product with
    /// the input columns `ks` alone, the others taken as zero, computed without them (the same
    /// bits as the whole product with zeros there when `k` fits one depth slice of the kernel,
    /// as on the default model; else equal up to rounding; on the tiles as integers and scales,
    /// the same bits always, for columns in whole groups of 32). `None` where the projection is
    /// held otherwise (then pad with zeros and call [`Linear::forward_unbiased`]).
    pub fn forward_unbiased_cols(
        &self,
        x: &[f32],
        m: usize,
        ks: std::ops::Range<usize>,
    ) -> Option<Vec<f32>> {
        assert!(
            ks.start <= ks.end && ks.end <= self.k && x.len() >= m * ks.len(),
            "Linear::forward_unbiased_cols: columns {ks:?} of {} or input too short",
            self.k
        );
        let lda = ks.len();
        match &self.mat {
            Matrix::Packed(pb) => {
                let mut out = vec![0f32; m * self.n];
                gemm::gemm_sub(x, lda, m, pb, ks, 0..self.n, &mut out, self.n, false, true);
                Some(out)
            }
            // on the tiles, only whole groups, as `fast`'s packed matrix (the same bits)
            Matrix::Quant(q)
                if !q.on_tiles()
                    || (ks.start.is_multiple_of(amx::scaled::GROUP)
                        && ks.end.is_multiple_of(amx::scaled::GROUP)) =>
            {
                let mut out = vec![0f32; m * self.n];
                q.gemm(x, lda, m, ks, &mut out, self.n, false);
                Some(out)
            }
            Matrix::Scaled(ps)
                if ks.start.is_multiple_of(amx::scaled::GROUP)
                    && ks.end.is_multiple_of(amx::scaled::GROUP) =>
            {
                let mut out = vec![0f32; m * self.n];
                let gs = ks.start / amx::scaled::GROUP..ks.end / amx::scaled::GROUP;
                amx::scaled::gemm_groups_with(
                    amx::Engine::Tiles,
                    x,
                    lda,
                    m,
                    ps,
                    gs,
                    &mut out,
                    self.n,
                    false,
                );
                Some(out)
            }
            _ => None,
        }
    }

    /// The bias `[n]` (zero where a fused part has none), if the projection adds one.
    pub fn bias(&self) -> Option<&[f32]> {
        self.bias.as_deref()
    }

    /// Replaces the bias (`[n]`, or none): TransformerLens's weight processing moves the value
    /// biases into the output projection's ([`crate::model::processing`]).
    pub(crate) fn set_bias(&mut self, bias: Option<Vec<f32>>) {
        assert!(
            bias.as_ref().is_none_or(|b| b.len() == self.n),
            "a bias of the projection's width"
        );
        self.bias = bias;
    }

    /// `W: [n, k]` as f32, row-major: the weights this projection computes with, read back
    /// through its own kernel (the product with unit vectors, 32 input columns at a time, so
    /// whatever the packing, quantized blocks included, the values are the ones it multiplies by).
    pub fn weight_f32(&self) -> Vec<f32> {
        const C: usize = 32;
        let (k, n) = (self.k, self.n);
        let mut w = vec![0f32; n * k];
        let mut eye = vec![0f32; C * C];
        let mut wide = Vec::new();
        for c0 in (0..k).step_by(C) {
            let c = C.min(k - c0);
            // [c, n]: row r is column c0 + r of W
            let cols = match self.forward_unbiased_cols(
                &{
                    eye.fill(0.0);
                    (0..c).for_each(|r| eye[r * c + r] = 1.0);
                    eye[..c * c].to_vec()
                },
                c,
                c0..c0 + c,
            ) {
                Some(out) => out,
                None => {
                    // a packing without column slices: unit rows over the whole input
                    wide.resize(c * k, 0.0);
                    wide.fill(0.0);
                    (0..c).for_each(|r| wide[r * k + c0 + r] = 1.0);
                    self.forward_unbiased(&wide, c)
                }
            };
            for r in 0..c {
                for (j, &v) in cols[r * n..(r + 1) * n].iter().enumerate() {
                    w[j * k + c0 + r] = v;
                }
            }
        }
        w
    }

    /// `W: [n, k]` packed as the right-hand side of `dY[m, n] · W` (the backward's product):
    /// f32 panels are read back as they are, integers and scales dequantized as the tiles
    /// multiply them; a matrix held otherwise is read back through its own kernel (`I · Wᵀ`),
    /// the values the forward multiplies by. `None` for `--memory low`'s blocks: the backward
    /// multiplies by them as they are ([`Linear::backward_from_blocks`]), with no f32 copy.
    pub fn transposed(&self) -> Option<PackedB> {
        let (k, n) = (self.k, self.n);
        use rayon::prelude::*;
        let isa = gemm::Isa::detect();
        Some(match &self.mat {
            Matrix::Quant(_) => return None,
            Matrix::Packed(pb) => {
                let mut w = vec![0f32; n * k];
                w.par_chunks_mut(k)
                    .enumerate()
                    .for_each(|(j, row)| row.copy_from_slice(&pb.column(j)));
                PackedB::from_cols(&w, n, k, k, isa)
            }
            // a quantized file's integers and scales: `S · Q + O` read off the packed form (the
            // product through the tiles below gives the same bits, at the cost of a k × k
            // identity times the matrix)
            Matrix::Scaled(ps) => PackedB::from_cols(&ps.dense(), n, k, k, isa),
            _ => {
                let mut wt = vec![0f32; k * n];
                let step = 1024;
                for r0 in (0..k).step_by(step) {
                    let rows = step.min(k - r0);
                    let mut eye = vec![0f32; rows * k];
                    for i in 0..rows {
                        eye[i * k + r0 + i] = 1.0;
                    }
                    let part = self.forward_unbiased(&eye, rows);
                    wt[r0 * n..(r0 + rows) * n].copy_from_slice(&part);
                }
                PackedB::from_rows(&wt, k, n, n, isa)
            }
        })
    }

    /// `dX[m, k] = dY[m, n] · W` straight from the file's blocks where `--memory low` holds the
    /// matrix so (`true`; a panel's depth slice dequantized per product, the values the forward
    /// multiplies by), `false` otherwise (the backward multiplies by [`Linear::transposed`]).
    pub fn backward_from_blocks(&self, dy: &[f32], m: usize, dx: &mut [f32]) -> bool {
        match &self.mat {
            Matrix::Quant(q) => {
                q.gemm_transposed(dy, self.n, m, dx, self.k, false);
                true
            }
            _ => false,
        }
    }

    /// `x[m, k] · Wᵀ (+ b)` as a new `[m, n]` buffer.
    pub fn forward(&self, x: &[f32], m: usize) -> Result<Vec<f32>> {
        self.forward_as(x, m, false)
    }

    /// [`Linear::forward`], one row from the file's blocks with `from_blocks`
    /// ([`Linear::forward_into_as`]).
    pub fn forward_as(&self, x: &[f32], m: usize, from_blocks: bool) -> Result<Vec<f32>> {
        let mut out = vec![0f32; m * self.n];
        self.forward_into_as(x, m, &mut out, false, from_blocks)?;
        Ok(out)
    }
}

pub struct Layer {
    /// What the family does in this block that is not a weight (resolved at load).
    pub plan: super::block::LayerPlan,
    pub attn_norm: Vec<f32>,
    /// Qwen3 / Gemma 3: RMSNorm weights of each head's query and key (`[head_dim]`), before RoPE.
    pub qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// Gemma: RMSNorm weights after attention and after the MLP.
    pub post_norms: Option<(Vec<f32>, Vec<f32>)>,
    /// GPT-2: the LayerNorms' biases (before attention, before the MLP).
    pub norm_biases: Option<(Vec<f32>, Vec<f32>)>,
    /// `[W_q; W_k; W_v]`: parts `n_heads·d`, `n_kv·d`, `n_kv·d`
    pub qkv: Linear,
    pub o: Linear,
    pub mlp_norm: Vec<f32>,
    /// `[W_gate; W_up]`: parts `d_ff`, `d_ff`
    pub gate_up: Linear,
    pub down: Linear,
}

pub struct Weights {
    /// GPT-2: learned positions `[context, d_model]`, and the final LayerNorm's bias.
    pub pos_embed: Option<Vec<f32>>,
    pub final_norm_bias: Option<Vec<f32>>,
    /// llama.cpp's per-frequency RoPE divisors, when the file has them.
    pub rope_freqs: Option<Vec<f32>>,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub final_norm: Vec<f32>,
    pub lm_head: Head,
    pub rope_style: RopeStyle,
    /// An encoder's own embedding weights (BERT); `None` for a decoder.
    pub encoder: Option<EncoderWeights>,
}

/// What an encoder adds to the embeddings: `LayerNorm(word + position + token type)`, and the
/// pooler over \[CLS\] when the checkpoint has one.
pub struct EncoderWeights {
    /// `[type_vocab, d_model]`.
    pub token_types: Vec<f32>,
    pub type_vocab: usize,
    /// The embeddings' LayerNorm: weight, bias.
    pub norm: (Vec<f32>, Vec<f32>),
    /// `tanh(W · h_[CLS] + b)`: `W: [d_model, d_model]` (row-major, `out × in`), `b`.
    pub pooler: Option<(Vec<f32>, Vec<f32>)>,
}

/// How the output projection (applied to a few rows, memory-bound) is held for `precision`:
/// `Some(q)` to keep it quantized for candle's mat-vec kernels, `None` for f32.
fn quantized(raw: &Raw, precision: Precision) -> Result<Option<QMatMul>> {
    Ok(match (raw, precision) {
        (Raw::Mapped(m), Precision::Fast) => match m.dtype.ggml() {
            // candle has SIMD kernels for these at every row count
            Some(
                GgmlDType::Q4K
                | GgmlDType::Q5K
                | GgmlDType::Q6K
                | GgmlDType::Q8_0
                | GgmlDType::Q2K
                | GgmlDType::Q3K,
            ) => Some(QMatMul::from_qtensor(m.to_qtensor()?)?),
            Some(GgmlDType::Q5_0) => Some(QMatMul::from_qtensor(repack_q5_0_to_q8_0(
                &m.to_qtensor()?,
            )?)?),
            // Q4_0/Q4_1/Q5_1 and float types: the f32 GEMM is faster than candle's scalar kernels;
            // IQ4_NL/IQ4_XS: candle has no kernel
            _ => None,
        },
        _ => None,
    })
}

/// The kernel `fast` runs its projections on, on this CPU: bf16 on AMX tiles where there are
/// (Sapphire Rapids and later), else 8-bit blocks on AVX-512 VNNI, else 8-bit blocks on AVX2 and
/// FMA (the same bits as VNNI), else none (then it runs the exact f32 kernels; see the README).
pub fn fast_kernel() -> Option<&'static str> {
    use crate::kernels::select::{kernels, FastOn};
    match kernels().fast {
        FastOn::Bf16 => Some("bf16 on AMX tiles"),
        FastOn::Int8 => Some("8-bit blocks on AVX-512 VNNI"),
        FastOn::Int8Avx2 => Some("8-bit blocks on AVX2"),
        FastOn::F32 => None,
    }
}

/// How a precision packs the projections on this CPU, as the packed-weight cache keeps them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PanelLayout {
    /// f32 panels of the GEMM micro-kernel's width (`exact`; `fast` without a kernel of its own)
    F32(gemm::Isa),
    /// bf16 tiles for AMX: 1 part (`fast`) or 3 (`exact` with `ATTNSCOPE_AMX=exact`)
    Bf16 { splits: usize },
    /// `exact` on a CPU with AMX: a quantized file's integers and scales on the tiles where the
    /// weights are of that form, f32 panels of the kernel's width for the others
    Scaled(gemm::Isa),
    /// `fast` on a CPU with AVX-512 VNNI or AVX2 and no AMX: 8-bit blocks for the int8 kernels
    /// (the same bytes for VNNI and AVX2; named `vnni-` after the first), f32 panels of the
    /// kernel's width for a matrix whose depth is not whole blocks
    Int8(gemm::Isa),
}

impl PanelLayout {
    /// A name that changes whenever the bytes of the layout would.
    pub fn name(self) -> String {
        match self {
            PanelLayout::F32(isa) => format!("{}-f32x{}", isa.name(), isa.nr()),
            PanelLayout::Bf16 { splits } => format!("amx-bf16x{splits}"),
            PanelLayout::Scaled(isa) => format!("amx-scaled1-{}-f32x{}", isa.name(), isa.nr()),
            PanelLayout::Int8(isa) => format!(
                "vnni-q8b{}p{}-{}-f32x{}",
                int8::BLOCK,
                int8::PANEL_COLUMNS,
                isa.name(),
                isa.nr()
            ),
        }
    }

    /// The layout `precision` packs on this CPU.
    pub fn of(precision: Precision) -> PanelLayout {
        match precision {
            Precision::Exact if amx::exact_on_tiles() => PanelLayout::Bf16 { splits: 3 },
            Precision::Exact if amx::exact_scaled() => PanelLayout::Scaled(gemm::Isa::detect()),
            Precision::Fast if amx::available() => PanelLayout::Bf16 { splits: 1 },
            Precision::Fast if fast_uses_int8() => PanelLayout::Int8(gemm::Isa::detect()),
            _ => PanelLayout::F32(gemm::Isa::detect()),
        }
    }
}

/// Whether `exact` on the AMX tiles reads a GGUF type as integers and scales: `Some(offsets)`,
/// or `None` for a type it leaves to the f32 kernels.
pub fn scaled_kind_of(dtype: BlockType) -> Option<bool> {
    scaled_kind(dtype)
}

/// Whether `fast` runs the int8 kernels on this CPU (AVX-512 VNNI or AVX2, no AMX).
pub fn fast_uses_int8() -> bool {
    use crate::kernels::select::{kernels, FastOn};
    matches!(kernels().fast, FastOn::Int8 | FastOn::Int8Avx2)
}

/// Builds a (possibly fused) projection from its parts `[n_i, k]`, concatenated along the
/// output and packed into one matrix: f32 for `exact`, for `fast` bf16 tiles or 8-bit blocks
/// as [`fast_kernel`] says.
///
/// `ready`: the same matrix already packed (from the packed-weight cache), used instead of
/// packing when it has this precision's layout ([`PanelLayout::of`]) and this shape.
fn linear(
    parts: Vec<(Raw, Option<Raw>)>,
    precision: Precision,
    memory: Memory,
    ready: Option<Matrix>,
) -> Result<Linear> {
    let k = *parts[0]
        .0
        .dims()
        .last()
        .expect("matrices have two dimensions");
    let (weights, widths, bias) = fuse_parts(parts)?;
    let n: usize = widths.iter().sum();
    // a matrix from the cache, if it has this precision's layout and this shape
    let layout = PanelLayout::of(precision);
    let ready = ready.filter(|m| m.fits(layout) && m.shape() == (n, k));
    let decode = (precision == Precision::Exact)
        .then(|| matvec::Decoder::of(&weights, &widths, k))
        .flatten();
    if let Some(mat) = ready {
        return Ok(Linear {
            k,
            n,
            mat,
            bias,
            decode,
        });
    }
    let starts: Vec<usize> = widths
        .iter()
        .scan(0, |acc, &w| {
            *acc += w;
            Some(*acc - w)
        })
        .collect();
    // `--memory low`: the file's blocks as they are, where every part is a GGUF tensor
    if memory == Memory::Low {
        if let Some(q) = QuantB::of(&weights, &starts, n, k) {
            return Ok(Linear {
                k,
                n,
                mat: Matrix::Quant(q),
                bias,
                decode,
            });
        }
    }
    let mat = pack(&weights, &widths, &starts, k, layout)?;
    for w in &weights {
        if let Raw::Mapped(m) = w {
            m.release_pages();
        }
    }
    Ok(Linear {
        k,
        n,
        mat,
        bias,
        decode,
    })
}

/// The parts' weights, their row counts, and their biases concatenated (zeros for a part
/// without one; `None` where no part has one).
type Fused = (Vec<Raw>, Vec<usize>, Option<Vec<f32>>);

/// Splits a projection's parts into [`Fused`]'s weights, widths and bias.
fn fuse_parts(parts: Vec<(Raw, Option<Raw>)>) -> Result<Fused> {
    let widths: Vec<usize> = parts.iter().map(|(w, _)| w.dims()[0]).collect();
    let n: usize = widths.iter().sum();
    let any_bias = parts.iter().any(|(_, b)| b.is_some());
    let mut bias = any_bias.then(|| vec![0f32; n]);
    let mut col0 = 0;
    let mut weights = Vec::with_capacity(parts.len());
    for ((w, b), width) in parts.into_iter().zip(&widths) {
        if let (Some(b), Some(all)) = (b, bias.as_mut()) {
            all[col0..col0 + width].copy_from_slice(&b.to_vec()?);
        }
        weights.push(w);
        col0 += width;
    }
    Ok((weights, widths, bias))
}

/// Packs the parts (rows `starts[i]..` of the fused `[Σ widths, k]` matrix) in `layout`,
/// straight from the file into the packed panels, a few rows at a time: the weights are never
/// held whole as plain f32 next to their packed copy.
fn pack(
    weights: &[Raw],
    widths: &[usize],
    starts: &[usize],
    k: usize,
    layout: PanelLayout,
) -> Result<Matrix> {
    let n: usize = widths.iter().sum();
    // floating-point tensors (a Hugging Face folder) as f32 once; GGUF blocks stay mapped
    let dense: Vec<Option<Vec<f32>>> = weights
        .iter()
        .map(|w| match w {
            Raw::Mapped(_) => Ok(None),
            Raw::F(t) => Ok(Some(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)),
        })
        .collect::<Result<_>>()?;
    let rows = |r0: usize, out: &mut [f32]| -> Result<()> {
        let (mut r, mut done) = (r0, 0);
        while done < out.len() {
            let (part, local) = part_of(starts, r);
            let count = (widths[part] - local).min((out.len() - done) / k);
            let dst = &mut out[done..done + count * k];
            match (&weights[part], &dense[part]) {
                (_, Some(d)) => dst.copy_from_slice(&d[local * k..(local + count) * k]),
                (Raw::Mapped(m), None) => m.rows_to_f32(local, dst)?,
                (Raw::F(_), None) => unreachable!("floating-point parts are read above"),
            }
            r += count;
            done += count * k;
        }
        Ok(())
    };
    // a quantized file's integers and scales on the tiles, where every part has that form
    let scaled = match layout {
        PanelLayout::Scaled(_) => scaled_matrix(weights, &dense, starts, n, k)?,
        _ => None,
    };
    // one decision of the layout, the one the cache keys its files by
    Ok(match (scaled, layout) {
        (Some(p), _) => Matrix::Scaled(p),
        (None, PanelLayout::Bf16 { splits }) => {
            Matrix::Amx(PackedBf16::try_from_row_source(n, k, splits, rows)?)
        }
        (None, PanelLayout::Int8(_)) if k.is_multiple_of(int8::BLOCK) => {
            Matrix::Int8(PackedQ8::try_from_row_source(n, k, rows)?)
        }
        // f32 panels, and 8-bit blocks' fallback for a depth that is not whole blocks
        (None, PanelLayout::F32(_) | PanelLayout::Scaled(_) | PanelLayout::Int8(_)) => {
            Matrix::Packed(PackedB::try_from_row_source(
                n,
                k,
                gemm::Isa::detect(),
                rows,
            )?)
        }
    })
}

/// Looks up one weight by its logical name, checking its shape.
pub trait TensorSource {
    /// `Ok(None)` if the tensor is absent.
    fn get(&mut self, logical: &Logical) -> Result<Option<Raw>>;
    fn path(&self) -> &Path;
    fn count(&self) -> usize;
    fn arch_name(&self) -> String;
    /// The names of every tensor the source holds.
    fn names(&self) -> Vec<String>;
}

/// Tensors a file may hold that change nothing the forward computes.
fn ignorable(name: &str) -> bool {
    // transformers' cached RoPE table (recomputed from the config)
    name.ends_with("rotary_emb.inv_freq")
        // BERT's position-id buffer (0..max_positions, recomputed)
        || name == "embeddings.position_ids"
}

/// Refuses a file holding a tensor the forward would not read (an output bias, a q/k norm, an MLP
/// bias...): ignoring it would give silently wrong numbers.
fn check_every_tensor_used(
    src: &dyn TensorSource,
    dims: &ModelDims,
    name: &dyn Fn(&Logical) -> String,
) -> Result<()> {
    let used: std::collections::HashSet<String> = Logical::all(dims.arch, dims.n_layers)
        .iter()
        .map(name)
        .collect();
    let mut unused: Vec<String> = src
        .names()
        .into_iter()
        .filter(|n| !used.contains(n) && !ignorable(n))
        .collect();
    unused.sort();
    if let Some(first) = unused.first() {
        let more = match unused.len() {
            1 => String::new(),
            k => format!(
                " (and {} more: {}{})",
                k - 1,
                unused[1..unused.len().min(4)].join(", "),
                if k > 4 { ", ..." } else { "" }
            ),
        };
        return Err(Error::UnusedTensor {
            name: first.clone(),
            more,
            path: src.path().into(),
            arch: src.arch_name(),
        });
    }
    Ok(())
}

impl Logical {
    /// Every weight the forward reads for a model of `n_layers` (optional ones included).
    pub fn all(arch: Arch, n_layers: usize) -> Vec<Logical> {
        let mut v = vec![
            Logical::Embed,
            Logical::FinalNorm,
            Logical::LmHead,
            Logical::RopeFreqs,
        ];
        let family = arch.family();
        if family.final_norm_bias {
            v.extend([Logical::PosEmbed, Logical::FinalNormBias]);
        }
        if family.encoder {
            v.extend([
                Logical::PosEmbed,
                Logical::EmbedNorm,
                Logical::EmbedNormBias,
                Logical::Pooler,
                Logical::PoolerBias,
            ]);
            if family.token_types {
                v.push(Logical::TypeEmbed);
            }
        }
        for i in 0..n_layers {
            v.extend([
                Logical::AttnNorm(i),
                Logical::Q(i),
                Logical::QBias(i),
                Logical::K(i),
                Logical::KBias(i),
                Logical::V(i),
                Logical::VBias(i),
                Logical::O(i),
                Logical::MlpNorm(i),
                Logical::Gate(i),
                Logical::Up(i),
                Logical::Down(i),
            ]);
            if family.qk_norm {
                v.extend([Logical::QNorm(i), Logical::KNorm(i)]);
            }
            if family.gemma.as_ref().is_some_and(|g| g.post_norms) {
                v.extend([Logical::PostAttnNorm(i), Logical::PostMlpNorm(i)]);
            }
            if family.learned_positions {
                v.extend([
                    Logical::AttnNormBias(i),
                    Logical::MlpNormBias(i),
                    Logical::OBias(i),
                    Logical::UpBias(i),
                    Logical::DownBias(i),
                ]);
            }
        }
        v
    }

    /// The shape this weight must have.
    pub fn shape(&self, d: &ModelDims) -> Vec<usize> {
        let (dm, q, kv) = (d.d_model, d.n_heads * d.head_dim, d.n_kv_heads * d.head_dim);
        match self {
            Logical::Embed | Logical::LmHead => vec![d.vocab_size, dm],
            Logical::FinalNorm
            | Logical::AttnNorm(_)
            | Logical::MlpNorm(_)
            | Logical::PostAttnNorm(_)
            | Logical::PostMlpNorm(_)
            | Logical::FinalNormBias
            | Logical::AttnNormBias(_)
            | Logical::MlpNormBias(_)
            | Logical::OBias(_)
            | Logical::DownBias(_)
            | Logical::EmbedNorm
            | Logical::EmbedNormBias
            | Logical::PoolerBias => vec![dm],
            Logical::TypeEmbed => vec![d.type_vocab, dm],
            Logical::Pooler => vec![dm, dm],
            Logical::UpBias(_) => vec![d.d_ff],
            Logical::PosEmbed => vec![d.context_len + d.position_offset(), dm],
            Logical::Q(_) => vec![q, dm],
            Logical::QBias(_) => vec![q],
            Logical::K(_) | Logical::V(_) => vec![kv, dm],
            Logical::KBias(_) | Logical::VBias(_) => vec![kv],
            Logical::O(_) => vec![dm, q],
            Logical::Gate(_) | Logical::Up(_) => vec![d.d_ff, dm],
            Logical::Down(_) => vec![dm, d.d_ff],
            Logical::RopeFreqs => vec![d.head_dim / 2],
            Logical::QNorm(_) | Logical::KNorm(_) => vec![d.head_dim],
        }
    }
}

fn fetch(
    src: &mut dyn TensorSource,
    l: &Logical,
    dims: &ModelDims,
    name: &dyn Fn(&Logical) -> String,
) -> Result<Option<Raw>> {
    let Some(raw) = src.get(l)? else {
        return Ok(None);
    };
    let want = l.shape(dims);
    let got = raw.dims();
    if got != want {
        return Err(Error::ShapeMismatch {
            name: name(l),
            path: src.path().into(),
            got,
            want,
        });
    }
    Ok(Some(raw))
}

/// Projections already packed, as the packed-weight cache (`panels::Cached`, which implements
/// this) holds them: the caller hands its cache to [`load_weights`], so `weights/` needs nothing
/// of `panels`.
pub trait PackedProjections {
    /// Projection `i` (`layer · 4 + slot`: q|k|v, o, gate|up, down) if held at shape `[k, n]`.
    fn get(&self, i: usize, n: usize, k: usize) -> Option<Matrix>;
}

/// Loads every weight of the model from `src`, checking names and shapes.
/// `name` gives a logical weight's name in the file, for error messages. `cached`: the
/// projections already packed (the packed-weight cache of this very model), taken instead of
/// packed where their shapes and the precision's layout agree.
#[allow(clippy::too_many_arguments)]
pub fn load_weights(
    src: &mut dyn TensorSource,
    dims: &ModelDims,
    precision: Precision,
    memory: Memory,
    rope_style: RopeStyle,
    name: &dyn Fn(&Logical) -> String,
    cached: Option<&dyn PackedProjections>,
    mut progress: impl FnMut(usize, usize),
) -> Result<Weights> {
    check_every_tensor_used(src, dims, name)?;
    let mut ld = Loading {
        src,
        dims,
        name,
        precision,
        memory,
        cached,
        // Gemma's RMSNorm multiplies by (1 + w) (computed in f32, as transformers does): stored
        // once
        gemma: dims.gemma.as_ref().is_some_and(|g| !g.norms_include_one),
    };
    // an encoder has no output head: the word embeddings stand in for it (tied), never read
    let encoder = dims.arch.is_encoder();
    let (embed, lm_head) = ld.embeddings(encoder)?;
    let final_norm = if encoder {
        Vec::new()
    } else {
        ld.norm(Logical::FinalNorm)?
    };
    let mut layers = Vec::with_capacity(dims.n_layers.min(ld.src.count()));
    for i in 0..dims.n_layers {
        layers.push(ld.layer(i)?);
        super::guard::fault_point("pack");
        progress(i + 1, dims.n_layers);
    }
    let rope_freqs = ld.rope_freqs()?;
    let gpt2 = dims.arch.family().final_norm_bias;
    let pos_embed = if dims.arch.learned_positions() {
        Some(ld.need(Logical::PosEmbed)?.to_vec()?)
    } else {
        None
    };
    let final_norm_bias = if gpt2 {
        Some(ld.need(Logical::FinalNormBias)?.to_vec()?)
    } else {
        None
    };
    Ok(Weights {
        pos_embed,
        final_norm_bias,
        rope_freqs,
        embed,
        layers,
        final_norm,
        lm_head,
        rope_style,
        encoder: if encoder {
            Some(ld.encoder_weights()?)
        } else {
            None
        },
    })
}

/// What [`load_weights`] reads from, and how it packs what it reads.
struct Loading<'a> {
    src: &'a mut dyn TensorSource,
    dims: &'a ModelDims,
    name: &'a dyn Fn(&Logical) -> String,
    precision: Precision,
    memory: Memory,
    cached: Option<&'a dyn PackedProjections>,
    /// Gemma's norms hold `1 + w`.
    gemma: bool,
}

impl Loading<'_> {
    /// A tensor the model cannot run without: missing, it is refused by name.
    fn need(&mut self, l: Logical) -> Result<Raw> {
        fetch(self.src, &l, self.dims, self.name)?.ok_or_else(|| Error::MissingTensor {
            name: (self.name)(&l),
            path: self.src.path().into(),
            arch: self.src.arch_name(),
            found: self.src.count(),
        })
    }

    /// A tensor the model may lack (biases, the pooler, RoPE's factors).
    fn maybe(&mut self, l: Logical) -> Result<Option<Raw>> {
        fetch(self.src, &l, self.dims, self.name)
    }

    /// A norm's weights (Gemma's as `1 + w`).
    fn norm(&mut self, l: Logical) -> Result<Vec<f32>> {
        let mut w = self.need(l)?.to_vec()?;
        if self.gemma {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    }

    /// The token embeddings and the output head (tied quantized embeddings: looked up and
    /// applied as the head from the same blocks).
    fn embeddings(&mut self, encoder: bool) -> Result<(Embedding, Head)> {
        let precision = self.precision;
        Ok(
            match (
                self.need(Logical::Embed)?,
                self.dims.tied_embeddings || encoder,
            ) {
                (Raw::Mapped(m), true) => (Embedding::Rows(m.clone()), Head::Rows(m)),
                (Raw::Mapped(m), false) => (
                    Embedding::Rows(m),
                    head_matrix(self.need(Logical::LmHead)?, precision)?,
                ),
                (raw, tied) => {
                    let dense = raw.to_f32()?;
                    let head = if tied {
                        Head::Dense(dense.clone())
                    } else {
                        head_matrix(self.need(Logical::LmHead)?, precision)?
                    };
                    (Embedding::Dense(dense), head)
                }
            },
        )
    }

    /// A weight and its bias (if `b` names one and the file has it).
    fn part(&mut self, w: Logical, b: Option<Logical>) -> Result<(Raw, Option<Raw>)> {
        let w = self.need(w)?;
        let b = match b {
            Some(b) => self.maybe(b)?,
            None => None,
        };
        Ok((w, b))
    }

    /// Fuses `parts` into cache slot `slot` of layer `i` (q|k|v, o, gate|up, down in turn).
    fn linear(
        &self,
        parts: Vec<(Raw, Option<Raw>)>,
        i: usize,
        slot: usize,
        (n, k): (usize, usize),
    ) -> Result<Linear> {
        let ready = self.cached.and_then(|c| c.get(4 * i + slot, n, k));
        linear(parts, self.precision, self.memory, ready)
    }

    /// Layer `i`'s projections (packed or kept in their blocks) and norms.
    fn layer(&mut self, i: usize) -> Result<Layer> {
        let dims = self.dims;
        let qkv = vec![
            self.part(Logical::Q(i), Some(Logical::QBias(i)))?,
            self.part(Logical::K(i), Some(Logical::KBias(i)))?,
            self.part(Logical::V(i), Some(Logical::VBias(i)))?,
        ];
        // GPT-2 and BERT: biases everywhere, LayerNorms, an MLP without gate
        let gpt2 = dims.arch.learned_positions();
        let bias = |l: Logical| gpt2.then_some(l);
        let (dm, qkv_n) = (
            dims.d_model,
            (dims.n_heads + 2 * dims.n_kv_heads) * dims.head_dim,
        );
        let gate_up_n = if gpt2 { dims.d_ff } else { 2 * dims.d_ff };
        let qkv = self.linear(qkv, i, 0, (qkv_n, dm))?;
        let o = self.part(Logical::O(i), bias(Logical::OBias(i)))?;
        let o = self.linear(vec![o], i, 1, (dm, dims.n_heads * dims.head_dim))?;
        // GPT-2's MLP has no gate: this holds c_fc alone
        let gate_up = if gpt2 {
            vec![self.part(Logical::Up(i), Some(Logical::UpBias(i)))?]
        } else {
            vec![
                self.part(Logical::Gate(i), None)?,
                self.part(Logical::Up(i), None)?,
            ]
        };
        let gate_up = self.linear(gate_up, i, 2, (gate_up_n, dm))?;
        let down = self.part(Logical::Down(i), bias(Logical::DownBias(i)))?;
        let down = self.linear(vec![down], i, 3, (dm, dims.d_ff))?;
        let norm_biases = if gpt2 {
            Some((
                self.need(Logical::AttnNormBias(i))?.to_vec()?,
                self.need(Logical::MlpNormBias(i))?.to_vec()?,
            ))
        } else {
            None
        };
        let qk_norm = if dims.arch.family().qk_norm {
            Some((self.norm(Logical::QNorm(i))?, self.norm(Logical::KNorm(i))?))
        } else {
            None
        };
        let post_norms = if dims
            .arch
            .family()
            .gemma
            .as_ref()
            .is_some_and(|g| g.post_norms)
        {
            Some((
                self.norm(Logical::PostAttnNorm(i))?,
                self.norm(Logical::PostMlpNorm(i))?,
            ))
        } else {
            None
        };
        Ok(Layer {
            plan: super::block::LayerPlan::of(dims, i),
            qkv,
            o,
            gate_up,
            down,
            norm_biases,
            qk_norm,
            post_norms,
            attn_norm: self.norm(Logical::AttnNorm(i))?,
            mlp_norm: self.norm(Logical::MlpNorm(i))?,
        })
    }

    /// Llama 3's RoPE frequency factors, if the file has them (each a positive number).
    fn rope_freqs(&mut self) -> Result<Option<Vec<f32>>> {
        let Some(raw) = self.maybe(Logical::RopeFreqs)? else {
            return Ok(None);
        };
        let f = raw.to_vec()?;
        if let Some(bad) = f.iter().find(|x| !(x.is_finite() && **x > 0.0)) {
            return Err(Error::BadValue {
                key: (self.name)(&Logical::RopeFreqs),
                path: self.src.path().into(),
                reason: format!("a RoPE frequency factor is {bad}; they must be positive numbers"),
            });
        }
        Ok(Some(f))
    }

    /// An encoder's token types, embedding norm and pooler.
    fn encoder_weights(&mut self) -> Result<EncoderWeights> {
        let pooler = match self.maybe(Logical::Pooler)? {
            Some(w) => Some((w.to_vec()?, self.need(Logical::PoolerBias)?.to_vec()?)),
            None => None,
        };
        Ok(EncoderWeights {
            token_types: if self.dims.type_vocab == 0 {
                Vec::new()
            } else {
                self.need(Logical::TypeEmbed)?.to_vec()?
            },
            type_vocab: self.dims.type_vocab,
            norm: (
                self.need(Logical::EmbedNorm)?.to_vec()?,
                self.need(Logical::EmbedNormBias)?.to_vec()?,
            ),
            pooler,
        })
    }
}

/// The output projection (applied to a few rows only): quantized in `fast`, else f32 values
/// (dequantized per call from the file's blocks when it has them).
fn head_matrix(raw: Raw, precision: Precision) -> Result<Head> {
    Ok(match quantized(&raw, precision)? {
        Some(q) => Head::Quant(q),
        None => match raw {
            Raw::Mapped(m) => Head::Rows(m),
            Raw::F(_) => Head::Dense(raw.to_f32()?),
        },
    })
}

#[cfg(test)]
mod tests;
