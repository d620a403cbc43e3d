//! The compute kernels under the forward: f32 matrix multiplication on packed panels
//! ([`gemm`], `exact`) and 8-bit block-quantized multiplication ([`int8`], `fast`), with
//! run-time choice of the instruction set. Pure Rust on slices, no candle.

pub mod amx;
pub mod gemm;
pub mod int8;
