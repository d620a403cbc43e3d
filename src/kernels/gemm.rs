//! f32 matrix multiplication at the machine's rate: `C = A · B` with `B` packed once into panels
//! of `NR` columns, `A` packed per block into strips of `MR` rows, and a register-blocked
//! micro-kernel (MR × NR accumulators held in vector registers) for AVX-512, AVX2+FMA, or plain
//! code, chosen at run time ([`Isa::detect`]), so one binary runs on every x86-64 machine.
//!
//! The structure is the one of GotoBLAS/BLIS [Goto & van de Geijn 2008, "Anatomy of
//! high-performance matrix multiplication"; Van Zee & van de Geijn 2015, BLIS]: a `KC`-deep slice
//! of one B panel stays in L1 while the kernel walks the A strips of a block held in L2.
//!
//! Weights are packed at load ([`PackedB::from_rows`], from `W: [n, k]`, the `y = x Wᵀ` layout of
//! every checkpoint); the attention packs its keys the same way and its values with
//! [`PackedB::from_cols`] (`B: [k, n]`). Every product is an ordinary f32 sum of products, in
//! another order than a naive loop: results agree with it to rounding (~1e-6 relative).

use super::SendPtr;
use rayon::prelude::*;

/// The instruction set of the micro-kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// 12 × 32 tile, 24 zmm accumulators
    Avx512,
    /// 6 × 16 tile, 12 ymm accumulators
    Avx2,
    /// 4 × 8 tile, plain Rust (any machine)
    Scalar,
}

impl Isa {
    /// The kernel this process runs: the best this CPU runs, or the one `ATTNSCOPE_ISA` forces
    /// (`avx512`, `avx2`, `scalar`; one the CPU lacks is refused: [`super::select`]).
    pub fn detect() -> Isa {
        super::select::kernels().gemm
    }

    /// The widest kernel this CPU runs.
    pub(crate) fn best() -> Isa {
        if Isa::Avx512.supported() {
            Isa::Avx512
        } else if Isa::Avx2.supported() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Whether this CPU can run the kernel.
    pub fn supported(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
            }
            #[cfg(not(target_arch = "x86_64"))]
            Isa::Avx512 | Isa::Avx2 => false,
            Isa::Scalar => true,
        }
    }

    /// Every kernel this CPU runs (for tests).
    pub fn all_supported() -> Vec<Isa> {
        [Isa::Avx512, Isa::Avx2, Isa::Scalar]
            .into_iter()
            .filter(|i| i.supported())
            .collect()
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2 => "avx2+fma",
            Isa::Scalar => "scalar",
        }
    }

    /// Rows of the micro-tile.
    pub const fn mr(self) -> usize {
        match self {
            Isa::Avx512 => 12,
            Isa::Avx2 => 6,
            Isa::Scalar => 4,
        }
    }

    /// Columns of the micro-tile (= the width of a B panel).
    pub const fn nr(self) -> usize {
        match self {
            Isa::Avx512 => 32,
            Isa::Avx2 => 16,
            Isa::Scalar => 8,
        }
    }

    /// Depth of one slice of B. AVX2: a `KC × NR` slice stays in L1 (24 KiB). AVX-512: 1,024
    /// deep (128 KiB, served from L2, whose bandwidth feeds the 12 × 32 tile with room to spare),
    /// so the model's k = 896 products write C once instead of four times: measured on a 2-core
    /// Xeon (48 KiB L1, 2 MiB L2), gate|up at 2,048 tokens went from 213-258 to 259-287 GFLOP/s
    /// and the forward from 8.4-8.9 s to 8.1-8.6 s against 256.
    const fn kc(self) -> usize {
        match self {
            Isa::Avx512 => 1024,
            Isa::Avx2 => 384,
            Isa::Scalar => 256,
        }
    }

    /// The micro-kernel: `C[MR, NR] (+)= Apacked[kc, MR]ᵀ · Bpacked[kc, NR]`.
    ///
    /// # Safety
    /// `a` holds `kc · MR` and `b` `kc · NR` floats; `c` is valid for MR rows of NR floats with
    /// row stride `ldc`; the CPU supports `self`.
    #[inline]
    unsafe fn kernel(
        self,
        kc: usize,
        a: *const f32,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
        // the rows and tiles it names, the CPU has the kernel's features); the body only
        // reads and writes within them.
        unsafe {
            match self {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => x86::kernel_avx512::<false>(kc, a, 0, b, c, ldc, accumulate),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::kernel_avx2::<false>(kc, a, 0, b, c, ldc, accumulate),
                _ => kernel_scalar::<false>(kc, a, 0, b, c, ldc, accumulate),
            }
        }
    }

    /// The micro-kernel reading A in place: row `r` of the strip at `a + r·lda`, `kc` values
    /// each (no packing; the rows are contiguous and few, so the caches stream them well).
    ///
    /// # Safety
    /// As [`Isa::kernel`], with `a` valid for MR rows of `kc` floats at stride `lda`.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    unsafe fn kernel_rows(
        self,
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
    ) {
        // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
        // the rows and tiles it names, the CPU has the kernel's features); the body only
        // reads and writes within them.
        unsafe {
            match self {
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 => x86::kernel_avx512::<true>(kc, a, lda, b, c, ldc, accumulate),
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => x86::kernel_avx2::<true>(kc, a, lda, b, c, ldc, accumulate),
                _ => kernel_scalar::<true>(kc, a, lda, b, c, ldc, accumulate),
            }
        }
    }
}

/// A `[k, n]` right-hand matrix packed into panels of `NR` columns (zero-padded): panel `p`
/// holds, for each `kk` in `0..k`, the `NR` values `B[kk, p·NR .. p·NR + NR]`.
#[derive(Clone)]
pub struct PackedB {
    pub k: usize,
    pub n: usize,
    pub isa: Isa,
    buf: Panels,
}

/// Where packed panels live (f32 for [`PackedB`], bf16 bits for the AMX kernel's): their own
/// buffer, or a read-only mapping of a file that holds them in the same layout (the
/// packed-weight cache, [`crate::model::panels`]).
#[derive(Clone)]
pub(crate) enum Panels<T = f32> {
    Owned(AlignedBuf<T>),
    Mapped {
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        len: usize,
    },
}

