//! Exact products on the AMX tiles for weights stored as small integers times a scale, which
//! is how a quantized checkpoint holds them: along k, in groups of 32, `W[j, i] = S[j, g] ·
//! Q[j, i] + O[j, g]` with `Q` an integer that bf16 holds exactly (GGUF's Q8_0, Q5_0, Q4_0:
//! `d · q`; Q4_K: `d·sc · q − dmin·m`).
//!
//! Then `C[r, j] = Σ_g S[j, g] · (Σ_{i∈g} A[r, i] · Q[j, i]) + O[j, g] · (Σ_{i∈g} A[r, i])`. The
//! inner sums run on the tiles with `A` as the exact sum of three bf16 parts (as
//! [`super`]'s bf16x3) and `Q` as one: three `tdpbf16ps` per group, every product exact in f32
//! and added in f32, against six for bf16x3 on the dequantized weights, and two bytes a weight
//! to read instead of six. Each group's 16 × 16 tiles are then scaled into f32 running sums on
//! the vector units. The result is an f32 sum of the same products as the f32 kernel's, in
//! another order (plus the rounding of each dequantized weight, below 2⁻²⁴ of it, which the
//! f32 path has and this one does not).

use super::{f32_of, split_a, Bf16Buf, Engine, A_SPLIT, KT, MB, NP, T, TILE};
use crate::kernels::SendPtr;
use rayon::prelude::*;

/// Weights per scale along k: one 32-deep tile chunk.
pub const GROUP: usize = KT;

/// Bytes of L2 the three parts of a task's rows of A may take (the rest of a 2 MiB L2 holds the
/// panel being walked and the running sums).
const A_BYTES: usize = 1280 << 10;

/// `W: [n, k]` as integers `Q` in bf16 tiles (panels of 32 columns; in a panel, for each group
/// of 32 along k, the two 16-column tiles in the pair layout of `tdpbf16ps`, as
/// [`super::PackedBf16`] with one part), then the per-group scales `S` and, where the weights
/// have them, offsets `O` (f32, `[panel][group][32 columns]`), all in one buffer (a cache file
/// maps it whole). Columns are padded with zeros to whole panels.
#[derive(Clone)]
pub struct PackedScaled {
    pub n: usize,
    pub k: usize,
    groups: usize,
    offsets: bool,
    buf: crate::kernels::gemm::Panels<u16>,
}

impl std::fmt::Debug for PackedScaled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedScaled {{ n: {}, k: {}, offsets: {} }}",
            self.n, self.k, self.offsets
        )
    }
}

/// `(bf16 values of Q, f32 values of S)` of a `[k, n]` matrix (k whole groups).
fn region_lens(n: usize, k: usize) -> (usize, usize) {
    let (panels, groups) = (n.div_ceil(NP), k / GROUP);
    (panels * groups * 2 * TILE, panels * groups * NP)
}

