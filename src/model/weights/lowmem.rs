//! `--memory low`: the projections stay in the file's own quantized blocks (the mapped GGUF),
//! and each product dequantizes a depth slice of a panel of weights into a buffer of the worker
//! thread, in the packed layout the f32 micro-kernel reads, just before multiplying it
//! ([`crate::kernels::gemm::PanelSource`]). The values are the ones `fast`'s packed panels hold,
//! bit for bit (the same dequantization, block by block), so the two settings differ only in the
//! order of the sums (not at all where a product's depth fits one slice of the kernel).

use super::quant::{decode_pairs, dequantize_into, part_of, scaled_kind, BlockType};
use super::{Mapped, Raw};
use crate::kernels::amx::{self, scaled::RowSource};
use crate::kernels::gemm::{self, Isa, PanelSource};
use candle_core::quantized::GgmlDType;
use serde::Serialize;
use std::cell::RefCell;

/// How much memory the projections take: `low` keeps them as the file's quantized blocks
/// (mapped), dequantized a panel at a time for each product; `fast` holds them packed for the
/// kernels (f32 panels, or the AMX tiles' integers and scales), faster and larger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Memory {
    /// The file's own blocks, mapped; a panel dequantized just before each product.
    Low,
    /// The projections packed once at load (and kept in the packed-weight cache).
    Fast,
}

impl Memory {
    /// Both settings, in the order `--help` lists them.
    pub const ALL: [Memory; 2] = [Memory::Low, Memory::Fast];

    /// The setting's name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Memory::Low => "low",
            Memory::Fast => "fast",
        }
    }
}

impl std::str::FromStr for Memory {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Memory::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| format!("unknown memory setting `{s}`; choose low or fast"))
    }
}

impl std::fmt::Display for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether `--memory low` multiplies a GGUF tensor of this type from its blocks: every type
/// attnscope dequantizes (checked against gguf-py in this module's parent's tests).
pub fn low_supported(dtype: BlockType) -> bool {
    !matches!(dtype, BlockType::Ggml(GgmlDType::Q8_1 | GgmlDType::Q8K))
}

/// A (possibly fused) projection `W: [n, k]` held as its parts' blocks in the mapped file.
pub struct QuantB {
    parts: Vec<Mapped>,
    /// The first row of each part in the fused matrix.
    starts: Vec<usize>,
    n: usize,
    k: usize,
    /// `Some(offsets)` where the product runs on the AMX tiles as integers and scales (the
    /// layout `fast` packs on this CPU: [`amx::exact_scaled`], every part of a
    /// [`scaled_kind`] type, whole groups of 32 along k), decoded from the blocks per product.
    scaled: Option<bool>,
}

thread_local! {
    /// A panel's rows dequantized (`NR × span`), and compacted to the slice asked for.
    static ROWS: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
    /// The blocks that hold a row's groups, as integers, scales and offsets, where the groups
    /// asked for start or end inside a block (a K-quant's super-block of 256).
    static WIDE: RefCell<(Vec<u32>, Vec<f32>, Vec<f32>)> =
        const { RefCell::new((Vec::new(), Vec::new(), Vec::new())) };
}

impl QuantB {
    /// The parts as they lie in the file, if every one is a GGUF tensor of a type
    /// [`low_supported`] reads, `[rows, k]` of whole blocks; `None` otherwise (floats of a
    /// Hugging Face folder, a type read otherwise): the caller packs the matrix.
    pub(super) fn of(parts: &[Raw], starts: &[usize], n: usize, k: usize) -> Option<QuantB> {
        let mut mapped = Vec::with_capacity(parts.len());
        for (i, p) in parts.iter().enumerate() {
            let Raw::Mapped(m) = p else { return None };
            let rows = parts
                .get(i + 1)
                .map_or(n, |_| starts[i + 1])
                .checked_sub(starts[i])?;
            let (bs, ts) = (m.dtype.block_size(), m.dtype.type_size());
            let whole = m.dims.len() == 2
                && m.dims == [rows, k]
                && k.is_multiple_of(bs)
                && m.len == rows * (k / bs) * ts
                && m.offset + m.len <= m.map.len();
            if !(low_supported(m.dtype) && whole) {
                return None;
            }
            mapped.push(m.clone());
        }
        let kinds: Option<Vec<bool>> = mapped.iter().map(|m| scaled_kind(m.dtype)).collect();
        // every integer of these types is exact in bf16; a BF16 weight that is not finite
        // (every exponent bit set) is not: such a matrix stays on the f32 panels
        let finite = |m: &Mapped| {
            m.dtype != BlockType::Ggml(GgmlDType::BF16)
                || m.map[m.offset..m.offset + m.len]
                    .chunks_exact(2)
                    .all(|b| u16::from_le_bytes([b[0], b[1]]) & 0x7f80 != 0x7f80)
        };
        let scaled = kinds
            .filter(|_| amx::exact_scaled() && k.is_multiple_of(amx::scaled::GROUP) && k > 0)
            .filter(|_| mapped.iter().all(finite))
            .map(|ks| ks.contains(&true));
        Some(QuantB {
            parts: mapped,
            starts: starts.to_vec(),
            n,
            k,
            scaled,
        })
    }