impl<T: Copy + Default + bytemuck::Pod> Panels<T> {
    /// `len` values of `T` at `offset` in `map`, if they lie inside it and start on a 64-byte
    /// boundary of the file (mappings start on a page).
    pub(crate) fn mapped(
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        len: usize,
    ) -> Option<Self> {
        let end = offset.checked_add(len.checked_mul(std::mem::size_of::<T>())?)?;
        (end <= map.len() && offset.is_multiple_of(64)).then_some(Panels::Mapped {
            map,
            offset,
            len,
        })
    }

    pub(crate) fn as_slice(&self) -> &[T] {
        match self {
            Panels::Owned(b) => b.as_slice(),
            // `mapped` checked that the values lie inside the mapping, on a 64-byte boundary; the
            // mapping is read-only and lives as long as this Arc
            Panels::Mapped { map, offset, len } => {
                bytemuck::cast_slice(&map[*offset..*offset + *len * std::mem::size_of::<T>()])
            }
        }
    }

    /// The values as bytes (native-endian), as a cache file stores them.
    pub(crate) fn as_bytes(&self) -> &[u8] {
        bytemuck::cast_slice(self.as_slice())
    }

    pub(crate) fn is_mapped(&self) -> bool {
        matches!(self, Panels::Mapped { .. })
    }
}

/// A buffer (f32 by default; bf16 bits for the AMX kernel) whose data starts on a 64-byte
/// boundary (one cache line, one zmm load).
#[derive(Clone, Default)]
pub struct AlignedBuf<T = f32> {
    raw: Vec<T>,
    off: usize,
    len: usize,
}

impl<T: Copy + Default> AlignedBuf<T> {
    /// Elements in 64 bytes: the slack that lets the data start on a boundary.
    const SLACK: usize = 64 / std::mem::size_of::<T>();

    fn aligned_offset(raw: &[T]) -> usize {
        (64 - (raw.as_ptr() as usize % 64)) % 64 / std::mem::size_of::<T>()
    }
    pub fn zeros(len: usize) -> Self {
        let raw = vec![T::default(); len + Self::SLACK];
        let off = Self::aligned_offset(&raw);
        AlignedBuf { raw, off, len }
    }
    pub fn as_slice(&self) -> &[T] {
        &self.raw[self.off..self.off + self.len]
    }
    pub fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.raw[self.off..self.off + self.len]
    }
    /// Elements held.
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Makes room for `len` elements (contents unspecified), reusing the allocation when it can.
    pub fn ensure(&mut self, len: usize) {
        if self.raw.len() < len + Self::SLACK {
            *self = AlignedBuf::zeros(len);
        } else {
            self.off = Self::aligned_offset(&self.raw);
            self.len = len;
        }
    }
}

/// Writes `cols` rows of `w: [cols, k]` as a panel `[k, nr]`: `panel[kk·nr + j] = w[j·k + kk]`
/// (columns `cols..nr` untouched). 16×16 blocks go through AVX-512 shuffles where the CPU has
/// them (the scalar loop's strided reads took 14% of a short `inspect`'s time at load).
pub(crate) fn transpose_into_panel(w: &[f32], cols: usize, k: usize, nr: usize, panel: &mut [f32]) {
    assert!(w.len() >= cols * k && panel.len() >= k * nr && cols <= nr);
    let (mut j_done, mut k_done) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::simd::current() == crate::kernels::simd::Level::Avx512 {
        (j_done, k_done) = (cols / 16 * 16, k / 16 * 16);
        for j0 in (0..j_done).step_by(16) {
            for kk0 in (0..k_done).step_by(16) {
                // SAFETY: the CPU has AVX-512 (checked above); rows j0..j0 + 16 of w hold
                // columns kk0..kk0 + 16, and panel rows kk0..kk0 + 16 hold columns j0..j0 + 16
                // (lengths asserted above).
                unsafe {
                    x86::transpose16x16(
                        w.as_ptr().add(j0 * k + kk0),
                        k,
                        panel.as_mut_ptr().add(kk0 * nr + j0),
                        nr,
                    )
                }
            }
        }
    }
    for (kk, dst) in panel.chunks_mut(nr).take(k).enumerate() {
        // what the blocks left: columns from j_done, and every column of rows from k_done
        let from = if kk < k_done { j_done } else { 0 };
        for (j, d) in dst[..cols].iter_mut().enumerate().skip(from) {
            *d = w[j * k + kk];
        }
    }
}

impl PackedB {
    /// An all-zero `B: [k, n]`, to be filled in place column by column through
    /// [`PackedB::set_columns`] (its pages are touched only as they are written).
    pub fn zeros(k: usize, n: usize, isa: Isa) -> PackedB {
        let panels = n.div_ceil(isa.nr());
        PackedB {
            k,
            n,
            isa,
            buf: Panels::Owned(AlignedBuf::zeros(panels * k * isa.nr())),
        }
    }

    /// Columns `first..first + cols.len() / k` of `B` set to (`subtract`: less) the rows of
    /// `cols` (`[count, k]`, column j of B as row j): the transpose written straight into the
    /// panels, so a `B` that arrives a few columns at a time is never held unpacked.
    pub fn set_columns(&mut self, first: usize, cols: &[f32], subtract: bool) {
        let (k, nr) = (self.k, self.isa.nr());
        let count = cols.len() / k.max(1);
        assert!(first + count <= self.n && cols.len() == count * k);
        let Panels::Owned(buf) = &mut self.buf else {
            panic!("a mapped PackedB cannot be written")
        };
        // rows of B in chunks; within a row, the columns' values (a cache line or two of the
        // panels) written together from the rows of `cols` they come from
        const CHUNK: usize = 64;
        let at: Vec<usize> = (first..first + count)
            .map(|u| (u / nr) * k * nr + u % nr)
            .collect();
        let base = SendPtr(buf.as_mut_slice().as_mut_ptr());
        (0..k.div_ceil(CHUNK))
            .into_par_iter()
            .with_min_len(16)
            .for_each(|c| {
                for kk in c * CHUNK..((c + 1) * CHUNK).min(k) {
                    for (i, &a) in at.iter().enumerate() {
                        let v = cols[i * k + kk];
                        // SAFETY: `a + kk·nr` < panels·k·nr (u < n, kk < k); the chunks of kk
                        // are disjoint, so no two threads write one element
                        unsafe {
                            let d = base.get().add(a + kk * nr);
                            *d = if subtract { *d - v } else { v };
                        }
                    }
                }
            });
    }

