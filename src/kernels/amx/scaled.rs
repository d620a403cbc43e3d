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

/// One row's integers (as bf16 pairs: 16 a group, weight 2r in the low half of pair r),
/// scales and offsets, and (for a source of f32 rows) the row as f32, reused from row to row.
#[derive(Default)]
struct RowBuf {
    q: Vec<u32>,
    s: Vec<f32>,
    o: Vec<f32>,
    f: Vec<f32>,
}

impl RowBuf {
    /// Room for `groups` groups: `(q, s, o)`, the offsets zeroed (a source without them writes
    /// none).
    fn get(&mut self, groups: usize) -> (&mut [u32], &mut [f32], &mut [f32]) {
        self.q.resize(groups * GROUP / 2, 0);
        self.s.resize(groups, 0.0);
        self.o.clear();
        self.o.resize(groups, 0.0);
        (&mut self.q, &mut self.s, &mut self.o)
    }
}

/// `q`'s f32 integers as bf16 pairs into `pairs` (weight 2r in the low half of pair r); `false`
/// if one is not exact in bf16 (its f32 bits' lower half not zero) or not finite (every
/// exponent bit set).
fn to_pairs(q: &[f32], pairs: &mut [u32]) -> bool {
    let (mut low_bits, mut exp_all) = (0u32, false);
    for (d, pair) in pairs.iter_mut().zip(q.chunks_exact(2)) {
        let (b0, b1) = (pair[0].to_bits(), pair[1].to_bits());
        low_bits |= (b0 | b1) & 0xffff;
        exp_all |= (b0 & 0x7f80_0000) == 0x7f80_0000 || (b1 & 0x7f80_0000) == 0x7f80_0000;
        *d = (b0 >> 16) | (b1 & 0xffff_0000);
    }
    low_bits == 0 && !exp_all
}

/// Writes column `jj` of a panel (`qp`: its groups' tiles as bf16 pairs, `sp`/`op`: its scales
/// and offsets, `[group][32 columns]`) from one row's pairs (16 a group), scales `sr` and
/// offsets `or` of the same groups. Pair r of group g goes to row r of the group's tile
/// `jj / 16`, column `jj % 16`.
fn put_row(
    qp: &mut [u32],
    sp: &mut [f32],
    op: Option<&mut [f32]>,
    jj: usize,
    pairs: &[u32],
    sr: &[f32],
    or: &[f32],
) {
    let (half, col) = (jj / T, jj % T);
    for (g, pg) in pairs.chunks_exact(KT / 2).enumerate() {
        let dst = &mut qp[(g * 2 + half) * TILE / 2 + col..][..TILE / 2 - col];
        for (r, &x) in pg.iter().enumerate() {
            dst[r * T] = x;
        }
    }
    for (g, &s) in sr.iter().enumerate() {
        sp[g * NP + jj] = s;
    }
    if let Some(op) = op {
        for (g, &o) in or.iter().enumerate() {
            op[g * NP + jj] = o;
        }
    }
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
                // whole tiles of a 64-byte aligned buffer: u32 pairs
                let qp: &mut [u32] = bytemuck::cast_slice_mut(qp);
                let mut rows = RowBuf::default();
                (0..NP.min(n - p * NP)).all(|jj| {
                    let mut f = std::mem::take(&mut rows.f);
                    f.resize(k, 0.0);
                    let (pairs, sr, or) = rows.get(groups);
                    let ok = row(p * NP + jj, &mut f, sr, or) && to_pairs(&f, pairs);
                    if ok {
                        put_row(qp, sp, op.as_deref_mut(), jj, pairs, sr, or);
                    }
                    rows.f = f;
                    ok
                })
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
    product(
        engine,
        (a, lda, m),
        Weights::Packed(w),
        gs,
        (c, ldc),
        accumulate,
    )
}

/// A matrix `W: [n, 32·groups]` of integers and scales that is not held packed (`--memory
/// low`: a quantized file's blocks, mapped): [`gemm_decoded`] asks for its rows a depth slice
/// at a time and puts them in the tiles' layout, a few panels at a time, just before they are
/// multiplied.
pub trait RowSource: Sync {
    /// `(n, groups, offsets)`: the rows, the groups of 32 along k, and whether the weights have
    /// per-group offsets besides their scales.
    fn layout(&self) -> (usize, usize, bool);