    /// `(n, k)` of `W`.
    pub fn shape(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    /// Bytes of the file this projection reads.
    pub fn file_bytes(&self) -> usize {
        self.parts.iter().map(|m| m.len).sum()
    }

    /// Whether the products run on the AMX tiles as the blocks' integers and scales (as
    /// `fast`'s packed matrix does on this CPU), rather than on f32 panels.
    pub fn on_tiles(&self) -> bool {
        self.scaled.is_some()
    }

    /// `C[m, cols] (+)= A[m, ks] · W[cols, ks]ᵀ`: on the AMX tiles as integers and scales where
    /// [`QuantB::on_tiles`] and `ks` is whole groups of 32 (the bits of `fast`'s packed
    /// matrix: the same values through the same kernel, decoded for this product and dropped
    /// after it), else on the f32 micro-kernel from panel slices dequantized as they are needed.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        a: &[f32],
        lda: usize,
        m: usize,
        ks: std::ops::Range<usize>,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        const G: usize = amx::scaled::GROUP;
        if ks.start.is_multiple_of(G) && ks.end.is_multiple_of(G) && m > 0 && self.scaled.is_some()
        {
            amx::scaled::gemm_decoded(
                amx::Engine::Tiles,
                a,
                lda,
                m,
                self,
                ks.start / G..ks.end / G,
                c,
                ldc,
                accumulate,
            );
            return;
        }
        gemm::gemm_source(
            a,
            lda,
            m,
            self,
            Isa::detect(),
            ks,
            0..self.n,
            c,
            ldc,
            accumulate,
            true,
        )
    }
}

impl QuantB {
    /// `C[m, k] (+)= A[m, n] · W`: the backward's product with the transpose (`dX = dY · W`),
    /// each panel's depth slice dequantized from the blocks just before it is multiplied, as
    /// [`QuantB::gemm`] does, so `--memory low` holds no f32 copy of `W` for the backward either.
    pub fn gemm_transposed(
        &self,
        a: &[f32],
        lda: usize,
        m: usize,
        c: &mut [f32],
        ldc: usize,
        accumulate: bool,
    ) {
        gemm::gemm_source(
            a,
            lda,
            m,
            &Transposed(self),
            Isa::detect(),
            0..self.n,
            0..self.k,
            c,
            ldc,
            accumulate,
            true,
        )
    }
}

/// `W: [n, k]` as the right-hand side `B = W` of `dY · W` (depth `n`, columns `k`): a panel is
/// `NR` of W's columns, its depth slice rows `k0..k0 + kc` of W, each row's blocks that hold the
/// panel's columns dequantized (one block of 32 for Q8_0/Q5_0/Q4_0, a super-block of 256 for
/// the K-quants) and the columns copied out.
struct Transposed<'a>(&'a QuantB);

impl PanelSource for Transposed<'_> {
    fn dims(&self) -> (usize, usize) {
        (self.0.k, self.0.n)
    }

    fn fill(&self, isa: Isa, p: usize, k0: usize, kc: usize, out: &mut [f32]) {
        let q = self.0;
        let nr = isa.nr();
        let j0 = p * nr;
        let cols = nr.min(q.k - j0);
        ROWS.with(|cell| {
            let (wide, _) = &mut *cell.borrow_mut();
            for (kk, dst) in out.chunks_mut(nr).take(kc).enumerate() {
                let (part, local) = part_of(&q.starts, k0 + kk);
                let m = &q.parts[part];
                let (bs, ts) = (m.dtype.block_size(), m.dtype.type_size());
                let (b0, b1) = (j0 / bs, (j0 + cols).div_ceil(bs));
                let row = m.offset + local * (q.k / bs) * ts;
                let span = (b1 - b0) * bs;
                wide.resize(span, 0.0);
                // `of` checked that rows are whole blocks inside the mapping
                dequantize_into(
                    m.dtype,
                    &m.map[row + b0 * ts..row + b1 * ts],
                    &mut wide[..span],
                )
                .expect("whole blocks, checked when the projection was made");
                dst[..cols].copy_from_slice(&wide[j0 - b0 * bs..][..cols]);
                dst[cols..].fill(0.0);
            }
        });
    }
}