    /// Packs `W: [n, k]` row-major (row stride `ldw`) as the right-hand side of `x · Wᵀ`.
    pub fn from_rows(w: &[f32], n: usize, k: usize, ldw: usize, isa: Isa) -> PackedB {
        assert!(
            n == 0 || w.len() >= (n - 1) * ldw + k,
            "W is too short for [{n}, {k}]"
        );
        Self::pack(n, k, isa, |col, kk| w[col * ldw + kk], true)
    }

    /// Packs `B: [k, n]` row-major (row stride `ldb`).
    pub fn from_cols(b: &[f32], k: usize, n: usize, ldb: usize, isa: Isa) -> PackedB {
        assert!(
            k == 0 || b.len() >= (k - 1) * ldb + n,
            "B is too short for [{k}, {n}]"
        );
        Self::pack(n, k, isa, |col, kk| b[kk * ldb + col], false)
    }

    /// Packs `W: [n, k]` whose rows come from `rows(r0, out)`, which writes rows `r0..r0 +
    /// out.len() / k` into `out`, row-major. Each panel's rows go through a small buffer of the
    /// worker thread, so W is never held whole, unpacked, as f32: a model loads with one copy of
    /// its weights, not two (measured on the default model: 350k fewer page faults at load).
    pub fn try_from_row_source<E: Send>(
        n: usize,
        k: usize,
        isa: Isa,
        rows: impl Fn(usize, &mut [f32]) -> std::result::Result<(), E> + Sync,
    ) -> std::result::Result<PackedB, E> {
        let nr = isa.nr();
        let panels = n.div_ceil(nr);
        let mut buf = AlignedBuf::zeros(panels * k * nr);
        super::fill_panels(
            buf.as_mut_slice(),
            k * nr,
            nr,
            (n, k),
            rows,
            |cols, w, panel| transpose_into_panel(w, cols, k, nr, panel),
        )?;
        Ok(PackedB {
            k,
            n,
            isa,
            buf: Panels::Owned(buf),
        })
    }

    fn pack(
        n: usize,
        k: usize,
        isa: Isa,
        at: impl Fn(usize, usize) -> f32 + Sync,
        rows_layout: bool,
    ) -> PackedB {
        let nr = isa.nr();
        let panels = n.div_ceil(nr);
        let mut buf = AlignedBuf::zeros(panels * k * nr);
        let fill = |(p, panel): (usize, &mut [f32])| {
            let cols = nr.min(n - p * nr);
            if rows_layout {
                // walk each source row once (contiguous reads)
                for j in 0..cols {
                    for kk in 0..k {
                        panel[kk * nr + j] = at(p * nr + j, kk);
                    }
                }
            } else {
                for kk in 0..k {
                    for j in 0..cols {
                        panel[kk * nr + j] = at(p * nr + j, kk);
                    }
                }
            }
        };
        if k * n >= 1 << 16 {
            buf.as_mut_slice()
                .par_chunks_mut((k * nr).max(1))
                .enumerate()
                .for_each(fill);
        } else {
            buf.as_mut_slice()
                .chunks_mut((k * nr).max(1))
                .enumerate()
                .for_each(fill);
        }
        PackedB {
            k,
            n,
            isa,
            buf: Panels::Owned(buf),
        }
    }

    /// Floats a `[k, n]` matrix packed for `isa` takes (whole zero-padded panels).
    pub fn packed_len(n: usize, k: usize, isa: Isa) -> usize {
        n.div_ceil(isa.nr()) * k * isa.nr()
    }

    /// A `[k, n]` matrix whose panels (as [`PackedB::as_bytes`] gave them for `isa`) lie at
    /// `offset` in `map`. `None` if they would not fit there or the offset is not 64-byte
    /// aligned: the caller packs the matrix anew.
    pub fn from_mapped(
        map: std::sync::Arc<memmap2::Mmap>,
        offset: usize,
        n: usize,
        k: usize,
        isa: Isa,
    ) -> Option<PackedB> {
        let buf = Panels::mapped(map, offset, Self::packed_len(n, k, isa))?;
        isa.supported().then_some(PackedB { k, n, isa, buf })
    }

    /// The panels as bytes (native-endian f32), as a cache file stores them.
    pub fn as_bytes(&self) -> &[u8] {
        self.buf.as_bytes()
    }

    /// Whether the panels are read from a mapped file rather than held in memory of their own.
    pub fn is_mapped(&self) -> bool {
        self.buf.is_mapped()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.buf.as_slice().len() * 4
    }

    fn panel(&self, p: usize) -> &[f32] {
        let sz = self.k * self.isa.nr();
        &self.buf.as_slice()[p * sz..(p + 1) * sz]
    }

    /// Column `j`'s values, unpacked (for tests and the rare caller that needs them back).
    pub fn column(&self, j: usize) -> Vec<f32> {
        let nr = self.isa.nr();
        let panel = self.panel(j / nr);
        (0..self.k).map(|kk| panel[kk * nr + j % nr]).collect()
    }
}

thread_local! {
    static A_PACK: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::default());
    /// A task's depth slice of B's panels, made by a [`PanelSource`] just before it is multiplied.
    static B_PACK: std::cell::RefCell<AlignedBuf> = std::cell::RefCell::new(AlignedBuf::default());
}

/// A right-hand matrix `B: [k, n]` whose panels are made on demand rather than held packed
/// (`--memory low`: a quantized file's blocks dequantized a depth slice at a time). The product
/// asks for each panel's slice once per task and multiplies the same micro-kernel over it, so
/// the numbers are those of a [`PackedB`] holding the same values.
pub trait PanelSource: Sync {
    /// `(n, k)`: B's columns (the weight's rows) and depth.
    fn dims(&self) -> (usize, usize);
    /// Writes rows `k0..k0 + kc` of panel `p` (B's columns `p·NR..p·NR + NR`, `NR = isa.nr()`)
    /// into `out` (`kc · NR` floats, row `kk` at `kk · NR`); columns past `n` must be zero.
    fn fill(&self, isa: Isa, p: usize, k0: usize, kc: usize, out: &mut [f32]);
}