impl PackedScaled {
    /// Packs `W: [n, k]` (k a multiple of [`GROUP`]) from `row(j, q, s, o)`, which writes row
    /// `j`'s integers `q[k]` (as f32), scales `s[k / 32]` and, with `offsets`, offsets
    /// `o[k / 32]`, and says whether the row has that form. `None` if a row has not, or one
    /// of its `q` is not exact in bf16 (an integer of more than 8 significant bits, a
    /// fraction): such a matrix stays on the f32 kernels.
    pub fn from_row_source(
        n: usize,
        k: usize,
        offsets: bool,
        row: impl Fn(usize, &mut [f32], &mut [f32], &mut [f32]) -> bool + Sync,
    ) -> Option<PackedScaled> {
        if !k.is_multiple_of(GROUP) || k == 0 || n == 0 {
            return None;
        }
        let groups = k / GROUP;
        let panels = n.div_ceil(NP);
        let (q_len, s_len) = region_lens(n, k);
        let mut buf = Bf16Buf::zeros(Self::packed_len(n, k, offsets));
        let (qb, rest) = buf.as_mut_slice().split_at_mut(q_len);
        // the rest of the buffer starts 64-byte aligned (q_len is whole KiB tiles) and holds
        // 2·s_len (or 4·s_len) u16: the room of s_len (2·s_len) f32
        let so: &mut [f32] = bytemuck::cast_slice_mut(rest);
        let (sb, ob) = so.split_at_mut(s_len);
        let (panel_q, panel_s) = (groups * 2 * TILE, groups * NP);
        let mut o_chunks: Vec<Option<&mut [f32]>> = if offsets {
            ob.chunks_mut(panel_s).map(Some).collect()
        } else {
            (0..panels).map(|_| None).collect()
        };
        let ok = qb
            .par_chunks_mut(panel_q)
            .zip(sb.par_chunks_mut(panel_s))
            .zip(o_chunks.par_iter_mut())
            .enumerate()
            .all(|(p, ((qp, sp), op))| {
                let (mut qr, mut sr, mut or) =
                    (vec![0f32; k], vec![0f32; groups], vec![0f32; groups]);
                for jj in 0..NP.min(n - p * NP) {
                    or.fill(0.0);
                    if !row(p * NP + jj, &mut qr, &mut sr, &mut or) {
                        return false;
                    }
                    let (half, col) = (jj / T, jj % T);
                    // a value bf16 holds exactly is its f32 bits' upper half (the lower half
                    // zero); one check for the row. Weight i of group g goes to row (i % 32) / 2
                    // of the group's tile `half`, the pair (2r, 2r + 1) side by side
                    let mut low_bits = 0u32;
                    for (g, qg) in qr.chunks_exact(KT).enumerate() {
                        let dst = &mut qp[(g * 2 + half) * TILE + col * 2..][..TILE - col * 2];
                        for (r, pair) in qg.chunks_exact(2).enumerate() {
                            let (b0, b1) = (pair[0].to_bits(), pair[1].to_bits());
                            low_bits |= (b0 | b1) & 0xffff;
                            dst[r * 2 * T] = (b0 >> 16) as u16;
                            dst[r * 2 * T + 1] = (b1 >> 16) as u16;
                        }
                    }
                    if low_bits != 0 || qr.iter().any(|x| !x.is_finite()) {
                        return false;
                    }
                    for g in 0..groups {
                        sp[g * NP + jj] = sr[g];
                        if let Some(op) = op.as_deref_mut() {
                            op[g * NP + jj] = or[g];
                        }
                    }
                }
                true
            });
        drop(o_chunks);
        ok.then_some(PackedScaled {
            n,
            k,
            groups,
            offsets,
            buf: crate::kernels::gemm::Panels::Owned(buf),
        })
    }

    /// u16 values the packed form of a `[k, n]` matrix takes (k whole groups).
    pub fn packed_len(n: usize, k: usize, offsets: bool) -> usize {
        let (q_len, s_len) = region_lens(n, k);
        q_len + 2 * s_len * if offsets { 2 } else { 1 }
    }

    /// A `[k, n]` matrix whose packed form (as [`PackedScaled::as_bytes`] gave it) lies at
    /// `offset` in `map`; `None` if it does not fit there (64-byte aligned) or k is not whole
    /// groups.
    pub fn from_mapped(
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        n: usize,
        k: usize,
        offsets: bool,
    ) -> Option<PackedScaled> {
        if !k.is_multiple_of(GROUP) || k == 0 || n == 0 {
            return None;
        }
        let buf =
            crate::kernels::gemm::Panels::mapped(map, offset, Self::packed_len(n, k, offsets))?;
        Some(PackedScaled {
            n,
            k,
            groups: k / GROUP,
            offsets,
            buf,
        })
    }