    /// Writes row `j`'s integers of the groups `gs` into `q[16·gs.len()]` as bf16 pairs (pair r
    /// of a group: weight 2r in the low half, 2r + 1 in the high), their scales into
    /// `s[gs.len()]` and, with offsets, their offsets into `o[gs.len()]`; `false` if the row has
    /// not that form. Every integer must be exact in bf16 and finite: the source checks that
    /// once, before its first product (a row that is not panics).
    fn row(
        &self,
        j: usize,
        gs: std::ops::Range<usize>,
        q: &mut [u32],
        s: &mut [f32],
        o: &mut [f32],
    ) -> bool;
}

/// [`gemm_groups_with`] for weights decoded as they are multiplied: the same bits as on the
/// packed matrix the same rows make ([`PackedScaled::from_row_source`]). Each worker thread
/// decodes a run of panels (a depth slice of them, a buffer of about [`DECODE_BYTES`]) and
/// walks every block of rows over it, so each weight is decoded once per product, and the two
/// cores decode and multiply side by side.
#[allow(clippy::too_many_arguments)]
pub fn gemm_decoded(
    engine: Engine,
    a: &[f32],
    lda: usize,
    m: usize,
    w: &dyn RowSource,
    gs: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    product(
        engine,
        (a, lda, m),
        Weights::Decoded(w),
        gs,
        (c, ldc),
        accumulate,
    )
}

/// Bytes of a worker's decoded panels (the rest of a 2 MiB L2 holds a block of A's rows).
pub const DECODE_BYTES: usize = 1 << 20;

/// Groups in a depth slice of decoded panels: A's three parts of a block of rows over a slice
/// take 6 KiB a group.
const SLICE_GROUPS: usize = 32;

/// Where a product's weights come from.
enum Weights<'a> {
    Packed(&'a PackedScaled),
    Decoded(&'a dyn RowSource),
}

impl Weights<'_> {
    fn layout(&self) -> (usize, usize, bool) {
        match self {
            Weights::Packed(w) => (w.n, w.groups, w.offsets),
            Weights::Decoded(w) => w.layout(),
        }
    }
}

/// A panel's tiles, scales and offsets for a run of groups, from its first.
struct PanelView<'a> {
    q: &'a [u16],
    s: &'a [f32],
    o: Option<&'a [f32]>,
}

/// What every task of one product shares: A split into three bf16 parts, the sums of A's rows
/// over each group (for the offsets), the shapes and C.
struct Shared<'a> {
    engine: Engine,
    planes: &'a [u16],
    asum: &'a [f32],
    split_stride: usize,
    block_len: usize,
    /// Groups taken (A's columns / 32).
    groups: usize,
    m: usize,
    n: usize,
    blocks: usize,
    wide: bool,
    cp: SendPtr,
    ldc: usize,
    accumulate: bool,
}

fn product(
    engine: Engine,
    (a, lda, m): (&[f32], usize, usize),
    w: Weights,
    gs: std::ops::Range<usize>,
    (c, ldc): (&mut [f32], usize),
    accumulate: bool,
) {
    let (n, all, offsets) = w.layout();
    assert!(
        gs.start <= gs.end && gs.end <= all,
        "groups {gs:?} outside the matrix's {all}"
    );
    let groups = gs.len();
    let k = groups * GROUP;
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
    let asum = if offsets {
        group_sums(a, lda, m, groups, blocks)
    } else {
        Vec::new()
    };
    #[cfg(target_arch = "x86_64")]
    let wide = std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let wide = false;
    let split_stride = groups * 2 * TILE;
    A_SPLIT.with(|cell| {
        // a nested product on this thread (rayon work stealing) takes a fresh buffer
        let mut fresh = Bf16Buf::default();
        let mut held = cell.try_borrow_mut();
        let abuf: &mut Bf16Buf = held.as_deref_mut().unwrap_or(&mut fresh);
        split_a(abuf, a, lda, m, k, 3);
        let sh = Shared {
            engine,
            planes: abuf.as_slice(),
            asum: &asum,
            split_stride,
            block_len: 3 * split_stride,
            groups,
            m,
            n,
            blocks,
            wide,
            cp: SendPtr(c.as_mut_ptr()),
            ldc,
            accumulate,
        };
        let parallel = 2.0 * (m * n * k) as f64 > 4e6;
        match w {
            Weights::Packed(w) => sh.run_packed(w, gs.start, parallel),
            Weights::Decoded(w) => sh.run_decoded(w, gs.start, offsets, parallel),
        }
    });
}

/// Σ of each row of A over each group, `[blocks · 32][groups]` (padded rows 0), in f64 rounded
/// once: what the offsets multiply.
fn group_sums(a: &[f32], lda: usize, m: usize, groups: usize, blocks: usize) -> Vec<f32> {
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
}