/// B as a product reads it: packed panels, or a source that makes them per depth slice.
#[derive(Clone, Copy)]
enum BRef<'a> {
    Packed(&'a PackedB),
    Source(&'a dyn PanelSource, Isa),
}

impl BRef<'_> {
    fn isa(self) -> Isa {
        match self {
            BRef::Packed(b) => b.isa,
            BRef::Source(_, isa) => isa,
        }
    }
    /// `(k, n)`.
    fn shape(self) -> (usize, usize) {
        match self {
            BRef::Packed(b) => (b.k, b.n),
            BRef::Source(s, _) => {
                let (n, k) = s.dims();
                (k, n)
            }
        }
    }
}

/// [`gemm_sub`] with B's panels made by `src` a depth slice at a time, into a buffer of the
/// worker thread (`KC × NC` floats: at most ~4 MB on AVX-512), just before they are multiplied.
#[allow(clippy::too_many_arguments)]
pub fn gemm_source(
    a: &[f32],
    lda: usize,
    m: usize,
    src: &dyn PanelSource,
    isa: Isa,
    ks: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    gemm_on(
        a,
        lda,
        m,
        BRef::Source(src, isa),
        ks,
        cols,
        c,
        ldc,
        accumulate,
        parallel,
    )
}

/// `C[m, n] (+)= A[m, k] · B` where `A` is row-major with row stride `lda` and `C` row-major with
/// row stride `ldc`. Runs on every core of rayon's pool when the product is large enough.
pub fn gemm(
    a: &[f32],
    lda: usize,
    m: usize,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    gemm_sub(a, lda, m, b, 0..b.k, 0..b.n, c, ldc, accumulate, true)
}

/// A sub-product: `C[m, cols.len()] (+)= A[m, ks.len()] · B[ks, cols]`. Column `j` of C is
/// column `cols.start + j` of B, and column `p` of A meets row `ks.start + p` of B. Runs on
/// the calling thread only when `parallel` is false (for callers that already run in parallel,
/// such as the attention over heads).
#[allow(clippy::too_many_arguments)]
pub fn gemm_sub(
    a: &[f32],
    lda: usize,
    m: usize,
    b: &PackedB,
    ks: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    gemm_on(
        a,
        lda,
        m,
        BRef::Packed(b),
        ks,
        cols,
        c,
        ldc,
        accumulate,
        parallel,
    )
}

#[allow(clippy::too_many_arguments)]
fn gemm_on(
    a: &[f32],
    lda: usize,
    m: usize,
    b: BRef,
    ks: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) {
    let isa = b.isa();
    let (k, n) = (ks.len(), cols.len());
    let (bk, bn) = b.shape();
    assert!(
        ks.end <= bk && cols.end <= bn,
        "gemm_sub: ranges {ks:?} × {cols:?} outside B [{bk}, {bn}]"
    );
    if m == 0 || n == 0 {
        return;
    }
    super::check_operands((a, lda), (c, ldc), (m, k, n));
    assert!(
        isa.supported(),
        "the {} kernel does not run on this CPU",
        isa.name()
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                c[r * ldc..r * ldc + n].iter_mut().for_each(|x| *x = 0.0);
            }
        }
        return;
    }
    let (mr, nr) = (isa.mr(), isa.nr());
    let threads = if parallel {
        rayon::current_num_threads()
    } else {
        1
    };
    let (mc, group, nc) = plan(m, n, mr, nr, threads);
    let row_blocks = m.div_ceil(group);
    let col_chunks = n.div_ceil(nc);
    let tasks = row_blocks * col_chunks;
    let cp = SendPtr(c.as_mut_ptr());
    let run = |t: usize| {
        let (ib, jb) = (t / col_chunks, t % col_chunks);
        let (i0, j0) = (ib * group, jb * nc);
        let (rows, ncols) = (group.min(m - i0), nc.min(n - j0));
        // SAFETY: task t owns rows i0..i0+rows × columns j0..j0+ncols of C, disjoint from every
        // other task's; bounds were checked above.
        unsafe {
            block(
                a,
                lda,
                i0,
                rows,
                mc,
                b,
                ks.start,
                k,
                cols.start + j0,
                ncols,
                cp,
                j0,
                ldc,
                accumulate,
            )
        };
    };
    let flops = 2.0 * m as f64 * n as f64 * k as f64;
    if parallel && tasks > 1 && flops > 2e6 {
        (0..tasks).into_par_iter().for_each(run);
    } else {
        (0..tasks).for_each(run);
    }
}

/// How C is cut into tasks: `(mc, group, nc)`: row blocks of up to `16·MR` rows (an A block
/// stays in L2), tasks of `group` rows (whole blocks, at most 2,048 rows, so a task reads its B
/// columns from memory once per 2,048 rows) and `nc` columns (whole panels, at most ~1,024: a
/// `KC × NC` slice of B stays in L2). Tasks are made equal and numerous enough for every
/// thread, their count a multiple of the thread count where the panels allow, so no thread
/// idles at the end (measured: the down projection on 575 rows made 3 tasks for 2 threads).
fn plan(m: usize, n: usize, mr: usize, nr: usize, threads: usize) -> (usize, usize, usize) {
    let blocks = m.div_ceil(mr * 16);
    // equal row blocks, rounded up to whole strips
    let mc = m.div_ceil(blocks).div_ceil(mr) * mr;
    let blocks = m.div_ceil(mc);
    let groups = m.div_ceil(2048).min(blocks);
    let group = blocks.div_ceil(groups) * mc;
    let groups = m.div_ceil(group);
    let panels = n.div_ceil(nr);
    let mut c = n.div_ceil(1024).clamp(1, panels);
    if threads > 1 {
        // the chunks that asking for c of them makes (whole panels, one width)
        let chunks = |c: usize| panels.div_ceil(panels.div_ceil(c));
        while groups * chunks(c) < 2 * threads && c < panels {
            c += 1;
        }
        c = chunks(c);
        // equal chunks (c divides the panels into chunks of one width) whose count balances
        if let Some(even) = (c..=(2 * c).min(panels)).find(|&x| {
            (groups * x).is_multiple_of(threads) && panels.div_ceil(panels.div_ceil(x)) == x
        }) {
            c = even;
        }
        // too few tasks along the columns: split the rows further
        let mut groups_ = groups;
        let mut group_ = group;
        while groups_ * c < 2 * threads && group_ > mc {
            group_ = (group_ / 2).div_ceil(mc) * mc;
            groups_ = m.div_ceil(group_);
        }
        return (mc, group_, panels.div_ceil(c) * nr);
    }
    (mc, group, panels.div_ceil(c) * nr)
}