    /// The packed form as bytes (native-endian), as a cache file stores it.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.as_bytes()
    }

    /// Whether the packed form is read from a mapped file.
    pub fn is_mapped(&self) -> bool {
        self.buf.is_mapped()
    }

    /// Bytes held (integers, scales and offsets).
    pub fn bytes(&self) -> usize {
        self.buf.as_slice().len() * 2
    }

    /// Whether the weights have per-group offsets (Q4_K, Q4_1) besides their scales.
    pub fn has_offsets(&self) -> bool {
        self.offsets
    }

    fn q(&self) -> &[u16] {
        &self.buf.as_slice()[..region_lens(self.n, self.k).0]
    }

    /// The scales, then the offsets (if any).
    fn scales_and_offsets(&self) -> (&[f32], Option<&[f32]>) {
        let (q_len, s_len) = region_lens(self.n, self.k);
        let rest = &self.buf.as_slice()[q_len..];
        // as in `from_row_source`: 64-byte aligned, 2 u16 per f32
        let so: &[f32] = bytemuck::cast_slice(rest);
        let (s, o) = so.split_at(s_len);
        (s, self.offsets.then(|| &o[..s_len]))
    }

    /// The whole matrix `W: [n, k]` row-major, each weight `S · Q + O` in f32 as
    /// [`PackedScaled::weight`] gives it, a panel of 32 rows per task (what the backward packs
    /// transposed, without a product through the tiles).
    pub fn dense(&self) -> Vec<f32> {
        let (n, k, groups) = (self.n, self.k, self.groups);
        let mut w = vec![0f32; n * k];
        let q = self.q();
        let (s, o) = self.scales_and_offsets();
        w.par_chunks_mut(NP * k).enumerate().for_each(|(p, rows)| {
            for g in 0..groups {
                let qg = &q[(p * groups + g) * 2 * TILE..][..2 * TILE];
                let at = (p * groups + g) * NP;
                for (jj, row) in rows.chunks_mut(k).enumerate() {
                    let (half, col) = (jj / T, jj % T);
                    let (sj, oj) = (s[at + jj], o.map_or(0.0, |o| o[at + jj]));
                    let out = &mut row[g * GROUP..(g + 1) * GROUP];
                    for (ii, v) in out.iter_mut().enumerate() {
                        let (r, e) = (ii / 2, ii % 2);
                        let qv = f32_of(qg[half * TILE + r * 2 * T + col * 2 + e]);
                        *v = qv * sj + oj;
                    }
                }
            }
        });
        w
    }

    /// Weight `(j, i)` as `S · Q + O` in f32 (for tests).
    pub fn weight(&self, j: usize, i: usize) -> f32 {
        let (p, jj, g) = (j / NP, j % NP, i / GROUP);
        let (half, col, r, e) = (jj / T, jj % T, (i % KT) / 2, i % 2);
        let q = f32_of(
            self.q()[(p * self.groups + g) * 2 * TILE + half * TILE + r * 2 * T + col * 2 + e],
        );
        let at = (p * self.groups + g) * NP + jj;
        let (s, o) = self.scales_and_offsets();
        q * s[at] + o.map_or(0.0, |o| o[at])
    }
}

/// `C[m, n] (+)= A[m, k] · Wᵀ` with `A` row-major (row stride `lda`), `C` row-major (stride
/// `ldc`), on the tiles, on every thread of rayon's pool. Panics if the CPU has no AMX.
pub fn gemm(
    a: &[f32],
    lda: usize,
    m: usize,
    w: &PackedScaled,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    gemm_with(Engine::Tiles, a, lda, m, w, c, ldc, accumulate)
}

/// [`gemm`] on a chosen engine.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    engine: Engine,
    a: &[f32],
    lda: usize,
    m: usize,
    w: &PackedScaled,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    gemm_groups_with(engine, a, lda, m, w, 0..w.groups, c, ldc, accumulate)
}