/// Runs `task(t)` for `t < tasks`, on the pool where there is more than one and `parallel`,
/// with the tiles configured on each thread for the task.
fn run_tasks(engine: Engine, tasks: usize, parallel: bool, task: impl Fn(usize) + Sync) {
    let on_tiles = |t: usize| {
        #[cfg(target_arch = "x86_64")]
        if engine == Engine::Tiles {
            // SAFETY: the engine runs here (`check_args`): the CPU has AMX
            unsafe { super::tiles::configure() };
        }
        task(t);
        #[cfg(target_arch = "x86_64")]
        if engine == Engine::Tiles {
            // SAFETY: configured above on this thread
            unsafe { super::tiles::release() };
        }
    };
    if tasks > 1 && parallel {
        (0..tasks).into_par_iter().for_each(on_tiles);
    } else {
        (0..tasks).for_each(on_tiles);
    }
}

impl Shared<'_> {
    /// The packed matrix's product: tasks of row groups whose three parts stay in L2 while the
    /// task walks its panels, × runs of panels; `g0`: the matrix's first group taken.
    fn run_packed(&self, w: &PackedScaled, g0: usize, parallel: bool) {
        let (ws, wo) = w.scales_and_offsets();
        let wq = w.q();
        let all = w.groups;
        let panels = self.n.div_ceil(NP);
        let threads = rayon::current_num_threads();
        // at least four tasks a thread where the shape allows
        let per_group = (A_BYTES / (2 * self.block_len)).clamp(1, 8);
        let row_groups = self.blocks.div_ceil(per_group);
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
        let group = self.blocks.div_ceil(row_groups);
        let run = panels.div_ceil(runs);
        run_tasks(self.engine, row_groups * runs, parallel, |t| {
            let (gi, r) = (t / runs, t % runs);
            let (b0, b1) = (gi * group, ((gi + 1) * group).min(self.blocks));
            let mut scratch = Scratch::new();
            for p in r * run..((r + 1) * run).min(panels) {
                let first = p * all + g0;
                let view = PanelView {
                    q: &wq[first * 2 * TILE..],
                    s: &ws[first * NP..],
                    o: wo.map(|o| &o[first * NP..]),
                };
                for b in b0..b1 {
                    self.block(&mut scratch, &view, b, p, 0..self.groups);
                }
            }
        });
    }

    /// The decoded matrix's product: a task per run of panels; for each depth slice, the run's
    /// panels decoded into the thread's buffer, then every block of rows multiplied by them.
    fn run_decoded(&self, w: &dyn RowSource, g0: usize, offsets: bool, parallel: bool) {
        let panels = self.n.div_ceil(NP);
        let threads = rayon::current_num_threads();
        let slices = self.groups.div_ceil(SLICE_GROUPS);
        let slice = self.groups.div_ceil(slices);
        let (panel_q, panel_s) = (slice * TILE, slice * NP);
        let panel_bytes = 4 * panel_q + 4 * panel_s * if offsets { 2 } else { 1 };
        let fit = (DECODE_BYTES / panel_bytes).max(1);
        // runs the threads share evenly (two each at least, where there are panels enough)
        let mut runs = panels.div_ceil(fit).max(2 * threads).min(panels);
        runs = runs.div_ceil(threads) * threads;
        let run = panels.div_ceil(runs.min(panels));
        let runs = panels.div_ceil(run);
        run_tasks(self.engine, runs, parallel, |t| {
            let ps = t * run..((t + 1) * run).min(panels);
            DECODED.with(|cell| {
                let mut d = cell.borrow_mut();
                let Decoded { q, s, o, rows } = &mut *d;
                q.resize(ps.len() * panel_q, 0);
                s.resize(ps.len() * panel_s, 0.0);
                o.resize(if offsets { ps.len() * panel_s } else { 0 }, 0.0);
                let mut scratch = Scratch::new();
                for s0 in (0..self.groups).step_by(slice) {
                    let sl = s0..(s0 + slice).min(self.groups);
                    let (lq, ls) = (sl.len() * TILE, sl.len() * NP);
                    for (i, p) in ps.clone().enumerate() {
                        let qp = &mut q[i * panel_q..][..lq];
                        let sp = &mut s[i * panel_s..][..ls];
                        let op = offsets.then(|| &mut o[i * panel_s..][..ls]);
                        let cols = NP.min(self.n - p * NP);
                        decode_panel(
                            w,
                            p * NP,
                            cols,
                            g0 + sl.start..g0 + sl.end,
                            rows,
                            qp,
                            sp,
                            op,
                        );
                    }
                    for b in 0..self.blocks {
                        for (i, p) in ps.clone().enumerate() {
                            let view = PanelView {
                                q: bytemuck::cast_slice(&q[i * panel_q..]),
                                s: &s[i * panel_s..],
                                o: offsets.then(|| &o[i * panel_s..]),
                            };
                            self.block(&mut scratch, &view, b, p, sl.clone());
                        }
                    }
                }
            });
        });
    }

    /// One 32 × 32 block of C (rows of block `b`, columns of panel `p`) over the groups `sl`
    /// (A's, counted from the first taken; the view's, from `sl.start`): the running sums start
    /// from C where the product accumulates or an earlier slice wrote them, from zero otherwise.
    fn block(
        &self,
        sc: &mut Scratch,
        view: &PanelView,
        b: usize,
        p: usize,
        sl: std::ops::Range<usize>,
    ) {
        let (row0, col0) = (b * MB, p * NP);
        let (rows, cols) = (MB.min(self.m - row0), NP.min(self.n - col0));
        let from_c = self.accumulate || sl.start > 0;
        let acc = &mut sc.acc.0;
        if from_c {
            // without it the first group's scaling starts the sums from zero (no fill: a memset
            // of 4 KiB per block was 1% of a forward)
            if rows < MB {
                acc.fill(0.0);
            }
            self.load_rows(acc, row0, rows, col0, cols);
        }
        let a0 = self.planes[b * self.block_len..].as_ptr();
        // two groups on the tiles, then both scaled into the sums in one pass (the sums stay in
        // registers between them: half the loads and stores of the running sums, the same
        // operations in the same order)
        let mut g = sl.start;
        while g < sl.end {
            let pair = (sl.end - g).min(2);
            let lg = g - sl.start;
            for (h, t) in sc.tmp.iter_mut().take(pair).enumerate() {
                let qt = view.q[(lg + h) * 2 * TILE..][..2 * TILE].as_ptr();
                let a_g = a0.wrapping_add((g + h) * 2 * TILE);
                match self.engine {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: the pointers name whole tiles of the packed buffers, and
                    // `Engine::Tiles` runs only in a task that configured the tiles
                    Engine::Tiles => unsafe {
                        super::tiles::scaled_group(a_g, self.split_stride, qt, t.0.as_mut_ptr())
                    },
                    // SAFETY: the pointers name whole tiles of the packed buffers
                    _ => unsafe { emulated_group(a_g, self.split_stride, qt, &mut t.0) },
                }
            }
            let first = g == sl.start && !from_c;
            let at = row0 * self.groups + g;
            let (ws, wo, asum, st) = (view.s, view.o, self.asum, self.groups);
            if pair == 2 {
                let gs = [
                    Scaled::of(&sc.tmp[0].0, ws, wo, asum, lg, at, st),
                    Scaled::of(&sc.tmp[1].0, ws, wo, asum, lg + 1, at + 1, st),
                ];
                post(acc, &gs, first, self.wide);
            } else {
                let gs = [Scaled::of(&sc.tmp[0].0, ws, wo, asum, lg, at, st)];
                post(acc, &gs, first, self.wide);
            }
            g += pair;
        }
        self.store_rows(acc, row0, rows, col0, cols);
    }

    /// The block's running sums from C's rows `row0..row0 + rows`, columns `col0..col0 + cols`.
    fn load_rows(
        &self,
        acc: &mut [f32; MB * NP],
        row0: usize,
        rows: usize,
        col0: usize,
        cols: usize,
    ) {
        for r in 0..rows {
            // SAFETY: the task owns these rows × its panels' columns of C; `check_args` checked
            // that C holds m rows of n at ldc
            let src = unsafe { self.cp.get().add((row0 + r) * self.ldc + col0) };
            let row = &mut acc[r * NP..(r + 1) * NP];
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

    /// The block's sums into C (as [`Shared::load_rows`] reads them).
    fn store_rows(&self, acc: &[f32; MB * NP], row0: usize, rows: usize, col0: usize, cols: usize) {
        for r in 0..rows {
            let row = &acc[r * NP..(r + 1) * NP];
            // SAFETY: as in `load_rows`: the task's own rows and columns of C
            unsafe {
                let dst = self.cp.get().add((row0 + r) * self.ldc + col0);
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

/// Panel columns `j0..j0 + cols` of `w` over the groups `gs`, in the tiles' layout (columns
/// past `cols` zero). Panics on a row the source cannot give as exact integers: it checks its
/// rows before the first product.
#[allow(clippy::too_many_arguments)]
fn decode_panel(
    w: &dyn RowSource,
    j0: usize,
    cols: usize,
    gs: std::ops::Range<usize>,
    rows: &mut RowBuf,
    qp: &mut [u32],
    sp: &mut [f32],
    mut op: Option<&mut [f32]>,
) {
    if cols < NP {
        qp.fill(0);
        sp.fill(0.0);
        if let Some(op) = op.as_deref_mut() {
            op.fill(0.0);
        }
    }
    for jj in 0..cols {
        let (qr, sr, or) = rows.get(gs.len());
        let ok = w.row(j0 + jj, gs.clone(), qr, sr, or);
        assert!(
            ok,
            "row {} is not integers and scales: checked before the product",
            j0 + jj
        );
        put_row(qp, sp, op.as_deref_mut(), jj, qr, sr, or);
    }
}

/// A worker's decoded panels (integers, scales, offsets) and its row buffer, kept from product
/// to product.
#[derive(Default)]
struct Decoded {
    q: Vec<u32>,
    s: Vec<f32>,
    o: Vec<f32>,
    rows: RowBuf,
}

thread_local! {
    static DECODED: std::cell::RefCell<Decoded> = std::cell::RefCell::new(Decoded::default());
}

/// A task's running sums and two groups' tiles.
struct Scratch {
    acc: Block,
    tmp: [Block; 2],
}

impl Scratch {
    fn new() -> Self {
        Scratch {
            acc: Block([0f32; MB * NP]),
            tmp: [Block([0f32; MB * NP]), Block([0f32; MB * NP])],
        }
    }
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
        let engines = super::super::tests::engines();
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
        let engines = super::super::tests::engines();
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

    /// A [`RowSource`] of the same rows as [`matrix`]'s packed form.
    struct Rows {
        n: usize,
        k: usize,
        offsets: bool,
        packed: PackedScaled,
    }

    impl RowSource for Rows {
        fn layout(&self) -> (usize, usize, bool) {
            (self.n, self.k / GROUP, self.offsets)
        }

        fn row(
            &self,
            j: usize,
            gs: std::ops::Range<usize>,
            q: &mut [u32],
            s: &mut [f32],
            o: &mut [f32],
        ) -> bool {
            // read back from the packed tiles: S·Q + O = weight, with Q the tile's value
            let (p, jj) = (j / NP, j % NP);
            let (half, col) = (jj / T, jj % T);
            let (ws, wo) = self.packed.scales_and_offsets();
            for (lg, g) in gs.enumerate() {
                let tile =
                    &self.packed.q()[(p * self.packed.groups + g) * 2 * TILE + half * TILE..];
                for r in 0..KT / 2 {
                    let (lo, hi) = (tile[r * 2 * T + col * 2], tile[r * 2 * T + col * 2 + 1]);
                    q[lg * 16 + r] = lo as u32 | (hi as u32) << 16;
                }
                let at = (p * self.packed.groups + g) * NP + jj;
                s[lg] = ws[at];
                o[lg] = wo.map_or(0.0, |o| o[at]);
            }
            true
        }
    }

    #[test]
    fn decoding_panels_in_the_product_gives_the_packed_matrix_bits() {
        let engines = super::super::tests::engines();
        // 70 groups: three depth slices (32, 32, 6 → 24, 24, 22); 100 columns: a partial
        // panel; 1,700 columns: runs of many panels on each thread
        for (m, k, n, seed) in [(45, 70 * 32, 100, 1), (70, 256, 1700, 2), (1, 64, 33, 3)] {
            for offsets in [false, true] {
                let (_, packed) = matrix(n, k, offsets, seed + offsets as u64);
                let rows = Rows {
                    n,
                    k,
                    offsets,
                    packed: packed.clone(),
                };
                let groups = k / GROUP;
                let mut rng = crate::reference::Rng::new(seed + 50);
                for gs in [0..groups, 1..groups - 1, 0..1, 2..2] {
                    let lda = gs.len() * GROUP;
                    let a = rng.normals(m * lda.max(1), 1.0);
                    let ldc = n + 5;
                    for &engine in &engines {
                        for accumulate in [false, true] {
                            let base = if accumulate { 0.75f32 } else { f32::NAN };
                            let (mut want, mut got) = (vec![base; m * ldc], vec![base; m * ldc]);
                            let lda = lda.max(1);
                            gemm_groups_with(
                                engine,
                                &a,
                                lda,
                                m,
                                &packed,
                                gs.clone(),
                                &mut want,
                                ldc,
                                accumulate,
                            );
                            gemm_decoded(
                                engine,
                                &a,
                                lda,
                                m,
                                &rows,
                                gs.clone(),
                                &mut got,
                                ldc,
                                accumulate,
                            );
                            assert!(
                                got.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                                "{engine:?} m={m} k={k} n={n} offsets={offsets} groups {gs:?} acc={accumulate}"
                            );
                        }
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