/// One task: rows `r0..r0+rows` of A and C × B columns `bj0..bj0+cols` (C columns
/// `cj0..cj0+cols`), over B rows `k0..k0+k`. Loop order (BLIS): depth slices outside, row
/// blocks of `mc` inside, so a `KC`-deep slice of the task's B columns is read from memory once
/// and then served from L2 to every row block of the task.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    a: &[f32],
    lda: usize,
    r0: usize,
    rows: usize,
    mc: usize,
    b: BRef,
    k0: usize,
    k: usize,
    bj0: usize,
    cols: usize,
    c: SendPtr,
    cj0: usize,
    ldc: usize,
    accumulate: bool,
) {
    let ops = Operands {
        a,
        lda,
        b,
        k0,
        bj0,
        cols,
        c,
        cj0,
        ldc,
        isa: b.isa(),
    };
    // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
    // the rows and tiles it names, the CPU has the kernel's features); the body only
    // reads and writes within them.
    unsafe {
        let kc_max = ops.isa.kc();
        A_PACK.with(|cell| {
            B_PACK.with(|bcell| {
                let mut apack = cell.borrow_mut();
                let mut bpack = bcell.borrow_mut();
                let mut tile = [0f32; 12 * 32];
                let mut pc = 0;
                while pc < k {
                    let kc = kc_max.min(k - pc);
                    let acc = accumulate || pc > 0;
                    if let BRef::Source(src, _) = b {
                        ops.pack_b_slice(src, k0 + pc, kc, &mut bpack);
                    }
                    let mut i0 = r0;
                    while i0 < r0 + rows {
                        let brows = mc.min(r0 + rows - i0);
                        let rb = RowBlock {
                            i0,
                            brows,
                            pc,
                            kc,
                            acc,
                        };
                        ops.row_block(rb, &mut apack, &bpack, &mut tile);
                        i0 += brows;
                    }
                    pc += kc;
                }
            })
        });
    }
}

/// What one task of [`block`] multiplies: A (rows at stride `lda`), B's columns
/// `bj0..bj0 + cols` from its row `k0`, into C's columns `cj0..` at row stride `ldc`.
#[derive(Clone, Copy)]
struct Operands<'a> {
    a: &'a [f32],
    lda: usize,
    b: BRef<'a>,
    k0: usize,
    bj0: usize,
    cols: usize,
    c: SendPtr,
    cj0: usize,
    ldc: usize,
    isa: Isa,
}

/// One block of A's rows over one depth slice: rows `i0..i0 + brows`, B rows `pc..pc + kc`
/// (from the task's `k0`); `acc`: C's values are added to (else overwritten).
#[derive(Clone, Copy)]
struct RowBlock {
    i0: usize,
    brows: usize,
    pc: usize,
    kc: usize,
    acc: bool,
}

impl Operands<'_> {
    /// The B panels of the task's columns, B rows `k..k + kc`, made once into `bpack` and read
    /// by every row block of the slice.
    #[inline(always)]
    fn pack_b_slice(&self, src: &dyn PanelSource, k: usize, kc: usize, bpack: &mut AlignedBuf) {
        let nr = self.isa.nr();
        let p0 = self.bj0 / nr;
        let panels = (self.bj0 + self.cols).div_ceil(nr) - p0;
        bpack.ensure(panels * kc * nr);
        for (i, out) in bpack.as_mut_slice().chunks_mut(kc * nr).enumerate() {
            src.fill(self.isa, p0 + i, k, kc, out);
        }
    }

    /// A row block over every panel of the task's columns: its whole strips of `mr` rows read
    /// in place, a last partial one packed ([`Operands::pack_partial_strip`]), each strip ×
    /// panel one micro-kernel call ([`Operands::strip`]).
    ///
    /// # Safety
    /// As [`block`].
    #[inline(always)]
    unsafe fn row_block(
        &self,
        rb: RowBlock,
        apack: &mut AlignedBuf,
        bpack: &AlignedBuf,
        tile: &mut [f32; 12 * 32],
    ) {
        let (mr, nr) = (self.isa.mr(), self.isa.nr());
        let (bj0, cols) = (self.bj0, self.cols);
        let p0 = bj0 / nr;
        let strips = rb.brows.div_ceil(mr);
        let full = rb.brows / mr; // strips read in place; a last partial one is packed
        if full < strips {
            self.pack_partial_strip(rb, full, apack);
        }
        let ap = apack.as_slice();
        for p in bj0 / nr..(bj0 + cols).div_ceil(nr) {
            let bp = match self.b {
                BRef::Packed(pb) => pb.panel(p)[(self.k0 + rb.pc) * nr..].as_ptr(),
                BRef::Source(..) => bpack.as_slice()[(p - p0) * rb.kc * nr..].as_ptr(),
            };
            // the columns of this panel inside bj0..bj0+cols, as offsets in the panel
            let lo = bj0.max(p * nr) - p * nr;
            let hi = (bj0 + cols).min(p * nr + nr) - p * nr;
            // C column of the panel's first column (may lie before cj0 on an unaligned start)
            let cbase = (p * nr) as isize - bj0 as isize + self.cj0 as isize;
            for s in 0..strips {
                // SAFETY: as this function's contract.
                unsafe { self.strip(rb, s, (bp, lo..hi, cbase), ap, tile) };
            }
        }
    }

    /// The block's last, partial strip of rows packed into `apack` (`[kc, mr]`), the rows past
    /// the block zero.
    #[inline(always)]
    fn pack_partial_strip(&self, rb: RowBlock, full: usize, apack: &mut AlignedBuf) {
        let mr = self.isa.mr();
        let (a, lda, kc) = (self.a, self.lda, rb.kc);
        apack.ensure(kc * mr);
        let strip = apack.as_mut_slice();
        for r in 0..mr {
            let rr = full * mr + r;
            for kk in 0..kc {
                strip[kk * mr + r] = if rr < rb.brows {
                    a[(rb.i0 + rr) * lda + rb.pc + kk]
                } else {
                    0.0
                };
            }
        }
    }

    /// Strip `s` of the row block × one panel (`bp`; its columns `lo..hi` are the task's, the
    /// panel's first at C column `cbase`): a whole tile straight into C, an edge tile computed
    /// aside in `tile` and its valid part copied in and out of C.
    ///
    /// # Safety
    /// As [`block`].
    #[inline(always)]
    unsafe fn strip(
        &self,
        rb: RowBlock,
        s: usize,
        (bp, cols, cbase): (*const f32, std::ops::Range<usize>, isize),
        ap: &[f32],
        tile: &mut [f32; 12 * 32],
    ) {
        let (isa, ldc, kc, acc) = (self.isa, self.ldc, rb.kc, rb.acc);
        let (mr, nr) = (isa.mr(), isa.nr());
        let (lo, hi) = (cols.start, cols.end);
        let srows = mr.min(rb.brows - s * mr);
        // SAFETY: as this function's contract: the strip's rows and the panel's columns of C
        // are the task's.
        unsafe {
            let crow = self.c.0.add((rb.i0 + s * mr) * ldc);
            let a_in_place = self.a[(rb.i0 + s * mr) * self.lda + rb.pc..].as_ptr();
            if srows == mr && lo == 0 && hi == nr {
                isa.kernel_rows(kc, a_in_place, self.lda, bp, crow.offset(cbase), ldc, acc);
            } else {
                // an edge tile: compute the full tile aside, copy in the valid part
                for r in 0..srows {
                    for j in lo..hi {
                        tile[r * nr + j] = if acc {
                            *crow.offset(cbase + (r * ldc + j) as isize)
                        } else {
                            0.0
                        };
                    }
                }
                if srows == mr {
                    isa.kernel_rows(kc, a_in_place, self.lda, bp, tile.as_mut_ptr(), nr, true);
                } else {
                    isa.kernel(kc, ap.as_ptr(), bp, tile.as_mut_ptr(), nr, true);
                }
                for r in 0..srows {
                    for j in lo..hi {
                        *crow.offset(cbase + (r * ldc + j) as isize) = tile[r * nr + j];
                    }
                }
            }
        }
    }
}