impl PanelSource for QuantB {
    fn dims(&self) -> (usize, usize) {
        (self.n, self.k)
    }

    fn fill(&self, isa: Isa, p: usize, k0: usize, kc: usize, out: &mut [f32]) {
        let nr = isa.nr();
        let j0 = p * nr;
        let cols = nr.min(self.n - j0);
        ROWS.with(|cell| {
            let (wide, tight) = &mut *cell.borrow_mut();
            tight.resize(nr * kc, 0.0);
            for c in 0..cols {
                let (part, local) = part_of(&self.starts, j0 + c);
                let m = &self.parts[part];
                let (bs, ts) = (m.dtype.block_size(), m.dtype.type_size());
                let (b0, b1) = (k0 / bs, (k0 + kc).div_ceil(bs));
                let row = m.offset + local * (self.k / bs) * ts;
                let bytes = &m.map[row + b0 * ts..row + b1 * ts];
                let dst = &mut tight[c * kc..(c + 1) * kc];
                // `of` checked that rows are whole blocks inside the mapping: the lengths agree
                let done = if k0.is_multiple_of(bs) && (k0 + kc).is_multiple_of(bs) {
                    dequantize_into(m.dtype, bytes, dst)
                } else {
                    let span = (b1 - b0) * bs;
                    wide.resize(span, 0.0);
                    let r = dequantize_into(m.dtype, bytes, &mut wide[..span]);
                    dst.copy_from_slice(&wide[k0 - b0 * bs..][..kc]);
                    r
                };
                done.expect("whole blocks, checked when the projection was made");
            }
            if cols < nr {
                out[..kc * nr].fill(0.0);
            }
            gemm::transpose_into_panel(&tight[..cols * kc], cols, kc, nr, out);
        });
    }
}

/// The rows of a projection that runs on the AMX tiles ([`QuantB::on_tiles`]), decoded from
/// the blocks as `fast` packs them (the integers of [`super::quant::decode_scaled`], as bf16
/// pairs: [`decode_pairs`]), a depth slice at a time.
impl RowSource for QuantB {
    fn layout(&self) -> (usize, usize, bool) {
        (
            self.n,
            self.k / amx::scaled::GROUP,
            self.scaled == Some(true),
        )
    }

    fn row(
        &self,
        j: usize,
        gs: std::ops::Range<usize>,
        q: &mut [u32],
        s: &mut [f32],
        o: &mut [f32],
    ) -> bool {
        const G: usize = amx::scaled::GROUP;
        let (part, local) = part_of(&self.starts, j);
        let m = &self.parts[part];
        let (bs, ts) = (m.dtype.block_size(), m.dtype.type_size());
        let (v0, v1) = (gs.start * G, gs.end * G);
        let (b0, b1) = (v0 / bs, v1.div_ceil(bs));
        let row = m.offset + local * (self.k / bs) * ts;
        let bytes = &m.map[row + b0 * ts..row + b1 * ts];
        if v0.is_multiple_of(bs) && v1.is_multiple_of(bs) {
            return decode_pairs(m.dtype, bytes, q, s, o);
        }
        // the whole blocks, then the groups asked for
        WIDE.with(|cell| {
            let (wq, ws, wo) = &mut *cell.borrow_mut();
            let span = (b1 - b0) * bs;
            wq.resize(span / 2, 0);
            ws.resize(span / G, 0.0);
            wo.clear();
            wo.resize(span / G, 0.0);
            if !decode_pairs(m.dtype, bytes, wq, ws, wo) {
                return false;
            }
            let (skip, gl) = ((v0 - b0 * bs) / G, gs.len());
            q.copy_from_slice(&wq[skip * G / 2..][..gl * G / 2]);
            s.copy_from_slice(&ws[skip..][..gl]);
            o.copy_from_slice(&wo[skip..][..gl]);
            true
        })
    }
}
