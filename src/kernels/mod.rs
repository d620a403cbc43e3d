//! The compute kernels under the forward: f32 matrix multiplication on packed panels
//! ([`gemm`], `exact`), bf16 products on AMX tiles ([`amx`]) and 8-bit block-quantized
//! multiplication ([`int8`]) for `fast`, and the vector width of the element-wise loops
//! ([`simd`]), each with run-time choice of the instruction set, so a build for baseline x86-64
//! runs at the machine's rate. Pure Rust on slices, no candle.

pub mod amx;
pub mod gemm;
pub mod int8;
pub mod simd;

/// C's pointer handed to the tasks of a product, each of which writes its own tiles.
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
// SAFETY: tasks write disjoint tiles of C through it.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

impl SendPtr {
    pub(crate) fn get(&self) -> *mut f32 {
        self.0
    }
}