/// `C[m, n] (+)= A[m, 32·gs.len()] · W[:, 32·gs]ᵀ`: the product with the weights' input
/// columns of the groups `gs` alone (`A`'s columns are those), the others taken as zero and
/// never read. The same bits as [`gemm`] on rows that are zero outside those columns (a zero
/// group adds `S·0 + O·0`, which changes no sum). Panics if the engine does not run here
/// (the tiles without AMX), or `gs` is not inside the matrix's groups.
#[allow(clippy::too_many_arguments)]
pub fn gemm_groups_with(
    engine: Engine,
    a: &[f32],
    lda: usize,
    m: usize,
    w: &PackedScaled,
    gs: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    assert!(
        gs.start <= gs.end && gs.end <= w.groups,
        "groups {gs:?} outside the matrix's {}",
        w.groups
    );
    // the groups taken, the first of them, and the matrix's own count (the packed strides)
    let (groups, g0, all) = (gs.len(), gs.start, w.groups);
    let (k, n) = (groups * GROUP, w.n);
    if m == 0 || n == 0 {
        return;
    }
    super::check_args(engine, (a, lda), (c, ldc), (m, k, n));
    if groups == 0 {
        // no input column: the product is zero
        if !accumulate {
            c.chunks_mut(ldc).take(m).for_each(|row| row[..n].fill(0.0));
        }
        return;
    }
    let blocks = m.div_ceil(MB);
    // Σ of each row of A over each group, for the offsets (padded rows 0)
    let (ws, wo) = w.scales_and_offsets();
    let wq = w.q();
    let asum: Vec<f32> = if wo.is_some() {
        let mut v = vec![0f32; blocks * MB * groups];
        v.par_chunks_mut(groups)
            .take(m)
            .enumerate()
            .for_each(|(r, out)| {
                for (g, x) in out.iter_mut().enumerate() {
                    let xs = &a[r * lda + g * GROUP..r * lda + (g + 1) * GROUP];
                    *x = xs.iter().map(|&v| v as f64).sum::<f64>() as f32;
                }
            });
        v
    } else {
        Vec::new()
    };
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    let split_stride = groups * 2 * TILE;
    let block_len = 3 * split_stride;
    A_SPLIT.with(|cell| {
        let mut abuf = cell.borrow_mut();
        split_a(&mut abuf, a, lda, m, k, 3);
        let planes = abuf.as_slice();
        let panels = n.div_ceil(NP);
        let threads = rayon::current_num_threads();
        // tasks: row groups whose three parts stay in L2 while the task walks its panels, ×
        // runs of panels, at least four tasks a thread where the shape allows
        let per_group = (A_BYTES / (2 * block_len)).clamp(1, 8);
        let row_groups = blocks.div_ceil(per_group);
        let mut runs = 1;
        while row_groups * runs < 4 * threads && runs < panels {
            runs += 1;
        }
        // a count of tasks the threads share evenly, where one is near (gate|up at 576 rows:
        // 3 row groups × 3 runs left one thread a task more than the other)
        if threads > 1 {
            if let Some(r) =
                (runs..=(2 * runs).min(panels)).find(|&r| (row_groups * r).is_multiple_of(threads))
            {
                runs = r;
            }
        }
        let group = blocks.div_ceil(row_groups);
        let run = panels.div_ceil(runs);
        let cp = SendPtr(c.as_mut_ptr());
        let task = |t: usize| {
            let cp = &cp; // the whole SendPtr, not its raw field
            let (gi, r) = (t / runs, t % runs);
            let (b0, b1) = (gi * group, ((gi + 1) * group).min(blocks));
            let (q0, q1) = (r * run, ((r + 1) * run).min(panels));
            #[cfg(target_arch = "x86_64")]
            if engine == Engine::Tiles {
                // SAFETY: AMX is available (asserted above)
                unsafe { super::tiles::configure() };
            }
            let mut acc = Block([0f32; MB * NP]);
            let mut tmp = [Block([0f32; MB * NP]), Block([0f32; MB * NP])];
            for p in q0..q1 {
                let col0 = p * NP;
                let cols = NP.min(n - col0);
                for b in b0..b1 {
                    let row0 = b * MB;
                    let rows = MB.min(m - row0);
                    // without `accumulate` the first group's scaling starts the sums from zero
                    // (no fill: a memset of 4 KiB per block was 1% of a forward)
                    if accumulate && rows < MB {
                        acc.0.fill(0.0);
                    }
                    if accumulate {
                        for r in 0..rows {
                            // SAFETY: the task owns rows b0·32..b1·32 × panels q0..q1 of C;
                            // sizes checked above
                            let src = unsafe { cp.0.add((row0 + r) * ldc + col0) };
                            let row = &mut acc.0[r * NP..(r + 1) * NP];
                            if cols == NP {
                                // fixed length: vector moves, not a call of memcpy
                                // SAFETY: NP values of the task's own row of C (cols == NP)
                                let v = unsafe { (src as *const [f32; NP]).read_unaligned() };
                                row.copy_from_slice(&v);
                            } else {
                                for (j, x) in row[..cols].iter_mut().enumerate() {
                                    // SAFETY: j < cols, inside the task's own row of C
                                    *x = unsafe { *src.add(j) };
                                }
                            }
                        }
                    }
                    let a0 = planes[b * block_len..].as_ptr();
                    // two groups on the tiles, then both scaled into the sums in one pass (the
                    // sums stay in registers between them: half the loads and stores of the
                    // running sums, the same operations in the same order)
                    let mut g = 0;
                    while g < groups {
                        let pair = (groups - g).min(2);
                        for (h, t) in tmp.iter_mut().take(pair).enumerate() {
                            // g + h counts the groups taken (A's); the weights' own is g0 + g + h
                            let wg = p * all + g0 + g + h;
                            let at = wg * 2 * TILE;
                            let qt = wq[at..at + 2 * TILE].as_ptr();
                            let a_g = a0.wrapping_add((g + h) * 2 * TILE);
                            match engine {
                                #[cfg(target_arch = "x86_64")]
                                // SAFETY: the pointers name whole tiles of the packed buffers, and
                                // `Engine::Tiles` is chosen only where the tiles are configured
                                Engine::Tiles => unsafe {
                                    super::tiles::scaled_group(
                                        a_g,
                                        split_stride,
                                        qt,
                                        t.0.as_mut_ptr(),
                                    )
                                },
                                // SAFETY: the pointers name whole tiles of the packed buffers
                                _ => unsafe { emulated_group(a_g, split_stride, qt, &mut t.0) },
                            }
                        }
                        let first = g == 0 && !accumulate;
                        let wg = p * all + g0 + g;
                        let at = row0 * groups + g;
                        if pair == 2 {
                            let gs = [
                                Scaled::of(&tmp[0].0, ws, wo, &asum, wg, at, groups),
                                Scaled::of(&tmp[1].0, ws, wo, &asum, wg + 1, at + 1, groups),
                            ];
                            post(&mut acc.0, &gs, first, wide);
                        } else {
                            let gs = [Scaled::of(&tmp[0].0, ws, wo, &asum, wg, at, groups)];
                            post(&mut acc.0, &gs, first, wide);
                        }
                        g += pair;
                    }
                    for r in 0..rows {
                        let row = &acc.0[r * NP..(r + 1) * NP];
                        // SAFETY: as above
                        unsafe {
                            let dst = cp.0.add((row0 + r) * ldc + col0);
                            if cols == NP {
                                // a whole row of the block: two vector stores, not a call
                                (dst as *mut [f32; NP])
                                    .write_unaligned(row.try_into().expect("a row of the block"));
                            } else {
                                std::ptr::copy_nonoverlapping(row.as_ptr(), dst, cols);
                            }
                        }
                    }
                }
            }
            #[cfg(target_arch = "x86_64")]
            if engine == Engine::Tiles {
                // SAFETY: configured above on this thread
                unsafe { super::tiles::release() };
            }
        };
        let tasks = row_groups * runs;
        if tasks > 1 && 2.0 * (m * n * k) as f64 > 4e6 {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    });
}

/// A 32 × 32 f32 block on a cache line.
#[repr(C, align(64))]
struct Block([f32; MB * NP]);

/// One group's four tiles (as [`super::tiles::scaled_group`] stores them), its columns' scales
/// and, where the weights have them, its offsets with each row's sum of A over the group
/// (`asum[r · stride]`).
struct Scaled<'a> {
    tmp: &'a [f32; MB * NP],
    s: &'a [f32],
    o: Option<(&'a [f32], &'a [f32], usize)>,
}

