//! Matrix multiplication on Intel AMX tiles (Sapphire Rapids and later): `C = A · Wᵀ` with the
//! `tdpbf16ps` instruction, which multiplies a 16 × 32 tile of bf16 by a 32 × 16 one and adds
//! the 16 × 16 result to f32 accumulators, ~16x the multiply-adds of an AVX-512 FMA per cycle.
//!
//! bf16 keeps 8 of f32's 24 mantissa bits, so on its own (`splits = 1`, `--precision fast`) a
//! product is good to ~3 significant digits. For `exact`, each operand is written as the sum of
//! three bf16 numbers, `x = x₁ + x₂ + x₃` (x₁ the nearest bf16 to x, x₂ the nearest to what
//! remains, and so on: 3 × 8 bits, every f32 exactly), and the six products whose size is above
//! f32's rounding are summed, `x₁w₁ + x₁w₂ + x₂w₁ + x₁w₃ + x₂w₂ + x₃w₁`; the three left out are
//! below 2⁻²⁴ of `x·w`. Each bf16 × bf16 product is exact in f32 and the tile adds in f32, so
//! the result is an f32 sum of products in another order, like [`super::gemm`]'s (the
//! "bf16x3" scheme of oneDNN; Henry, Tang & Heinecke 2019, "Leveraging the bfloat16 artificial
//! intelligence datatype for higher-precision computations"). Tested against a naive product
//! on every machine, through an emulation of the tile instruction where the CPU has no AMX.
//!
//! [`scaled`] runs `exact` another way on the same tiles, for weights a quantized file holds as
//! integers times scales: three products instead of six, and two bytes a weight.
//!
//! Linux hands the tile registers to a process only when it asks (`arch_prctl
//! ARCH_REQ_XCOMP_PERM`); [`super::select`] asks once. `ATTNSCOPE_AMX=0` turns the kernel off
//! (benchmarks compare the two; the f32 kernels then run), `ATTNSCOPE_AMX=exact` puts `exact` on
//! three bf16 parts, `=f32` keeps `exact` off the tiles.

use super::SendPtr;
use rayon::prelude::*;

pub mod scaled;

/// Rows of a tile (and of C per tile).
const T: usize = 16;
/// bf16 values along k in one tile row.
const KT: usize = 32;
/// Columns of a packed panel: two tiles side by side.
const NP: usize = 32;
/// Rows of A per micro-block: two tiles stacked.
const MB: usize = 32;
/// bf16 values in one tile (1 KiB).
const TILE: usize = T * KT;

/// Whether the kernels may use the AMX tiles: the CPU has AMX-BF16, Linux lets this process use
/// them, and neither `ATTNSCOPE_ISA` (below `amx`) nor `ATTNSCOPE_AMX=0` rules them out
/// ([`super::select`]).
pub fn available() -> bool {
    super::select::kernels().tiles
}

/// Whether `exact` runs every projection on the tiles as three bf16 parts of the dequantized
/// weights (rather than a quantized file's integers and scales, [`exact_scaled`], or the f32
/// kernels): only when asked (`ATTNSCOPE_AMX=exact`), since on the machine it was built on
/// it measured no faster (gate|up at 2,048 tokens 250-490 GFLOP/s against 330-390 for f32: six
/// tile products per output, and the tile unit runs at ~3 of its 5 TFLOP/s on real data).
/// Measured again later, end to end: `inspect` at 2,048 tokens 12.7-13.1 s on the tiles against
/// 9.8-13.2 s on the f32 kernel (three alternating pairs), peaking at 2.31 GB against 1.60 (three
/// bf16 parts are 6 bytes a weight).
pub fn exact_on_tiles() -> bool {
    super::select::kernels().exact == super::select::ExactOn::Bf16x3
}

/// Whether `exact` runs the projections of a quantized file on the tiles as the file's
/// integers and scales ([`scaled`]): on every CPU with AMX, unless `ATTNSCOPE_AMX=f32` keeps
/// them on the f32 kernel (benchmarks compare the two), `=exact` asks for three parts, or
/// `ATTNSCOPE_ISA` holds the kernels below the tiles.
pub fn exact_scaled() -> bool {
    super::select::kernels().exact == super::select::ExactOn::Scaled
}

/// Whether the CPU has AMX-BF16 tiles and Linux lets this process use them (asks Linux; called
/// once, by [`super::select`]).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) fn hardware_ready() -> bool {
    use std::arch::x86_64::__cpuid_count;
    let (max_leaf, l7, l1) = (
        __cpuid_count(0, 0).eax,
        __cpuid_count(7, 0),
        __cpuid_count(1, 0),
    );
    if max_leaf < 0xd {
        return false;
    }
    let amx_bf16 = l7.edx >> 22 & 1 == 1;
    let amx_tile = l7.edx >> 24 & 1 == 1;
    let osxsave = l1.ecx >> 27 & 1 == 1;
    if !(amx_bf16 && amx_tile && osxsave) {
        return false;
    }
    // ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: the kernel enables the tile state in XCR0 and
    // grants it to the whole process, or refuses (old kernel, a VM that hides it).
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain system call with integer arguments.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
pub(crate) fn hardware_ready() -> bool {
    false
}

/// The bf16 nearest to `x` (ties to even); NaN stays NaN.
#[inline]
fn bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let round = 0x7fff + ((b >> 16) & 1);
    let nearest = (b.wrapping_add(round) >> 16) as u16;
    // a select, not a branch, so conversion loops vectorize
    if x.is_nan() {
        ((b >> 16) | 0x40) as u16
    } else {
        nearest
    }
}

