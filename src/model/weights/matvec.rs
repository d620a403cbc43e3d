//! The decode step's products from the file's blocks ([`crate::kernels::qmatvec`]): a projection
//! keeps its parts' mapped GGUF blocks beside its packed form, and a product of one row (every
//! KV-cache step of `generate`, whatever `--memory` is) reads those instead of the panels.

use super::quant::BlockType;
use super::{Mapped, Raw};
use crate::kernels::qmatvec::{self, Blocks, Part};
use candle_core::quantized::GgmlDType;

/// The kernel's name for a GGUF type it reads.
pub(crate) fn blocks_of(dtype: BlockType) -> Option<Blocks> {
    Some(match dtype.ggml()? {
        GgmlDType::F32 => Blocks::F32,
        GgmlDType::F16 => Blocks::F16,
        GgmlDType::BF16 => Blocks::Bf16,
        GgmlDType::Q8_0 => Blocks::Q8_0,
        GgmlDType::Q5_0 => Blocks::Q5_0,
        GgmlDType::Q4_1 => Blocks::Q4_1,
        GgmlDType::Q4K => Blocks::Q4K,
        GgmlDType::Q6K => Blocks::Q6K,
        _ => return None,
    })
}

/// Whether a decode step's one-row products multiply from the file's blocks: unless
/// `ATTNSCOPE_DECODE=panels` ([`qmatvec::chosen`] has the measurements). Only a forward run as
/// one of `generate`'s steps asks ([`crate::model::forward::RunOptions::decode_step`]): a
/// one-row product elsewhere (the last layer narrowed to one logits row, a batch's variant of
/// one token) keeps the panels, so that a row computed alone and in a batch stay the same bits.
pub fn decode_from_blocks() -> bool {
    qmatvec::chosen()
}