impl<'a> Scaled<'a> {
    /// Group `wg` of the packed weights (its scales `ws[wg·32..]`, offsets likewise), whose
    /// rows' sums of A start at `asum[at]`, `stride` apart.
    #[inline(always)]
    fn of(
        tmp: &'a [f32; MB * NP],
        ws: &'a [f32],
        wo: Option<&'a [f32]>,
        asum: &'a [f32],
        wg: usize,
        at: usize,
        stride: usize,
    ) -> Self {
        Scaled {
            tmp,
            s: &ws[wg * NP..][..NP],
            o: wo.map(|o| (&o[wg * NP..][..NP], &asum[at..], stride)),
        }
    }
}

/// `acc[32, 32] += S ⊙ tmp (+ O ⊙ Σa)` for each group of `gs` in turn: per element the same
/// chain of fused multiply-adds as one group at a time, with the sums kept in registers between
/// the groups. `init`: the sums start here from zero (`acc` is not read). `wide`: the CPU has
/// AVX-512 (asked once per product, not per group).
#[inline]
fn post(acc: &mut [f32; MB * NP], gs: &[Scaled], init: bool, wide: bool) {
    #[cfg(target_arch = "x86_64")]
    if wide {
        // SAFETY: the CPU has AVX-512; every slice is as long as the loads read
        unsafe {
            match gs {
                [a] => post_avx512::<1>(acc, [a], init),
                [a, b] => post_avx512::<2>(acc, [a, b], init),
                _ => unreachable!("one or two groups at a time"),
            }
        }
        return;
    }
    for (i, g) in gs.iter().enumerate() {
        let init = init && i == 0;
        for r in 0..MB {
            let t = (r / T) * 2;
            let rr = r % T;
            let sa = g.o.map(|(_, asum, stride)| asum[r * stride]);
            for j in 0..NP {
                let x = g.tmp[(t + j / T) * T * T + rr * T + j % T];
                let prev = if init { 0.0 } else { acc[r * NP + j] };
                let mut v = g.s[j].mul_add(x, prev);
                if let (Some((o, _, _)), Some(sa)) = (g.o, sa) {
                    v = o[j].mul_add(sa, v);
                }
                acc[r * NP + j] = v;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn post_avx512<const N: usize>(acc: &mut [f32; MB * NP], gs: [&Scaled; N], init: bool) {
    // SAFETY: reached only through the CPU-feature dispatch (`simd::current`, `Isa::detect`), so
    // the CPU has this function's features; the pointers and lengths are the caller's, valid for
    // what the doc comment names.
    unsafe {
        use std::arch::x86_64::*;
        let zero = _mm512_setzero_ps();
        let ld = |x: &[f32]| {
            (
                _mm512_loadu_ps(x.as_ptr()),
                _mm512_loadu_ps(x.as_ptr().add(T)),
            )
        };
        let s = gs.map(|g| ld(g.s));
        let o = gs.map(|g| g.o.map(|(o, _, _)| ld(o)).unwrap_or((zero, zero)));
        let ap = acc.as_mut_ptr();
        for r in 0..MB {
            let t = (r / T) * 2 * T * T + (r % T) * T;
            let c = ap.add(r * NP);
            // the running sums of row r, or zeros to start them (the same bits as a zeroed block)
            let (mut v0, mut v1) = if init {
                (zero, zero)
            } else {
                (_mm512_loadu_ps(c), _mm512_loadu_ps(c.add(T)))
            };
            for i in 0..N {
                let tp = gs[i].tmp.as_ptr();
                v0 = _mm512_fmadd_ps(s[i].0, _mm512_loadu_ps(tp.add(t)), v0);
                v1 = _mm512_fmadd_ps(s[i].1, _mm512_loadu_ps(tp.add(t + T * T)), v1);
                if let Some((_, asum, stride)) = gs[i].o {
                    let sa = _mm512_set1_ps(asum[r * stride]);
                    v0 = _mm512_fmadd_ps(o[i].0, sa, v0);
                    v1 = _mm512_fmadd_ps(o[i].1, sa, v1);
                }
            }
            _mm512_storeu_ps(c, v0);
            _mm512_storeu_ps(c.add(T), v1);
        }
    }
}

/// Plain-Rust [`super::tiles::scaled_group`] on the same packed data (tests on a CPU without
/// AMX).
///
/// # Safety
/// As [`super::tiles::scaled_group`].
unsafe fn emulated_group(
    a: *const u16,
    split_stride: usize,
    q: *const u16,
    tmp: &mut [f32; MB * NP],
) {
    // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
    // the rows and tiles it names, the CPU has the kernel's features); the body only
    // reads and writes within them.
    unsafe {
        tmp.fill(0.0);
        for t in 0..4 {
            let (rt, ct) = (t / 2, t % 2);
            for part in (0..3).rev() {
                let at = a.add(part * split_stride + rt * TILE);
                super::emulated_tdp(
                    &mut tmp[t * T * T..(t + 1) * T * T],
                    T,
                    at,
                    q.add(ct * TILE),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A matrix of the form `d·q + o` per group of 32 (q in −16..15 as Q5_0, scales near 0.01
    /// rounded to f16's precision), its f32 weights as a dequantizer computes them, and the
    /// packed form.
    fn matrix(n: usize, k: usize, offsets: bool, seed: u64) -> (Vec<f32>, PackedScaled) {
        let mut rng = crate::reference::Rng::new(seed);
        let groups = k / GROUP;
        let f16ish = |x: f32| f32::from_bits(x.to_bits() & 0xffff_e000);
        let s: Vec<f32> = rng
            .normals(n * groups, 0.01)
            .into_iter()
            .map(f16ish)
            .collect();
        let o: Vec<f32> = rng
            .normals(n * groups, 0.02)
            .into_iter()
            .map(f16ish)
            .collect();
        let q: Vec<f32> = rng
            .normals(n * k, 6.0)
            .into_iter()
            .map(|x| x.round().clamp(-16.0, 15.0))
            .collect();
        let w: Vec<f32> = (0..n * k)
            .map(|x| {
                let (j, i) = (x / k, x % k);
                let g = j * groups + i / GROUP;
                q[x] * s[g] + if offsets { o[g] } else { 0.0 }
            })
            .collect();
        let packed = PackedScaled::from_row_source(n, k, offsets, |j, qr, sr, or| {
            qr.copy_from_slice(&q[j * k..(j + 1) * k]);
            sr.copy_from_slice(&s[j * groups..(j + 1) * groups]);
            if offsets {
                or.copy_from_slice(&o[j * groups..(j + 1) * groups]);
            }
            true
        })
        .expect("integers of 5 bits are exact in bf16");
        (w, packed)
    }

    #[test]
    fn dense_gives_every_weight_as_the_dequantizer_computes_it() {
        for (n, k, offsets) in [(45, 64, false), (33, 96, true), (32, 32, false)] {
            let (w, packed) = matrix(n, k, offsets, 11 + n as u64);
            let dense = packed.dense();
            assert_eq!(dense.len(), n * k);
            for (x, (a, b)) in dense.iter().zip(&w).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{n}x{k} offsets {offsets} at {x}");
                assert_eq!(a.to_bits(), packed.weight(x / k, x % k).to_bits());
            }
        }
    }

    #[test]
    fn the_vector_scaling_gives_the_plain_loops_bits_one_or_two_groups_at_a_time() {
        // post() on AVX-512 keeps the sums in registers across a pair of groups; the plain loop
        // goes group by group through memory: the same chain of fused multiply-adds, so the
        // same bits, with and without offsets, starting from zero or from the sums
        #[cfg(target_arch = "x86_64")]
        let wide = std::arch::is_x86_feature_detected!("avx512f");
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        if !wide {
            eprintln!("no AVX-512 here: only the plain loop runs (checked against the formula)");
        }
        let mut rng = crate::reference::Rng::new(5);
        let mut block = || {
            let v = rng.normals(MB * NP, 1.0);
            Block(v.try_into().expect("a block"))
        };
        let tmp = [block(), block()];
        let start = block();
        let ws = block().0[..2 * NP].to_vec();
        let wo = block().0[..2 * NP].to_vec();
        let asum = block().0.to_vec();
        for offsets in [false, true] {
            for init in [false, true] {
                for pair in [1, 2] {
                    let o = offsets.then_some(&wo[..]);
                    let gs: Vec<Scaled> = (0..pair)
                        .map(|h| Scaled::of(&tmp[h].0, &ws, o, &asum, h, h, 2))
                        .collect();
                    let mut plain = Block(start.0);
                    post(&mut plain.0, &gs, init, false);
                    // the plain loop against the formula, element by element
                    for r in 0..MB {
                        for j in 0..NP {
                            let mut want = if init { 0.0 } else { start.0[r * NP + j] };
                            for (h, t) in tmp.iter().enumerate().take(pair) {
                                let x = t.0[(r / T * 2 + j / T) * T * T + (r % T) * T + j % T];
                                want = ws[h * NP + j].mul_add(x, want);
                                if offsets {
                                    want = wo[h * NP + j].mul_add(asum[h + r * 2], want);
                                }
                            }
                            assert_eq!(plain.0[r * NP + j].to_bits(), want.to_bits(), "({r},{j})");
                        }
                    }
                    if wide {
                        let mut vector = Block(start.0);
                        post(&mut vector.0, &gs, init, true);
                        for (k, (x, y)) in vector.0.iter().zip(&plain.0).enumerate() {
                            assert_eq!(
                                x.to_bits(),
                                y.to_bits(),
                                "offsets {offsets} init {init} groups {pair} at {k}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn scaled_products_match_a_naive_product_on_awkward_shapes() {
        let engines = if super::super::available() {
            vec![Engine::Emulated, Engine::Tiles]
        } else {
            eprintln!("AMX tiles not available here: checking the emulation of tdpbf16ps only");
            vec![Engine::Emulated]
        };
        for (i, &(m, k, n)) in [
            (1, 32, 1),
            (5, 64, 17),
            (32, 32, 32),
            (33, 96, 31),
            (70, 128, 65),
            (300, 320, 40),
            (64, 1024, 96),
        ]
        .iter()
        .enumerate()
        {
            for offsets in [false, true] {
                let (w, packed) = matrix(n, k, offsets, i as u64 * 11 + offsets as u64);
                for (x, &want) in w.iter().enumerate() {
                    assert_eq!(packed.weight(x / k, x % k), want, "weight {x}");
                }
                let mut rng = crate::reference::Rng::new(i as u64 + 100);
                let a = rng.normals(m * k, 1.0);
                let ldc = n + 3;
                for &engine in &engines {
                    for accumulate in [false, true] {
                        let base = if accumulate { 1.5f32 } else { f32::NAN };
                        let mut c = vec![base; m * ldc];
                        gemm_with(engine, &a, k, m, &packed, &mut c, ldc, accumulate);
                        for r in 0..m {
                            for j in 0..n {
                                let (mut want, mut mass) = (0f64, 0f64);
                                for p in 0..k {
                                    let (x, y) = (a[r * k + p] as f64, w[j * k + p] as f64);
                                    want += x * y;
                                    mass += (x * y).abs();
                                }
                                let want = want + if accumulate { 1.5 } else { 0.0 };
                                let got = c[r * ldc + j] as f64;
                                // an f32 sum of 3k exact products and k/32 scalings, plus the
                                // rounding of each dequantized weight
                                let tol = (4 * k + 8) as f64 * 2f64.powi(-24) * (mass + 1.5);
                                assert!(
                                    (got - want).abs() <= tol,
                                    "{engine:?} m={m} k={k} n={n} offsets={offsets} acc={accumulate} at ({r},{j}): {got} vs {want}"
                                );
                            }
                            for j in n..ldc {
                                assert!(
                                    c[r * ldc + j].to_bits() == base.to_bits(),
                                    "{engine:?} wrote past column n at ({r},{j})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_range_of_groups_gives_the_bits_of_the_whole_product_with_zeros_elsewhere() {
        let engines = if super::super::available() {
            vec![Engine::Emulated, Engine::Tiles]
        } else {
            eprintln!("AMX tiles not available here: checking the emulation of tdpbf16ps only");
            vec![Engine::Emulated]
        };
        let (m, k, n) = (45, 256, 70);
        let groups = k / GROUP;
        for offsets in [false, true] {
            let (_, packed) = matrix(n, k, offsets, 7 + offsets as u64);
            let mut rng = crate::reference::Rng::new(31);
            let a = rng.normals(m * k, 1.0);
            for gs in [0..groups, 0..1, 2..4, 7..8, 3..3] {
                let (c0, c1) = (gs.start * GROUP, gs.end * GROUP);
                // A's columns of those groups alone, and the whole-width rows with zeros elsewhere
                let part: Vec<f32> = (0..m)
                    .flat_map(|r| a[r * k + c0..r * k + c1].to_vec())
                    .collect();
                let mut padded = vec![0f32; m * k];
                for r in 0..m {
                    padded[r * k + c0..r * k + c1].copy_from_slice(&a[r * k + c0..r * k + c1]);
                }
                for &engine in &engines {
                    let mut want = vec![0f32; m * n];
                    gemm_with(engine, &padded, k, m, &packed, &mut want, n, false);
                    let mut got = vec![f32::NAN; m * n];
                    let lda = c1 - c0;
                    gemm_groups_with(
                        engine,
                        &part,
                        lda,
                        m,
                        &packed,
                        gs.clone(),
                        &mut got,
                        n,
                        false,
                    );
                    assert!(
                        got.iter()
                            .zip(&want)
                            .all(|(x, y)| x.to_bits() == y.to_bits()),
                        "{engine:?} offsets={offsets} groups {gs:?}"
                    );
                    if gs.is_empty() {
                        assert!(want.iter().all(|&x| x == 0.0), "zero rows give zeros");
                    }
                }
            }
        }
    }

    #[test]
    fn weights_that_are_not_small_integers_are_refused() {
        let k = 64;
        let take = |bad: f32| {
            PackedScaled::from_row_source(3, k, false, |j, q, s, _| {
                q.fill(3.0);
                s.fill(0.5);
                if j == 2 {
                    q[40] = bad;
                }
                true
            })
        };
        assert!(take(-7.0).is_some(), "small integers are taken");
        assert!(
            take(257.0).is_none(),
            "257 has 9 significant bits: not exact in bf16"
        );
        assert!(take(0.3).is_none(), "0.3 is not exact in bf16");
        assert!(
            PackedScaled::from_row_source(2, 40, false, |_, _, _, _| true).is_none(),
            "k must be whole groups"
        );
        assert!(
            PackedScaled::from_row_source(2, 32, false, |j, _, _, _| j == 0).is_none(),
            "a row the source cannot write so refuses the matrix"
        );
    }
}