#[inline]
fn f32_of(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// `x` as `splits` bf16 parts whose sum is `x` (to 2⁻²⁴ of it for 3 parts).
#[inline]
fn split(x: f32, splits: usize) -> [u16; 3] {
    let h1 = bf16(x);
    if splits == 1 {
        return [h1, 0, 0];
    }
    let r1 = x - f32_of(h1);
    let h2 = bf16(r1);
    let r2 = r1 - f32_of(h2);
    [h1, h2, bf16(r2)]
}

/// bf16 bits on a 64-byte boundary.
type Bf16Buf = super::gemm::AlignedBuf<u16>;

/// `W: [n, k]` (the `y = x Wᵀ` layout) as bf16 tiles: panels of 32 columns; in a panel, for
/// each 32-deep chunk of k, for each split, the two 16-column tiles in the pair layout of
/// `tdpbf16ps` (tile row r holds, for each column j, `W[j, 2r]` and `W[j, 2r + 1]`). k and n
/// are padded with zeros to whole chunks and panels.
#[derive(Clone)]
pub struct PackedBf16 {
    pub n: usize,
    pub k: usize,
    /// 1 (bf16, `fast`) or 3 (bf16x3, `exact`)
    pub splits: usize,
    chunks: usize,
    buf: super::gemm::Panels<u16>,
}

impl std::fmt::Debug for PackedBf16 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "PackedBf16 {{ n: {}, k: {}, splits: {} }}",
            self.n, self.k, self.splits
        )
    }
}

impl PackedBf16 {
    /// Packs `W: [n, k]` row-major (row stride `ldw`) as `splits` (1 or 3) bf16 parts.
    pub fn from_rows(w: &[f32], n: usize, k: usize, ldw: usize, splits: usize) -> PackedBf16 {
        assert!(
            n == 0 || w.len() >= (n - 1) * ldw + k,
            "W is too short for [{n}, {k}]"
        );
        match Self::try_from_row_source(n, k, splits, super::rows_of(w, k, ldw)) {
            Ok(p) => p,
            Err(e) => match e {},
        }
    }

    /// Packs `W: [n, k]` whose rows come from `rows(r0, out)` (rows `r0..r0 + out.len() / k`,
    /// row-major), one panel's rows at a time (as [`super::gemm::PackedB::try_from_row_source`]).
    pub fn try_from_row_source<E: Send>(
        n: usize,
        k: usize,
        splits: usize,
        rows: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
    ) -> Result<PackedBf16, E> {
        assert!(splits == 1 || splits == 3, "splits must be 1 or 3");
        let chunks = k.div_ceil(KT);
        let panels = n.div_ceil(NP);
        let panel_len = chunks * splits * 2 * TILE;
        let mut buf = Bf16Buf::zeros(panels * panel_len);
        super::fill_panels(
            buf.as_mut_slice(),
            panel_len,
            NP,
            (n, k),
            rows,
            |cols, w, panel| {
                for j in 0..cols {
                    let (half, jj) = (j / T, j % T);
                    for (kk, &x) in w[j * k..(j + 1) * k].iter().enumerate() {
                        let parts = split(x, splits);
                        let (c, r, e) = (kk / KT, (kk % KT) / 2, kk % 2);
                        for (s, &part) in parts.iter().enumerate().take(splits) {
                            let tile = ((c * splits + s) * 2 + half) * TILE;
                            panel[tile + r * 2 * T + jj * 2 + e] = part;
                        }
                    }
                }
            },
        )?;
        Ok(PackedBf16 {
            n,
            k,
            splits,
            chunks,
            buf: super::gemm::Panels::Owned(buf),
        })
    }

    /// bf16 values a `[k, n]` matrix packed as `splits` parts takes (whole chunks and panels).
    pub fn packed_len(n: usize, k: usize, splits: usize) -> usize {
        n.div_ceil(NP) * k.div_ceil(KT) * splits * 2 * TILE
    }

    /// A `[k, n]` matrix of `splits` parts whose tiles (as [`PackedBf16::as_bytes`] gave them)
    /// lie at `offset` in `map`; `None` if they do not fit there (64-byte aligned).
    pub fn from_mapped(
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        n: usize,
        k: usize,
        splits: usize,
    ) -> Option<PackedBf16> {
        if splits != 1 && splits != 3 {
            return None;
        }
        let buf = super::gemm::Panels::mapped(map, offset, Self::packed_len(n, k, splits))?;
        Some(PackedBf16 {
            n,
            k,
            splits,
            chunks: k.div_ceil(KT),
            buf,
        })
    }

    /// The tiles as bytes (native-endian bf16 bits), as a cache file stores them.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.as_bytes()
    }

    /// Whether the tiles are read from a mapped file.
    pub fn is_mapped(&self) -> bool {
        self.buf.is_mapped()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.buf.as_slice().len() * 2
    }

    fn panel_len(&self) -> usize {
        self.chunks * self.splits * 2 * TILE
    }

    /// Column `j` as the f32 sum of its parts (for tests).
    pub fn column(&self, j: usize) -> Vec<f32> {
        let panel = &self.buf.as_slice()[(j / NP) * self.panel_len()..];
        let (half, jj) = ((j % NP) / T, j % T);
        (0..self.k)
            .map(|kk| {
                let (c, r, e) = (kk / KT, (kk % KT) / 2, kk % 2);
                (0..self.splits)
                    .rev()
                    .map(|s| {
                        let tile = ((c * self.splits + s) * 2 + half) * TILE;
                        f32_of(panel[tile + r * 2 * T + jj * 2 + e])
                    })
                    .sum()
            })
            .collect()
    }
}

thread_local! {
    static A_SPLIT: std::cell::RefCell<Bf16Buf> = std::cell::RefCell::new(Bf16Buf::default());
    static C_PART: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// How a product runs: on the tiles, or (tests on a CPU without AMX) through a plain-Rust
/// emulation of the same instruction on the same packed data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    Tiles,
    Emulated,
}

/// `C[m, n] (+)= A[m, k] · Wᵀ` with `A` row-major (row stride `lda`), `C` row-major (stride
/// `ldc`), on every thread of rayon's pool. Panics if the CPU has no AMX ([`available`]).
pub fn gemm(
    a: &[f32],
    lda: usize,
    m: usize,
    w: &PackedBf16,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    assert!(available(), "AMX is not available on this CPU");
    gemm_with(Engine::Tiles, a, lda, m, w, c, ldc, accumulate)
}