/// Products multiplied from the file's blocks in this process.
static BLOCK_PRODUCTS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many products (a projection's or the output head's, one row each) this process has
/// multiplied from the file's blocks: what `tests/decode_path.rs` reads to see that `generate`'s
/// steps take them, whichever thread runs the step, and that nothing else does.
pub fn block_products() -> u64 {
    BLOCK_PRODUCTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// A projection's parts as mapped blocks, `[rows_i, k]` each, stacked along the output.
pub struct Decoder {
    parts: Vec<(Mapped, Blocks, usize)>,
    k: usize,
}

impl Decoder {
    /// The parts, if every one is a mapped GGUF tensor of a type the kernel reads, of whole
    /// blocks and `k` columns; `None` otherwise (the packed path runs).
    pub(super) fn of(parts: &[Raw], widths: &[usize], k: usize) -> Option<Decoder> {
        let mut out = Vec::with_capacity(parts.len());
        for (p, &rows) in parts.iter().zip(widths) {
            let Raw::Mapped(m) = p else { return None };
            let ty = blocks_of(m.dtype)?;
            let (bw, _) = ty.block();
            let whole = m.dims == [rows, k]
                && k.is_multiple_of(bw)
                && k.is_multiple_of(32)
                && m.len == rows * ty.row_bytes(k)
                && m.offset + m.len <= m.map.len();
            if !whole {
                return None;
            }
            out.push((m.clone(), ty, rows));
        }
        Some(Decoder { parts: out, k })
    }

    /// A whole mapped matrix `[rows, k]` (the output head), if the kernel reads its type.
    pub(crate) fn of_mapped(m: &Mapped) -> Option<Decoder> {
        let k = m.cols();
        let rows = m.dims.iter().product::<usize>() / k.max(1);
        Decoder::of(&[Raw::Mapped(m.clone())], &[rows], k)
    }

    /// `out (+)= W · x` for one row `x: [k]`.
    pub fn matvec(&self, x: &[f32], out: &mut [f32], accumulate: bool) {
        BLOCK_PRODUCTS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let parts: Vec<Part> = self
            .parts
            .iter()
            .map(|(m, ty, rows)| Part {
                bytes: m.bytes(),
                ty: *ty,
                rows: *rows,
            })
            .collect();
        qmatvec::matvec(&parts, &x[..self.k], out, accumulate);
    }

    /// Bytes of weights one product reads.
    pub fn bytes(&self) -> usize {
        self.parts.iter().map(|(m, _, _)| m.len).sum()
    }
}

impl super::Weights {
    /// Bytes of weights a decode step reads: each projection's blocks in the file (its f32
    /// values where it has none) and the output head's.
    pub fn decode_bytes(&self) -> u64 {
        let lin = |l: &super::Linear| l.decode.as_ref().map_or(4 * l.n * l.k, |d| d.bytes()) as u64;
        let head = match &self.lm_head {
            super::Head::Rows(m) => m.len as u64,
            super::Head::Dense(t) => 4 * t.elem_count() as u64,
            // `fast`'s head: candle's blocks, not counted
            super::Head::Quant(_) => 0,
        };
        head + self
            .layers
            .iter()
            .map(|l| lin(&l.qkv) + lin(&l.o) + lin(&l.gate_up) + lin(&l.down))
            .sum::<u64>()
    }
}

impl crate::model::Model {
    /// Bytes of weights a decode step reads ([`super::Weights::decode_bytes`]).
    pub fn decode_bytes(&self) -> u64 {
        self.weights.decode_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::super::quant::dequantize_into;
    use super::*;
    use crate::kernels::simd::{all_supported, with_level};

    /// Random blocks of `ty` (`rows × k`), their f16 scales finite and small.
    fn random_blocks(ty: Blocks, rows: usize, k: usize, seed: u64) -> Vec<u8> {
        let mut rng = crate::reference::Rng::new(seed);
        let mut b: Vec<u8> = (0..rows * ty.row_bytes(k))
            .map(|_| ((rng.uniform() as f32) * 256.0) as u8)
            .collect();
        let (bw, bb) = ty.block();
        let f16 = |v: f32| half::f16::from_f32(v).to_le_bytes();
        let bf16 = |v: f32| half::bf16::from_f32(v).to_le_bytes();
        for blk in b.chunks_exact_mut(bb) {
            let mut r = || (rng.uniform() as f32) - 0.5;
            match ty {
                Blocks::F32 => (0..bw).for_each(|i| {
                    blk[4 * i..4 * i + 4].copy_from_slice(&(r() * 3.0).to_le_bytes())
                }),
                Blocks::F16 => {
                    (0..bw).for_each(|i| blk[2 * i..2 * i + 2].copy_from_slice(&f16(r())))
                }
                Blocks::Bf16 => {
                    (0..bw).for_each(|i| blk[2 * i..2 * i + 2].copy_from_slice(&bf16(r())))
                }
                Blocks::Q6K => blk[208..210].copy_from_slice(&f16(r() * 0.01)),
                Blocks::Q4_1 | Blocks::Q4K => {
                    blk[0..2].copy_from_slice(&f16(r() * 0.02));
                    blk[2..4].copy_from_slice(&f16(r() * 0.02));
                }
                Blocks::Q8_0 | Blocks::Q5_0 => blk[0..2].copy_from_slice(&f16(r() * 0.02)),
            }
        }
        b
    }

    fn ggml(ty: Blocks) -> GgmlDType {
        match ty {
            Blocks::F32 => GgmlDType::F32,
            Blocks::F16 => GgmlDType::F16,
            Blocks::Bf16 => GgmlDType::BF16,
            Blocks::Q8_0 => GgmlDType::Q8_0,
            Blocks::Q5_0 => GgmlDType::Q5_0,
            Blocks::Q4_1 => GgmlDType::Q4_1,
            Blocks::Q4K => GgmlDType::Q4K,
            Blocks::Q6K => GgmlDType::Q6K,
        }
    }

    const ALL: [Blocks; 8] = [
        Blocks::F32,
        Blocks::F16,
        Blocks::Bf16,
        Blocks::Q8_0,
        Blocks::Q5_0,
        Blocks::Q4_1,
        Blocks::Q4K,
        Blocks::Q6K,
    ];

    /// Every block type at every vector width: the products are the bits of the file's
    /// dequantized values (the loaders' `dequantize_into`, candle's and gguf-py's) dotted in
    /// `ops::dot16`'s order, the output head's, and within f32 rounding of float64.
    #[test]
    fn every_block_type_gives_the_dequantized_products_at_every_width() {
        let (rows, k) = (67, 512);
        let mut rng = crate::reference::Rng::new(7);
        let x: Vec<f32> = (0..k).map(|_| (rng.uniform() as f32) * 2.0 - 1.0).collect();
        for (s, ty) in ALL.into_iter().enumerate() {
            let bytes = random_blocks(ty, rows, k, 100 + s as u64);
            let mut w = vec![0f32; rows * k];
            dequantize_into(ggml(ty), &bytes, &mut w).unwrap();
            let want: Vec<f32> = w
                .chunks_exact(k)
                .map(|r| crate::model::ops::dot16(&x, r))
                .collect();
            let mut worst = 0f64;
            for (r, wr) in w.chunks_exact(k).enumerate() {
                let exact: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                worst = worst.max((want[r] as f64 - exact).abs() / mag.max(1e-30));
            }
            assert!(
                worst < 1e-5,
                "{ty:?}: dot16 off float64 by {worst:e} of Σ|w·x|"
            );
            let part = [Part {
                bytes: &bytes,
                ty,
                rows,
            }];
            for level in all_supported() {
                let mut got = vec![0f32; rows];
                with_level(level, || qmatvec::rows(ty, &bytes, &x, &mut got, false));
                assert_eq!(got, want, "{ty:?} at {level:?}");
            }
            // threaded, and added into what the output held
            let mut got = vec![1.5f32; rows];
            qmatvec::matvec(&part, &x, &mut got, true);
            let plus: Vec<f32> = want.iter().map(|v| 1.5 + v).collect();
            assert_eq!(got, plus, "{ty:?} accumulated");
        }
    }

    /// A one-hot activation reads each weight back: the kernel's weights are the loaders'.
    #[test]
    fn unit_vectors_read_back_the_dequantized_weights() {
        let (rows, k) = (3, 256);
        for (s, ty) in ALL.into_iter().enumerate() {
            let bytes = random_blocks(ty, rows, k, 300 + s as u64);
            let mut w = vec![0f32; rows * k];
            dequantize_into(ggml(ty), &bytes, &mut w).unwrap();
            let mut x = vec![0f32; k];
            for c in 0..k {
                x.fill(0.0);
                x[c] = 1.0;
                let mut got = vec![0f32; rows];
                qmatvec::rows(ty, &bytes, &x, &mut got, false);
                for r in 0..rows {
                    assert_eq!(
                        got[r].to_bits() & 0x7fff_ffff,
                        w[r * k + c].to_bits() & 0x7fff_ffff,
                        "{ty:?} row {r} column {c}"
                    );
                }
            }
        }
    }
}
