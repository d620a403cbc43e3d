//! The compute kernels under the forward: f32 matrix multiplication on packed panels
//! ([`gemm`], `exact`) and 8-bit block-quantized multiplication ([`int8`], `fast`), with
//! run-time choice of the instruction set. Pure Rust on slices, no candle.

pub mod amx;
pub mod gemm;
pub mod int8;

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