/// [`gemm`] on a chosen engine.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    engine: Engine,
    a: &[f32],
    lda: usize,
    m: usize,
    w: &PackedBf16,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let (k, n, splits) = (w.k, w.n, w.splits);
    if m == 0 || n == 0 {
        return;
    }
    check_args(engine, (a, lda), (c, ldc), (m, k, n));
    let chunks = w.chunks;
    let blocks = m.div_ceil(MB);
    // A as tiles ([`split_a`])
    let block_len = splits * chunks * 2 * TILE;
    A_SPLIT.with(|cell| {
        let mut abuf = cell.borrow_mut();
        split_a(&mut abuf, a, lda, m, k, splits);
        let planes = abuf.as_slice();
        let panels = n.div_ceil(NP);
        let threads = rayon::current_num_threads();
        // tasks: row groups of whole 32-row blocks × runs of panels; the A rows of a task (one
        // k slice) and one panel's slice stay in L2 while the task walks its panels
        let (groups, runs) = task_grid(blocks, panels, threads);
        let group = blocks.div_ceil(groups);
        let run = panels.div_ceil(runs);
        let cp = SendPtr(c.as_mut_ptr());
        let task = |t: usize| {
            let (g, r) = (t / runs, t % runs);
            let (b0, b1) = (g * group, ((g + 1) * group).min(blocks));
            let (q0, q1) = (r * run, ((r + 1) * run).min(panels));
            if b0 >= b1 || q0 >= q1 {
                return;
            }
            // SAFETY: the task owns rows b0·32.. b1·32 × panels q0..q1 of C; sizes checked above.
            unsafe {
                task_run(
                    engine,
                    planes,
                    block_len,
                    w,
                    b0..b1,
                    q0..q1,
                    m,
                    cp,
                    ldc,
                    accumulate,
                )
            };
        };
        let tasks = groups * runs;
        let flops = 2.0 * (m * n * k) as f64;
        if tasks > 1 && flops > 4e6 {
            (0..tasks).into_par_iter().for_each(task);
        } else {
            (0..tasks).for_each(task);
        }
    });
}

crate::kernels::simd::multiversion! {
    /// One row of A as three bf16 parts (the same bits as [`split`]: the same operations in the
    /// same order, lane by lane), straight into its rows of the tiles: chunk `c`'s part `sp` at
    /// `dst[base + c·2·TILE + sp·stride..]`. In place, with no staging array: copies of those
    /// had compiled to calls of memmove, 3.6% of the samples of a forward at 2,048 tokens.
    fn split3_row(src: &[f32], dst: &mut [u16], base: usize, stride: usize) {
        for (c, xs) in src.chunks(KT).enumerate() {
            let (o, len) = (base + c * 2 * TILE, xs.len());
            let (first, rest) = dst[o..].split_at_mut(stride);
            let (second, third) = rest.split_at_mut(stride);
            let parts = first[..len]
                .iter_mut()
                .zip(&mut second[..len])
                .zip(&mut third[..len]);
            for (&x, ((h0, h1), h2)) in xs.iter().zip(parts) {
                *h0 = bf16(x);
                let r = x - f32_of(*h0);
                *h1 = bf16(r);
                *h2 = bf16(r - f32_of(*h1));
            }
        }
    }
}

/// Panics unless `A` holds `[m, k]` at row stride `lda`, `C` holds `[m, n]` at `ldc`, and the
/// engine runs here (the checks of both tile products; m and n are not 0).
fn check_args(
    engine: Engine,
    (a, lda): (&[f32], usize),
    (c, ldc): (&[f32], usize),
    (m, k, n): (usize, usize, usize),
) {
    super::check_operands((a, lda), (c, ldc), (m, k, n));
    assert!(
        engine == Engine::Emulated || available(),
        "AMX is not available on this CPU"
    );
}

/// `A[m, k]` (row stride `lda`) as bf16 tiles in `buf`: for each 32-row block, each of `splits`
/// parts, each 32-deep chunk, the two 16-row tiles (1 KiB each, contiguous, so a tile load
/// reads whole lines in order); zero-padded to whole blocks and chunks.
fn split_a(buf: &mut Bf16Buf, a: &[f32], lda: usize, m: usize, k: usize, splits: usize) {
    let chunks = k.div_ceil(KT);
    let blocks = m.div_ceil(MB);
    assert!(splits == 1 || splits == 3, "A splits into 1 or 3 parts");
    let block_len = splits * chunks * 2 * TILE;
    buf.ensure(blocks * block_len);
    buf.as_mut_slice()[..blocks * block_len]
        .par_chunks_mut(block_len)
        .enumerate()
        .for_each(|(b, dst)| {
            let rows = MB.min(m - b * MB);
            if rows < MB || !k.is_multiple_of(KT) {
                dst.fill(0);
            }
            for r in 0..rows {
                let src = &a[(b * MB + r) * lda..(b * MB + r) * lda + k];
                let (half, rr) = (r / T, r % T);
                // the row's place in its tiles: row rr of the upper or lower tile of each chunk
                let base = half * TILE + rr * KT;
                if splits == 1 {
                    for (c, xs) in src.chunks(KT).enumerate() {
                        // one part: a straight conversion of 32 values (vectorizes)
                        let d = &mut dst[base + c * 2 * TILE..][..xs.len()];
                        d.iter_mut().zip(xs).for_each(|(d, &x)| *d = bf16(x));
                    }
                } else {
                    split3_row(src, dst, base, chunks * 2 * TILE);
                }
            }
        });
}

/// `(row groups, panel runs)`: runs of at most 16 panels (512 columns, whose k slice of up to
/// 384 KiB stays in L2 while the task's row blocks walk it, with the task's running sums, 512
/// KiB), row groups of at most 8 blocks, and at least two tasks per thread where the shape
/// allows.
fn task_grid(blocks: usize, panels: usize, threads: usize) -> (usize, usize) {
    let groups = blocks.div_ceil(8).max(1);
    let mut runs = panels.div_ceil(16).max(1);
    while groups * runs < 2 * threads && runs < panels {
        runs += 1;
    }
    // a count of tasks that the threads share evenly, where one is near
    if threads > 1 {
        if let Some(r) =
            (runs..=(2 * runs).min(panels)).find(|&r| (groups * r).is_multiple_of(threads))
        {
            runs = r;
        }
    }
    (groups, runs)
}

/// Chunks of k per slice: a 32-row block of A's slice stays in L1 (24 KiB for three parts 128
/// deep, 16 KiB for one part 256 deep) while the kernel walks the task's panels, whose slices
/// come from L2.
const fn slice_chunks(splits: usize) -> usize {
    if splits == 3 {
        4
    } else {
        8
    }
}