/// The micro-kernel's own rate, GFLOP/s over all of rayon's threads: each thread runs it on
/// panels that stay in L1 for about `seconds`. This is the ceiling any product of this kernel
/// can reach (memory traffic, packing and edges only take away from it), a measured stand-in
/// for the FMA peak of the cores.
pub fn kernel_peak_gflops(isa: Isa, seconds: f64) -> f64 {
    assert!(
        isa.supported(),
        "the {} kernel does not run on this CPU",
        isa.name()
    );
    let (mr, nr, kc) = (isa.mr(), isa.nr(), 128usize);
    let threads = rayon::current_num_threads();
    let flops: f64 = (0..threads)
        .into_par_iter()
        .map(|t| {
            let a = AlignedBuf::zeros(kc * mr);
            let mut b = AlignedBuf::zeros(kc * nr);
            b.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, x)| *x = (i % 7) as f32 * 1e-3 + t as f32 * 1e-6);
            let mut c = AlignedBuf::zeros(mr * nr);
            let start = std::time::Instant::now();
            let mut calls = 0u64;
            while start.elapsed().as_secs_f64() < seconds {
                for _ in 0..256 {
                    // SAFETY: the buffers hold kc·MR, kc·NR and MR·NR floats; the ISA is supported.
                    unsafe {
                        isa.kernel(
                            kc,
                            a.as_slice().as_ptr(),
                            b.as_slice().as_ptr(),
                            c.as_mut_slice().as_mut_ptr(),
                            nr,
                            true,
                        )
                    };
                }
                calls += 256;
            }
            std::hint::black_box(c.as_slice()[0]);
            2.0 * (mr * nr * kc) as f64 * calls as f64 / start.elapsed().as_secs_f64()
        })
        .sum();
    flops / 1e9
}

