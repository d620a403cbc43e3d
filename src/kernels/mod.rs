//! The compute kernels under the forward: f32 matrix multiplication on packed panels
//! ([`gemm`]), with run-time choice of the instruction set. Pure Rust on slices, no candle.

pub mod gemm;