/// Where a block's running sums come from and go to: a `[32, 32]` f32 block at row stride `ld`.
#[derive(Clone, Copy)]
struct CBlock {
    ptr: *mut f32,
    ld: usize,
}

/// One task: row blocks `blocks` × panels `panels` of C, over every k slice. Between the first
/// and the last slice a block's sums live in a buffer of the task (in L2) rather than in C,
/// whose rows lie a whole row of C apart (out of every cache for the wide products).
///
/// # Safety
/// `c` is valid for `m` rows of stride `ldc` holding `w.n` columns; the task's tiles of C are
/// written by no one else; with `Engine::Tiles`, [`available`] is true.
#[allow(clippy::too_many_arguments)]
unsafe fn task_run(
    engine: Engine,
    planes: &[u16],
    block_len: usize,
    w: &PackedBf16,
    blocks: std::ops::Range<usize>,
    panels: std::ops::Range<usize>,
    m: usize,
    c: SendPtr,
    ldc: usize,
    accumulate: bool,
) {
    let task = Task {
        engine,
        planes,
        block_len,
        w,
        panels,
        m,
        c,
        ldc,
        accumulate,
    };
    // SAFETY: the caller upholds this function's contract, which is [`Task::run`]'s.
    unsafe { task.run(blocks) }
}

/// One task of [`task_run`]: its inputs, and the panels of C it computes.
struct Task<'a> {
    engine: Engine,
    planes: &'a [u16],
    block_len: usize,
    w: &'a PackedBf16,
    panels: std::ops::Range<usize>,
    m: usize,
    c: SendPtr,
    ldc: usize,
    accumulate: bool,
}

/// One k slice of a task: chunks `c0..c0 + nch`, and whether it is the first and the last.
#[derive(Clone, Copy)]
struct KSlice {
    c0: usize,
    nch: usize,
    first: bool,
    last: bool,
}

