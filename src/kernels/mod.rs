//! The compute kernels under the forward: f32 matrix multiplication on packed panels
//! ([`gemm`], `exact`), bf16 products on AMX tiles ([`amx`]) and 8-bit block-quantized
//! multiplication ([`int8`]) for `fast`, and the vector width of the element-wise loops
//! ([`simd`]), each with run-time choice of the instruction set, so a build for baseline x86-64
//! runs at the machine's rate ([`select`] decides which, once, and refuses a forced one the CPU
//! lacks). Pure Rust on slices, no candle.

pub mod amx;
pub mod gemm;
pub mod int8;
pub mod qmatvec;
pub mod select;
pub mod simd;

/// C's pointer handed to the tasks of a product, each of which writes its own tiles.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint tiles of C through it.
unsafe impl Send for SendPtr {}
// SAFETY: shared between the tasks only to be offset to each one's own tiles.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}

/// Panics unless `A` holds `[m, k]` at row stride `lda` and `C` holds `[m, n]` at `ldc` (m ≥ 1):
/// the operand checks of every product here.
pub(crate) fn check_operands(
    (a, lda): (&[f32], usize),
    (c, ldc): (&[f32], usize),
    (m, k, n): (usize, usize, usize),
) {
    assert!(
        a.len() >= (m - 1) * lda + k,
        "A is too short for [{m}, {k}]"
    );
    assert!(
        c.len() >= (m - 1) * ldc + n,
        "C is too short for [{m}, {n}]"
    );
}

/// Fills a packed weight buffer panel by panel from a source of `W: [n, k]` rows: panel `p`
/// (`panel_len` elements of `buf`) is made by `pack(cols, rows, panel)` from the rows
/// `p·np..p·np + cols`, which `rows(r0, out)` writes row-major into a buffer of the worker
/// thread. The three packers' way to load weights without holding them whole as f32.
pub(crate) fn fill_panels<T: Send, E: Send>(
    buf: &mut [T],
    panel_len: usize,
    np: usize,
    (n, k): (usize, usize),
    rows: impl Fn(usize, &mut [f32]) -> Result<(), E> + Sync,
    pack: impl Fn(usize, &[f32], &mut [T]) + Sync,
) -> Result<(), E> {
    use rayon::prelude::*;
    if panel_len == 0 || k == 0 {
        return Ok(());
    }
    buf.par_chunks_mut(panel_len).enumerate().try_for_each_init(
        || vec![0f32; np * k],
        |tmp, (p, panel)| {
            let cols = np.min(n - p * np);
            rows(p * np, &mut tmp[..cols * k])?;
            pack(cols, &tmp[..cols * k], panel);
            Ok(())
        },
    )
}

/// The row source of a plain `W: [n, k]` with row stride `ldw` (the packers' `from_rows`).
pub(crate) fn rows_of(
    w: &[f32],
    k: usize,
    ldw: usize,
) -> impl Fn(usize, &mut [f32]) -> Result<(), std::convert::Infallible> + Sync + '_ {
    move |r0, out| {
        for (j, row) in out.chunks_mut(k.max(1)).enumerate() {
            row.copy_from_slice(&w[(r0 + j) * ldw..][..row.len()]);
        }
        Ok(())
    }
}

/// Asks glibc's allocator (once per process) to serve buffers of up to 32 MiB from its heap
/// and keep what is freed there for the next request, instead of mapping fresh pages for every
/// large buffer and unmapping them on free: the backward and integrated gradients allocate and
/// free buffers of many MiB per layer, and each fresh mapping is zeroed by the kernel page by
/// page (measured: a quarter of integrated gradients' time went to `clear_page`). The process
/// keeps that memory after a run (its peak); elsewhere than glibc this does nothing.
pub fn keep_freed_buffers() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: mallopt only sets the allocator's thresholds; it is called before the buffers
        // it affects are allocated and is safe to call at any time
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, 32 << 20);
            libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        }
    });
}

/// `A · Wᵀ` in f64 for the kernels' tests: `a: [m, k]`, `w: [n, k]` → `[m, n]`.
#[cfg(test)]
pub(crate) fn naive_product(a: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
    let mut c = vec![0f64; m * n];
    for i in 0..m {
        for j in 0..n {
            c[i * n + j] = (0..k)
                .map(|p| a[i * k + p] as f64 * w[j * k + p] as f64)
                .sum();
        }
    }
    c
}