#[allow(clippy::too_many_arguments)]
unsafe fn kernel_scalar<const DIRECT: bool>(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: the caller upholds this function's contract (its doc comment: the pointers cover
    // the rows and tiles it names, the CPU has the kernel's features); the body only
    // reads and writes within them.
    unsafe {
        const MR: usize = 4;
        const NR: usize = 8;
        let mut acc = [[0f32; NR]; MR];
        for p in 0..kc {
            let bv = std::slice::from_raw_parts(b.add(p * NR), NR);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = if DIRECT {
                    *a.add(r * lda + p)
                } else {
                    *a.add(p * MR + r)
                };
                for j in 0..NR {
                    row[j] = av.mul_add(bv[j], row[j]);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (j, &x) in row.iter().enumerate() {
                let dst = c.add(r * ldc + j);
                *dst = if accumulate { *dst + x } else { x };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop, clippy::too_many_arguments)]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;

    /// `W: [n, k]` row-major, handing out its panels a depth slice at a time.
    struct Plain<'a>(&'a [f32], usize, usize);
    impl PanelSource for Plain<'_> {
        fn dims(&self) -> (usize, usize) {
            (self.1, self.2)
        }
        fn fill(&self, isa: Isa, p: usize, k0: usize, kc: usize, out: &mut [f32]) {
            let (nr, k) = (isa.nr(), self.2);
            let cols = nr.min(self.1 - p * nr);
            let rows: Vec<f32> = (0..cols)
                .flat_map(|j| self.0[(p * nr + j) * k + k0..][..kc].to_vec())
                .collect();
            out[..kc * nr].fill(0.0);
            transpose_into_panel(&rows, cols, kc, nr, out);
        }
    }

    /// Panels made a depth slice at a time give the packed panels' bits: every ISA, depths past
    /// one slice, column edges, sub-ranges of depth and columns, accumulation, serial and parallel.
    #[test]
    fn panels_from_a_source_give_the_packed_panels_bits() {
        let mut rng = crate::reference::Rng::new(8);
        for isa in Isa::all_supported() {
            for (m, k, n) in [
                (1, 5, 3),
                (13, 2 * isa.kc() + 37, 70),
                (40, 896, 2 * isa.nr() + 5),
            ] {
                let w = rng.normals(n * k, 1.0);
                let a = rng.normals(m * k, 1.0);
                let packed = PackedB::from_rows(&w, n, k, k, isa);
                let src = Plain(&w, n, k);
                for (ks, cols) in [(0..k, 0..n), (k / 3..k - 1, 1..n), (1..2, n - 1..n)] {
                    for (accumulate, parallel) in [(false, true), (true, false)] {
                        let lda = ks.len();
                        let sub: Vec<f32> = (0..m)
                            .flat_map(|r| a[r * k + ks.start..r * k + ks.end].to_vec())
                            .collect();
                        let ldc = cols.len();
                        let init = rng.normals(m * ldc, 1.0);
                        let (mut want, mut got) = (init.clone(), init);
                        gemm_sub(
                            &sub,
                            lda,
                            m,
                            &packed,
                            ks.clone(),
                            cols.clone(),
                            &mut want,
                            ldc,
                            accumulate,
                            parallel,
                        );
                        gemm_source(
                            &sub,
                            lda,
                            m,
                            &src,
                            isa,
                            ks.clone(),
                            cols.clone(),
                            &mut got,
                            ldc,
                            accumulate,
                            parallel,
                        );
                        assert!(
                            want.iter()
                                .zip(&got)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{isa:?} m {m} k {k} n {n} {ks:?} {cols:?} acc {accumulate}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn panels_transposed_in_blocks_equal_the_plain_transpose() {
        use crate::kernels::simd::{all_supported, with_level};
        // every mix of whole 16×16 blocks and edges, at every vector width this CPU runs
        for level in all_supported() {
            for (cols, k) in [
                (32, 64),
                (32, 33),
                (17, 16),
                (16, 47),
                (15, 15),
                (1, 1),
                (31, 896),
            ] {
                let w: Vec<f32> = (0..cols * k).map(|x| x as f32 + 0.5).collect();
                let mut got = vec![-1f32; k * 32];
                with_level(level, || transpose_into_panel(&w, cols, k, 32, &mut got));
                for kk in 0..k {
                    for j in 0..32 {
                        let want = if j < cols { w[j * k + kk] } else { -1.0 };
                        assert_eq!(
                            got[kk * 32 + j],
                            want,
                            "{level:?} {cols}x{k} at ({kk}, {j})"
                        );
                    }
                }
            }
        }
    }

    fn check(m: usize, k: usize, n: usize, isa: Isa, seed: u64) {
        check_tampered(m, k, n, isa, seed, |_| {})
    }

    /// [`check`] with `tamper` applied to the weights after the expected product is computed
    /// from them: a tampered weight must make the check panic.
    fn check_tampered(m: usize, k: usize, n: usize, isa: Isa, seed: u64, tamper: fn(&mut [f32])) {
        let mut rng = crate::reference::Rng::new(seed);
        let a = rng.normals(m * k, 1.0);
        let mut w = rng.normals(n * k, 1.0);
        let want = crate::kernels::naive_product(&a, m, k, &w, n);
        tamper(&mut w);
        // W [n, k] as rows, and its transpose [k, n] as columns: the same product
        let wt: Vec<f32> = (0..k * n).map(|i| w[(i % n) * k + i / n]).collect();
        for (label, pb) in [
            ("rows", PackedB::from_rows(&w, n, k, k, isa)),
            ("cols", PackedB::from_cols(&wt, k, n, n, isa)),
        ] {
            for accumulate in [false, true] {
                let base = if accumulate { 1.5f32 } else { f32::NAN };
                // C with a wider row stride than n, to check ldc and that nothing past n is touched
                let ldc = n + 3;
                let mut c = vec![base; m.max(1) * ldc];
                gemm(&a, k, m, &pb, &mut c, ldc, accumulate);
                for i in 0..m {
                    for j in 0..n {
                        let want = want[i * n + j] + if accumulate { 1.5 } else { 0.0 };
                        let got = c[i * ldc + j] as f64;
                        assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()), "{isa:?} {label} m={m} k={k} n={n} acc={accumulate} at ({i},{j}): {got} vs {want}");
                    }
                    for j in n..ldc {
                        assert!(
                            c[i * ldc + j].to_bits() == base.to_bits(),
                            "{isa:?} wrote past column n at ({i},{j})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_kernel_matches_a_naive_product_on_awkward_shapes() {
        let isas = Isa::all_supported();
        assert!(isas.contains(&Isa::Scalar));
        for isa in isas {
            for (m, k, n) in [
                (1, 1, 1),
                (5, 7, 3),
                (13, 64, 33),
                (12, 32, 32),
                (200, 300, 70),
                (17, 600, 1030),
                // deeper than every kernel's slice: the products over slices add up
                (30, 2100, 40),
                (2, 0, 5),
            ] {
                check(m, k, n, isa, (m * 31 + k * 7 + n) as u64);
            }
        }
    }

    #[test]
    fn sub_products_use_the_right_rows_and_columns() {
        for isa in Isa::all_supported() {
            let mut rng = crate::reference::Rng::new(11);
            let (m, k, n) = (9, 70, 45);
            let a = rng.normals(m * k, 1.0);
            let b = rng.normals(k * n, 1.0); // [k, n]
            let pb = PackedB::from_cols(&b, k, n, n, isa);
            for (ks, cols) in [
                (0..70, 0..45),
                (3..40, 5..38),
                (33..34, 44..45),
                (10..70, 0..1),
            ] {
                let (kk, nn) = (ks.len(), cols.len());
                // A's columns meet B's rows ks: take A's first kk columns, lda = k
                let mut c = vec![0f32; m * nn];
                gemm_sub(
                    &a,
                    k,
                    m,
                    &pb,
                    ks.clone(),
                    cols.clone(),
                    &mut c,
                    nn,
                    false,
                    true,
                );
                for i in 0..m {
                    for j in 0..nn {
                        let want: f64 = (0..kk)
                            .map(|p| {
                                a[i * k + p] as f64 * b[(ks.start + p) * n + cols.start + j] as f64
                            })
                            .sum();
                        let got = c[i * nn + j] as f64;
                        assert!(
                            (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                            "{isa:?} {ks:?} {cols:?} ({i},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn micro_kernels_give_the_bits_of_an_in_order_fused_sum() {
        // each micro-kernel (the AVX-512 one is assembly) must give, for every element, the
        // fused multiply-adds over k in ascending order, then `+ C` when accumulating: the
        // bits, not a tolerance, at every depth the unrolled loop and its remainder take
        for isa in Isa::all_supported() {
            let (mr, nr) = (isa.mr(), isa.nr());
            for kc in [0, 1, 2, 3, 4, 5, 7, 8, 9, 17, 64, 131] {
                let mut rng = crate::reference::Rng::new(kc as u64 + 1);
                let b = rng.normals(kc * nr, 1.0);
                // A's strip as rows (stride kc + 5, the gap holding values no product may use)
                let lda = kc + 5;
                let rows: Vec<f32> = (0..mr * lda)
                    .map(|i| {
                        if i % lda < kc {
                            rng.normals(1, 1.0)[0]
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                let packed: Vec<f32> = (0..kc * mr)
                    .map(|i| rows[(i % mr) * lda + i / mr])
                    .collect();
                for direct in [false, true] {
                    for accumulate in [false, true] {
                        let ldc = nr + 3;
                        let c0: Vec<f32> =
                            (0..mr * ldc).map(|i| 0.25 * (i % 7) as f32 - 0.5).collect();
                        let mut c = c0.clone();
                        // SAFETY: the buffers are as large as the kernel reads and writes
                        unsafe {
                            if direct {
                                isa.kernel_rows(
                                    kc,
                                    rows.as_ptr(),
                                    lda,
                                    b.as_ptr(),
                                    c.as_mut_ptr(),
                                    ldc,
                                    accumulate,
                                )
                            } else {
                                isa.kernel(
                                    kc,
                                    packed.as_ptr(),
                                    b.as_ptr(),
                                    c.as_mut_ptr(),
                                    ldc,
                                    accumulate,
                                )
                            }
                        }
                        for r in 0..mr {
                            for j in 0..ldc {
                                let want = if j >= nr {
                                    c0[r * ldc + j]
                                } else {
                                    let s = (0..kc).fold(0f32, |s, p| {
                                        rows[r * lda + p].mul_add(b[p * nr + j], s)
                                    });
                                    if accumulate {
                                        s + c0[r * ldc + j]
                                    } else {
                                        s
                                    }
                                };
                                let got = c[r * ldc + j];
                                assert_eq!(
                                    got.to_bits(),
                                    want.to_bits(),
                                    "{isa:?} kc={kc} direct={direct} acc={accumulate} ({r},{j}): {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_kernel_can_fail_this_check() {
        // the check above catches a wrong product: one corrupted weight, on every kernel this
        // CPU runs, must make `check` itself panic
        for isa in Isa::all_supported() {
            let caught = std::panic::catch_unwind(|| {
                check_tampered(3, 5, 4, isa, 3, |w| w[2] += 1.0);
            });
            assert!(
                caught.is_err(),
                "{isa:?}: a corrupted weight went unnoticed"
            );
        }
    }

    #[test]
    fn task_plans_cover_c_with_whole_panels_and_balance_threads() {
        for (m, n, threads) in [
            (2048, 896, 2),
            (575, 896, 2),
            (2048, 1152, 2),
            (18, 128, 2),
            (1, 1, 4),
            (575, 9728, 16),
            (5000, 64, 3),
            (32768, 1152, 2),
        ] {
            let (mc, group, nc) = plan(m, n, 12, 32, threads);
            assert!(mc % 12 == 0 && mc > 0 && mc <= 192, "{m}x{n}: mc {mc}");
            assert!(
                group % mc == 0 && group <= 2048 + mc,
                "{m}x{n}: group {group}"
            );
            assert!(nc % 32 == 0 && nc > 0, "{m}x{n}: nc {nc}");
            let tasks = m.div_ceil(group) * n.div_ceil(nc);
            let most = m.div_ceil(mc) * n.div_ceil(32);
            assert!(
                tasks >= (2 * threads).min(most),
                "{m}x{n}: only {tasks} tasks"
            );
        }
        // the case that was measured: down projection, 575 rows, 28 panels, 2 threads
        let (_, group, nc) = plan(575, 896, 12, 32, 2);
        assert_eq!((575usize.div_ceil(group) * 896usize.div_ceil(nc)) % 2, 0);
    }

    #[test]
    fn columns_set_in_place_equal_packing_from_rows() {
        // 70 columns in uneven runs that cross panels; k past one chunk of set_columns' rows
        let (n, k) = (70, 150);
        let w: Vec<f32> = (0..n * k).map(|x| (x as f32 * 0.37).sin()).collect();
        for isa in Isa::all_supported() {
            let mut b = PackedB::zeros(k, n, isa);
            b.set_columns(0, &w[..k], false);
            b.set_columns(1, &w[k..15 * k], false);
            // set to twice the rows, then the rows subtracted: the rows themselves
            let twice: Vec<f32> = w[15 * k..].iter().map(|v| 2.0 * v).collect();
            b.set_columns(15, &twice, false);
            b.set_columns(15, &w[15 * k..], true);
            assert_eq!(
                b.buf.as_slice(),
                PackedB::from_rows(&w, n, k, k, isa).buf.as_slice(),
                "{isa:?}"
            );
        }
    }

    #[test]
    fn packing_from_a_row_source_equals_packing_from_rows() {
        // 70 columns: two whole AVX-512 panels and a partial one; rows asked for a panel at a time
        let (n, k) = (70, 9);
        let w: Vec<f32> = (0..n * k).map(|x| (x as f32).sin()).collect();
        for isa in Isa::all_supported() {
            let asked = std::sync::Mutex::new(Vec::new());
            let from_source = PackedB::try_from_row_source(n, k, isa, |r0, out: &mut [f32]| {
                asked.lock().unwrap().push((r0, out.len() / k));
                out.copy_from_slice(&w[r0 * k..r0 * k + out.len()]);
                Ok::<(), String>(())
            })
            .unwrap();
            assert_eq!(
                from_source.buf.as_slice(),
                PackedB::from_rows(&w, n, k, k, isa).buf.as_slice(),
                "{isa:?}"
            );
            let mut asked = asked.into_inner().unwrap();
            asked.sort();
            let nr = isa.nr();
            let want: Vec<(usize, usize)> = (0..n.div_ceil(nr))
                .map(|p| (p * nr, nr.min(n - p * nr)))
                .collect();
            assert_eq!(asked, want, "{isa:?}: each row asked for once");
            // a failing source fails the packing
            let err = PackedB::try_from_row_source(n, k, isa, |r0, _: &mut [f32]| {
                if r0 > 0 {
                    Err(format!("row {r0} is corrupt"))
                } else {
                    Ok(())
                }
            });
            assert!(err.is_err_and(|e| e.contains("is corrupt")));
        }
    }

    #[test]
    fn packed_columns_come_back() {
        let w: Vec<f32> = (0..5 * 3).map(|x| x as f32).collect(); // [n=5, k=3]
        for isa in Isa::all_supported() {
            let pb = PackedB::from_rows(&w, 5, 3, 3, isa);
            for j in 0..5 {
                assert_eq!(pb.column(j), w[j * 3..j * 3 + 3].to_vec());
            }
        }
    }
}