impl Task<'_> {
    /// Every k slice over row blocks `blocks` × the task's panels, the tiles configured around
    /// them (with `Engine::Tiles`); the sums between slices in the task's buffer `C_PART`.
    ///
    /// # Safety
    /// As [`task_run`].
    unsafe fn run(&self, blocks: std::ops::Range<usize>) {
        // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
        // the rows and tiles it names, the CPU has the kernel's features); the body only
        // reads and writes within them.
        unsafe {
            let chunks = self.w.chunks;
            let kcs = slice_chunks(self.w.splits);
            let slices = chunks.div_ceil(kcs);
            let panels = self.panels.clone();
            let mut spare = [0f32; MB * NP];
            C_PART.with(|cell| {
                let mut part = cell.borrow_mut();
                if slices > 1 {
                    let len = blocks.len() * panels.len() * MB * NP;
                    if part.len() < len {
                        part.resize(len, 0.0);
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if self.engine == Engine::Tiles {
                    tiles::configure();
                }
                for si in 0..slices {
                    let c0 = si * kcs;
                    let slice = KSlice {
                        c0,
                        nch: kcs.min(chunks - c0),
                        first: si == 0,
                        last: si + 1 == slices,
                    };
                    for (bi, b) in blocks.clone().enumerate() {
                        let a0 = self.planes[b * self.block_len + c0 * 2 * TILE..].as_ptr();
                        for (pi, p) in panels.clone().enumerate() {
                            let in_part = part.as_mut_ptr().add((bi * panels.len() + pi) * MB * NP);
                            self.tile(slice, (b, a0), p, in_part, &mut spare);
                        }
                    }
                }
                #[cfg(target_arch = "x86_64")]
                if self.engine == Engine::Tiles {
                    tiles::release();
                }
            });
        }
    }

    /// Row block `b` (its A tiles at `a0`) × panel `p` over one k slice. Its sums start from
    /// zero and go through the task's buffer `part` between slices; the last slice writes C
    /// itself for a whole tile, `spare` for an edge tile (its valid part copied out) or where
    /// the product accumulates: then C gets `C + sums`, the product added to it after it is
    /// summed, as the f32 kernel adds a depth block's sums, so an accumulating product gives
    /// the bits of a product and an add (a hook that edits an output that otherwise accumulates
    /// into the residual, without changing it, changes no bit).
    ///
    /// # Safety
    /// As [`task_run`]; `part` valid for a `[32, 32]` block when there is more than one slice.
    #[inline(always)]
    unsafe fn tile(
        &self,
        slice: KSlice,
        (b, a0): (usize, *const u16),
        p: usize,
        part: *mut f32,
        spare: &mut [f32; MB * NP],
    ) {
        // SAFETY: as this function's contract: C's rows and columns named exist, and the
        // task's tiles of it are written by no one else.
        unsafe {
            let (c, ldc) = (self.c, self.ldc);
            let row0 = b * MB;
            let rows = MB.min(self.m.saturating_sub(row0));
            let col0 = p * NP;
            let cols = NP.min(self.w.n - col0);
            let in_c = CBlock {
                ptr: c.0.add(row0 * ldc + col0),
                ld: ldc,
            };
            // through `in_spare.ptr` (not `spare`), so the pointer the product uses stays the one
            // every access goes through
            let in_spare = CBlock {
                ptr: spare.as_mut_ptr(),
                ld: NP,
            };
            let in_part = CBlock { ptr: part, ld: NP };
            let src = (!slice.first).then_some(in_part);
            let direct = rows == MB && cols == NP && !self.accumulate;
            let dst = if !slice.last {
                in_part
            } else if direct {
                in_c
            } else {
                in_spare
            };
            self.multiply(slice, a0, p, src, dst);
            if slice.last && !direct {
                for r in 0..rows {
                    for j in 0..cols {
                        let to = c.0.add((row0 + r) * ldc + col0 + j);
                        let sum = *in_spare.ptr.add(r * NP + j);
                        *to = if self.accumulate { *to + sum } else { sum };
                    }
                }
            }
        }
    }

    /// `dst = src + A · W` of one tile over one k slice (A's tiles at `a0`, panel `p`): on the
    /// tiles, the next call's first tiles prefetched, or emulated.
    ///
    /// # Safety
    /// As [`task_run`]; `src` and `dst` valid for a `[32, 32]` block.
    #[inline(always)]
    unsafe fn multiply(
        &self,
        slice: KSlice,
        a0: *const u16,
        p: usize,
        src: Option<CBlock>,
        dst: CBlock,
    ) {
        let (splits, nch, c0) = (self.w.splits, slice.nch, slice.c0);
        let wbuf = self.w.buf.as_slice();
        let panel_len = self.w.panel_len();
        let split_stride = self.w.chunks * 2 * TILE;
        let bp = wbuf[p * panel_len + c0 * splits * 2 * TILE..].as_ptr();
        // SAFETY: as this function's contract: the pointers cover the tiles they name.
        unsafe {
            match self.engine {
                #[cfg(target_arch = "x86_64")]
                Engine::Tiles => {
                    // what the next call reads first: the next panel, or the first
                    // panel of the next block (prefetching past the end is harmless)
                    let next = if p + 1 < self.panels.end {
                        (a0, bp.wrapping_add(panel_len))
                    } else {
                        (
                            a0.wrapping_add(self.block_len),
                            wbuf.as_ptr().wrapping_add(
                                self.panels.start * panel_len + c0 * splits * 2 * TILE,
                            ),
                        )
                    };
                    tiles::block(nch, splits, a0, split_stride, bp, src, dst, next)
                }
                _ => emulated_block(nch, splits, a0, split_stride, bp, src, dst),
            }
        }
    }
}

/// The products of one 32 × 32 block over `nch` chunks, in the order the tile kernel does them:
/// `(A part, W part)` pairs, smallest first.
const PRODUCTS3: [(usize, usize); 6] = [(0, 2), (0, 1), (0, 0), (1, 0), (2, 0), (1, 1)];

/// Plain-Rust `tdpbf16ps` on the same packed data: `C[16,16] += A[16, 32] · B` where B is a
/// tile in the pair layout; each pair's two products added to C one after the other in f32.
///
/// # Safety
/// As [`tiles::block`].
#[allow(clippy::too_many_arguments)]
unsafe fn emulated_block(
    nch: usize,
    splits: usize,
    a0: *const u16,
    split_stride: usize,
    b: *const u16,
    src: Option<CBlock>,
    dst: CBlock,
) {
    // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
    // the rows and tiles it names, the CPU has the kernel's features); the body only
    // reads and writes within them.
    unsafe {
        let mut cc = [0f32; MB * NP];
        if let Some(src) = src {
            for r in 0..MB {
                for j in 0..NP {
                    cc[r * NP + j] = *src.ptr.add(r * src.ld + j);
                }
            }
        }
        let products: &[(usize, usize)] = if splits == 3 {
            &PRODUCTS3
        } else {
            &PRODUCTS3[2..3]
        };
        for ch in 0..nch {
            for &(sa, sb) in products {
                for half in 0..2 {
                    let tile = b.add(((ch * splits + sb) * 2 + half) * TILE);
                    for rt in 0..2 {
                        let a = a0.add(sa * split_stride + ch * 2 * TILE + rt * TILE);
                        emulated_tdp(&mut cc[rt * T * NP + half * T..], NP, a, tile);
                    }
                }
            }
        }
        for r in 0..MB {
            for j in 0..NP {
                *dst.ptr.add(r * dst.ld + j) = cc[r * NP + j];
            }
        }
    }
}

/// Plain-Rust `tdpbf16ps`: `C[16, 16] += A[16, 32] · B` with C at row stride `ldc`, A a tile
/// of 16 rows of 32 bf16, B a tile in the pair layout; each pair's two products added to C one
/// after the other in f32.
///
/// # Safety
/// `a` and `b` point at whole tiles.
unsafe fn emulated_tdp(c: &mut [f32], ldc: usize, a: *const u16, b: *const u16) {
    // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
    // the rows and tiles it names, the CPU has the kernel's features); the body only
    // reads and writes within them.
    unsafe {
        for r in 0..T {
            let arow = a.add(r * KT);
            for jj in 0..T {
                let mut x = c[r * ldc + jj];
                for pr in 0..KT / 2 {
                    for e in 0..2 {
                        let av = f32_of(*arow.add(2 * pr + e));
                        let bv = f32_of(*b.add(pr * 2 * T + jj * 2 + e));
                        x += av * bv;
                    }
                }
                c[r * ldc + jj] = x;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod tiles {
    use super::{T, TILE};
    use std::arch::asm;

    /// Palette 1: tiles 0-3 the f32 accumulators (16 × 64 bytes), 4-5 A (16 rows × 32 bf16),
    /// 6-7 B (16 pair rows × 16 columns × 2 bf16): all 16 rows of 64 bytes.
    #[repr(C, align(64))]
    struct Config([u8; 64]);

    pub(super) unsafe fn configure() {
        // SAFETY: AMX tile instructions on this thread, after `available()` said the CPU has them and
        // the kernel asked the OS for the tile state; the pointers are the caller's, valid for what
        // the doc comment names.
        unsafe {
            let mut cfg = Config([0; 64]);
            cfg.0[0] = 1;
            for t in 0..8 {
                cfg.0[16 + 2 * t] = 64;
                cfg.0[48 + t] = T as u8;
            }
            asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly));
        }
    }

    /// Asks for `len` bf16 from `p` on into L1.
    #[inline(always)]
    unsafe fn prefetch(p: *const u16, len: usize) {
        // SAFETY: AMX tile instructions on this thread, after `available()` said the CPU has them and
        // the kernel asked the OS for the tile state; the pointers are the caller's, valid for what
        // the doc comment names.
        unsafe {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
            let p = p as *const i8;
            for line in (0..len * 2).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line));
            }
        }
    }

    pub(super) unsafe fn release() {
        // SAFETY: AMX tile instructions on this thread, after `available()` said the CPU has them and
        // the kernel asked the OS for the tile state; the pointers are the caller's, valid for what
        // the doc comment names.
        unsafe {
            asm!("tilerelease", options(nostack, nomem));
        }
    }

    /// One 32-deep group of a scaled product ([`super::scaled`]): `tmp[4][16][16] =
    /// Σ_parts A_part[32, 32] · Q[32, 32]` with A's three parts at `a`, `a + split_stride`,
    /// `a + 2·split_stride` (the lower 16 rows one tile on) and Q's two column tiles at `q`, the
    /// smallest part first; the four 16 × 16 f32 tiles stored one after the other in `tmp`
    /// (rows of 64 bytes): rows 0-15 × columns 0-15, rows 0-15 × 16-31, rows 16-31 × 0-15,
    /// rows 16-31 × 16-31.
    ///
    /// # Safety
    /// Tiles configured on this thread ([`configure`]); the pointers valid for what they name.
    #[inline(always)]
    pub(super) unsafe fn scaled_group(
        a: *const u16,
        split_stride: usize,
        q: *const u16,
        tmp: *mut f32,
    ) {
        // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
        // the rows and tiles it names, the CPU has the kernel's features); the body only
        // reads and writes within them.
        unsafe {
            let a2 = a.add(split_stride);
            let a3 = a2.add(split_stride);
            asm!(
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "tileloadd tmm6, [{q0} + {s}*1]",
                "tileloadd tmm7, [{q1} + {s}*1]",
                "tileloadd tmm4, [{a3} + {s}*1]",
                "tileloadd tmm5, [{a3l} + {s}*1]",
                // each A tile is loaded again as soon as its two products are issued, while the
                // other's run (the same products, in the same order for each accumulator)
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a2} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm5, [{a2l} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tileloadd tmm4, [{a1} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm5, [{a1l} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tilestored [{t0} + {s}*1], tmm0",
                "tilestored [{t1} + {s}*1], tmm1",
                "tilestored [{t2} + {s}*1], tmm2",
                "tilestored [{t3} + {s}*1], tmm3",
                q0 = in(reg) q, q1 = in(reg) q.add(TILE),
                a1 = in(reg) a, a1l = in(reg) a.add(TILE),
                a2 = in(reg) a2, a2l = in(reg) a2.add(TILE),
                a3 = in(reg) a3, a3l = in(reg) a3.add(TILE),
                t0 = in(reg) tmp, t1 = in(reg) tmp.add(T * T),
                t2 = in(reg) tmp.add(2 * T * T), t3 = in(reg) tmp.add(3 * T * T),
                s = in(reg) 64usize,
                options(nostack)
            );
        }
    }

    /// `C[32, 32] (+)= Σ_chunks Σ_products A_part[32, 32] · W_part[32, 32]`: A's tiles at `a0`
    /// (part `s` at `a0 + s·split_stride`, chunk steps of two tiles, the lower 16 rows one tile
    /// on), W's tiles at `b` as packed by [`super::PackedBf16`], C f32 at row stride `ldc`.
    ///
    /// # Safety
    /// Tiles configured on this thread ([`configure`]); the pointers valid for what they name.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn block(
        nch: usize,
        splits: usize,
        a0: *const u16,
        split_stride: usize,
        b: *const u16,
        src: Option<super::CBlock>,
        dst: super::CBlock,
        next: (*const u16, *const u16),
    ) {
        // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
        // the rows and tiles it names, the CPU has the kernel's features); the body only
        // reads and writes within them.
        unsafe {
            load_sums(src);
            for ch in 0..nch {
                let bt = b.add(ch * splits * 2 * TILE);
                let a1 = a0.add(ch * 2 * TILE);
                // the next chunk's tiles (or the next block's first) into L1 while these multiply:
                // a tile load that misses L1 stalls the tile unit (measured: 15% of the time on
                // the first W load alone)
                let (na, nb) = if ch + 1 < nch {
                    (a1.add(2 * TILE), bt.add(splits * 2 * TILE))
                } else {
                    next
                };
                for sp in 0..splits {
                    prefetch(na.add(sp * split_stride), 2 * TILE);
                }
                prefetch(nb, splits * 2 * TILE);
                if splits == 1 {
                    chunk_one_part(a1, bt);
                } else {
                    chunk_three_parts(a1, split_stride, bt);
                }
            }
            store_sums(dst);
        }
    }

    /// The running sums of a 32 × 32 block into tmm0..tmm3 (columns 0..16 and 16..32 of rows
    /// 0..16, then of rows 16..32): loaded from `src`, or zero without one.
    ///
    /// # Safety
    /// Tiles configured on this thread; `src` valid for a `[32, 32]` f32 block.
    #[inline(always)]
    unsafe fn load_sums(src: Option<super::CBlock>) {
        // SAFETY: the caller's contract: tiles configured, `src` valid for the block it names.
        unsafe {
            if let Some(src) = src {
                let (c, cs) = (src.ptr, src.ld * 4);
                let c1 = c.add(T); // columns 16..32
                let c2 = c.add(T * src.ld); // rows 16..32
                let c3 = c2.add(T);
                asm!(
                    "tileloadd tmm0, [{c0} + {cs}*1]",
                    "tileloadd tmm1, [{c1} + {cs}*1]",
                    "tileloadd tmm2, [{c2} + {cs}*1]",
                    "tileloadd tmm3, [{c3} + {cs}*1]",
                    c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, cs = in(reg) cs,
                    options(nostack, readonly)
                );
            } else {
                asm!(
                    "tilezero tmm0",
                    "tilezero tmm1",
                    "tilezero tmm2",
                    "tilezero tmm3",
                    options(nostack, nomem)
                );
            }
        }
    }

    /// One chunk of one part: `tmm0..3 += A[32, 32] · W[32, 32]`, A's two row tiles at `a1`
    /// (rows 16..32 one tile on), W's two column tiles at `bt`.
    ///
    /// # Safety
    /// Tiles configured on this thread; `a1` and `bt` valid for two tiles each.
    #[inline(always)]
    unsafe fn chunk_one_part(a1: *const u16, bt: *const u16) {
        // A tile row stride in bytes; rows 16..32 of A: the next tile
        let (s_a, a_lo) = (64usize, TILE);
        // SAFETY: the caller's contract: tiles configured, the pointers valid for their tiles.
        unsafe {
            asm!(
                "tileloadd tmm4, [{a} + {sa}*1]",
                "tileloadd tmm5, [{a16} + {sa}*1]",
                "tileloadd tmm6, [{b0} + {sb}*1]",
                "tileloadd tmm7, [{b1} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a = in(reg) a1, a16 = in(reg) a1.add(a_lo), sa = in(reg) s_a,
                b0 = in(reg) bt, b1 = in(reg) bt.add(TILE), sb = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
    }

    /// One chunk of three parts: the six products of [`super::PRODUCTS3`] into `tmm0..3`, A's
    /// part `s` at `a1 + s·split_stride`, W's part `s`, half `h` at `bt + (s·2 + h)·TILE`.
    ///
    /// # Safety
    /// Tiles configured on this thread; the pointers valid for the parts' tiles.
    #[inline(always)]
    unsafe fn chunk_three_parts(a1: *const u16, split_stride: usize, bt: *const u16) {
        // A tile row stride in bytes; rows 16..32 of A: the next tile
        let (s_a, a_lo) = (64usize, TILE);
        // SAFETY: the caller's contract: tiles configured, the pointers valid for the parts'
        // tiles.
        unsafe {
            let a2 = a1.add(split_stride);
            let a3 = a2.add(split_stride);
            // W part s, half h at bt + (s·2 + h)·TILE; products smallest first:
            // x₁w₃, x₁w₂, x₁w₁, x₂w₁, x₃w₁, x₂w₂ (as PRODUCTS3)
            asm!(
                "tileloadd tmm4, [{a1} + {sa}*1]",
                "tileloadd tmm5, [{a1l} + {sa}*1]",
                "tileloadd tmm6, [{w3} + {sb}*1]",
                "tileloadd tmm7, [{w3h} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm6, [{w2} + {sb}*1]",
                "tileloadd tmm7, [{w2h} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm6, [{w1} + {sb}*1]",
                "tileloadd tmm7, [{w1h} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a2} + {sa}*1]",
                "tileloadd tmm5, [{a2l} + {sa}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a3} + {sa}*1]",
                "tileloadd tmm5, [{a3l} + {sa}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "tileloadd tmm4, [{a2} + {sa}*1]",
                "tileloadd tmm5, [{a2l} + {sa}*1]",
                "tileloadd tmm6, [{w2} + {sb}*1]",
                "tileloadd tmm7, [{w2h} + {sb}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a1 = in(reg) a1, a1l = in(reg) a1.add(a_lo),
                a2 = in(reg) a2, a2l = in(reg) a2.add(a_lo),
                a3 = in(reg) a3, a3l = in(reg) a3.add(a_lo),
                w1 = in(reg) bt, w1h = in(reg) bt.add(TILE),
                w2 = in(reg) bt.add(2 * TILE), w2h = in(reg) bt.add(3 * TILE),
                w3 = in(reg) bt.add(4 * TILE), w3h = in(reg) bt.add(5 * TILE),
                sa = in(reg) s_a, sb = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
    }

    /// tmm0..tmm3 stored into the block `dst` (as [`load_sums`] reads it).
    ///
    /// # Safety
    /// Tiles configured on this thread; `dst` valid for a `[32, 32]` f32 block.
    #[inline(always)]
    unsafe fn store_sums(dst: super::CBlock) {
        // SAFETY: the caller's contract: tiles configured, `dst` valid for the block it names.
        unsafe {
            let (c, cs) = (dst.ptr, dst.ld * 4);
            let c1 = c.add(T);
            let c2 = c.add(T * dst.ld);
            let c3 = c2.add(T);
            asm!(
                "tilestored [{c0} + {cs}*1], tmm0",
                "tilestored [{c1} + {cs}*1], tmm1",
                "tilestored [{c2} + {cs}*1], tmm2",
                "tilestored [{c3} + {cs}*1], tmm3",
                c0 = in(reg) c, c1 = in(reg) c1, c2 = in(reg) c2, c3 = in(reg) c3, cs = in(reg) cs,
                options(nostack)
            );
        }
    }
}

/// The tile kernel's own rate in GFLOP/s over all of rayon's threads (bf16 multiply-adds on
/// data in L1 for about `seconds`): the ceiling of [`gemm`] with one part; three parts do six
/// such products per output, so their ceiling is a sixth of this. The data are not zeros: the
/// tile unit runs measurably faster on zeros (here 4.4-5.2 against 3.0 TFLOP/s).
pub fn kernel_peak_gflops(seconds: f64) -> f64 {
    assert!(available(), "AMX is not available on this CPU");
    let threads = rayon::current_num_threads();
    (0..threads)
        .into_par_iter()
        .map(|t| {
            let nch = 8;
            let mut a = Bf16Buf::zeros(MB * nch * KT);
            a.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = bf16(((i * 7919) % 1000) as f32 * 1e-3 - 0.5));
            let mut b = Bf16Buf::zeros(nch * 2 * TILE);
            b.as_mut_slice().iter_mut().enumerate().for_each(|(i, x)| {
                *x = bf16(((i * 104729) % 1000) as f32 * 1e-4 - 0.05 + t as f32 * 1e-6)
            });
            let mut c = vec![0f32; MB * NP];
            let start = std::time::Instant::now();
            let mut calls = 0u64;
            // SAFETY: AMX is available; the buffers hold what block reads and writes.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                tiles::configure();
                while start.elapsed().as_secs_f64() < seconds {
                    let cb = CBlock {
                        ptr: c.as_mut_ptr(),
                        ld: NP,
                    };
                    for _ in 0..256 {
                        tiles::block(
                            nch,
                            1,
                            a.as_slice().as_ptr(),
                            0,
                            b.as_slice().as_ptr(),
                            Some(cb),
                            cb,
                            (a.as_slice().as_ptr(), b.as_slice().as_ptr()),
                        );
                    }
                    calls += 256;
                }
                tiles::release();
            }
            std::hint::black_box(c[0]);
            2.0 * (MB * NP * nch * KT) as f64 * calls as f64 / start.elapsed().as_secs_f64()
        })
        .sum::<f64>()
        / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The engines this machine runs: the emulation always, the tiles where AMX is available
    /// (said on stderr, so a run without them is visible).
    pub(super) fn engines() -> Vec<Engine> {
        if available() {
            vec![Engine::Emulated, Engine::Tiles]
        } else {
            eprintln!("AMX tiles not available here: checking the emulation of tdpbf16ps only");
            vec![Engine::Emulated]
        }
    }

    #[test]
    fn three_bf16_parts_sum_to_the_f32() {
        let mut rng = crate::reference::Rng::new(3);
        for (i, x) in rng.normals(100_000, 1.0).into_iter().enumerate() {
            let x = x * 10f32.powi((i % 13) as i32 - 6);
            let p = split(x, 3);
            // largest part first, each within half an ulp of bf16 of what remains
            let sum = f32_of(p[2]) + f32_of(p[1]) + f32_of(p[0]);
            assert_eq!(sum, x, "{x:e} split as {p:?}");
        }
        assert_eq!(bf16(1.0), 0x3f80);
        assert_eq!(bf16(f32::from_bits(0x3f80_8000)), 0x3f80, "ties go to even");
        assert_eq!(bf16(f32::from_bits(0x3f81_8000)), 0x3f82, "ties go to even");
        assert!(f32_of(bf16(f32::NAN)).is_nan());
    }

    #[test]
    fn a_is_laid_out_as_each_values_parts_in_its_tile_rows() {
        // odd k (a partial last chunk), a partial last block, a row stride wider than k, and
        // values of every size (tiny, subnormal, huge, signed zero, infinite)
        let (m, k, lda) = (37, 45, 50);
        let mut rng = crate::reference::Rng::new(9);
        let mut a: Vec<f32> = rng
            .normals(m * lda, 1.0)
            .into_iter()
            .enumerate()
            .map(|(i, x)| x * 10f32.powi((i % 11) as i32 - 5))
            .collect();
        for (i, x) in [1e-39f32, -3e-42, f32::MAX, -0.0, f32::INFINITY, 1e30]
            .into_iter()
            .enumerate()
        {
            a[i * 7 + 3] = x;
        }
        for splits in [1, 3] {
            let mut buf = Bf16Buf::zeros(1);
            split_a(&mut buf, &a, lda, m, k, splits);
            let chunks = k.div_ceil(KT);
            let block_len = splits * chunks * 2 * TILE;
            let got = buf.as_slice();
            for r in 0..m.div_ceil(MB) * MB {
                for i in 0..chunks * KT {
                    let want = if r < m && i < k {
                        split(a[r * lda + i], splits)
                    } else {
                        [0; 3]
                    };
                    let (b, half, rr, c) = (r / MB, (r % MB) / T, r % T, i / KT);
                    for (sp, &w) in want.iter().enumerate().take(splits) {
                        let at = b * block_len
                            + ((sp * chunks + c) * 2 + half) * TILE
                            + rr * KT
                            + i % KT;
                        assert_eq!(got[at], w, "splits {splits} row {r} column {i} part {sp}");
                    }
                }
            }
        }
    }

    fn check(m: usize, k: usize, n: usize, splits: usize, seed: u64) {
        let mut rng = crate::reference::Rng::new(seed);
        let a = rng.normals(m * k, 1.0);
        let w = rng.normals(n * k, 1.0);
        let want = crate::kernels::naive_product(&a, m, k, &w, n);
        // Σ|a·w| per output: the scale of the rounding error of any f32 summation
        let aa: Vec<f32> = a.iter().map(|x| x.abs()).collect();
        let wa: Vec<f32> = w.iter().map(|x| x.abs()).collect();
        let mass = crate::kernels::naive_product(&aa, m, k, &wa, n);
        let packed = PackedBf16::from_rows(&w, n, k, k, splits);
        for j in [0, n / 2, n - 1] {
            let col = packed.column(j);
            for (kk, (&x, &y)) in col.iter().zip(&w[j * k..(j + 1) * k]).enumerate() {
                let tol = if splits == 3 { 0.0 } else { y.abs() / 256.0 };
                assert!((x - y).abs() <= tol, "column {j} row {kk}: {x} vs {y}");
            }
        }
        let ldc = n + 3;
        let mut results = Vec::new();
        for engine in engines() {
            for accumulate in [false, true] {
                let base = if accumulate { 1.5f32 } else { f32::NAN };
                let mut c = vec![base; m * ldc];
                gemm_with(engine, &a, k, m, &packed, &mut c, ldc, accumulate);
                for i in 0..m {
                    for j in 0..n {
                        let want = want[i * n + j] + if accumulate { 1.5 } else { 0.0 };
                        let got = c[i * ldc + j] as f64;
                        let err = (got - want).abs();
                        // bf16x3: within the worst-case bound of an f32 sum of its 6k
                        // products, (6k + 2)·2⁻²⁴·Σ|a·w| (each product exact, each addition
                        // rounded); bf16: each operand to 2⁻⁹, a k-term sum of such errors
                        let tol = if splits == 3 {
                            (6 * k + 2) as f64 * 2f64.powi(-24) * mass[i * n + j]
                                + if accumulate { 1e-7 } else { 0.0 }
                        } else {
                            0.02 * (k as f64).sqrt()
                        };
                        assert!(
                            err <= tol,
                            "{engine:?} splits {splits} m={m} k={k} n={n} acc={accumulate} at ({i},{j}): {got} vs {want}"
                        );
                    }
                    for j in n..ldc {
                        assert!(
                            c[i * ldc + j].to_bits() == base.to_bits(),
                            "{engine:?} wrote past column n at ({i},{j})"
                        );
                    }
                }
                results.push(c);
            }
        }
        // the tiles and their emulation: the same products on the same packed data (the
        // hardware may round a pair's two products once)
        if let [e0, _, t0, _] = &results[..] {
            for i in 0..m {
                for j in 0..n {
                    let (x, y) = (e0[i * ldc + j], t0[i * ldc + j]);
                    let tol = 2.0 * (6 * k + 2) as f64 * 2f64.powi(-24) * mass[i * n + j];
                    assert!(
                        ((x - y).abs() as f64) <= tol,
                        "tiles vs emulation at ({i},{j}): {y} vs {x}"
                    );
                }
            }
        }
    }

    #[test]
    fn tile_products_match_a_naive_product_on_awkward_shapes() {
        for (i, &(m, k, n)) in [
            (1, 1, 1),
            (5, 31, 17),
            (32, 32, 32),
            (33, 64, 31),
            (70, 100, 65),
            (64, 1100, 96),
            (300, 96, 40),
        ]
        .iter()
        .enumerate()
        {
            for splits in [1, 3] {
                check(m, k, n, splits, i as u64 * 7 + splits as u64);
            }
        }
    }
}
