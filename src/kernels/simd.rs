//! Run-time choice of the vector width for the element-wise loops of the forward (the
//! softmax's exponentials, SwiGLU, the finiteness checks), so that one binary built for
//! baseline x86-64 runs them at the machine's width.
//!
//! The loops are ordinary Rust written in lanes of 16 so that LLVM vectorizes them; how wide
//! depends on the features the function is compiled with. `multiversion!` compiles one body
//! three times (AVX-512, AVX2 + FMA, and the build's own target) and picks one per call from
//! [`level`], detected once. Measured on a 2-core Sapphire Rapids Xeon, default model, 2,048
//! tokens: a baseline build's attention took 1.07 s against 0.89 s for a `target-cpu=native`
//! build before the loops were multiversioned. The GEMM, int8 and AMX kernels choose their own
//! instruction set ([`super::gemm::Isa`]).

use std::sync::atomic::{AtomicU8, Ordering};

/// The widest vector instructions this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// whatever the build targets (SSE2 for baseline x86-64)
    Base = 1,
    /// AVX2 + FMA (256-bit)
    Avx2 = 2,
    /// AVX-512 F/BW/DQ/VL (512-bit)
    Avx512 = 3,
}

impl Level {
    pub fn name(self) -> &'static str {
        match self {
            Level::Avx512 => "avx512",
            Level::Avx2 => "avx2+fma",
            Level::Base => "baseline",
        }
    }
}

static LEVEL: AtomicU8 = AtomicU8::new(0);

/// The level the element-wise loops run at, detected on first use. `ATTNSCOPE_SIMD=base|avx2`
/// caps it (for benchmarks and tests; a level the CPU lacks is never chosen), and so does
/// `ATTNSCOPE_ISA` (`avx2`: AVX2, `scalar`: the build's baseline), so a run held to a narrower
/// instruction set holds every loop to it.
pub fn level() -> Level {
    match LEVEL.load(Ordering::Relaxed) {
        1 => Level::Base,
        2 => Level::Avx2,
        3 => Level::Avx512,
        _ => {
            let cap = match std::env::var("ATTNSCOPE_SIMD").ok().as_deref() {
                Some("base") => Level::Base,
                Some("avx2") => Level::Avx2,
                _ => Level::Avx512,
            };
            let isa = match super::select::kernels().gemm {
                super::gemm::Isa::Avx512 => Level::Avx512,
                super::gemm::Isa::Avx2 => Level::Avx2,
                super::gemm::Isa::Scalar => Level::Base,
            };
            let l = detected().min(cap).min(isa);
            LEVEL.store(l as u8, Ordering::Relaxed);
            l
        }
    }
}

fn detected() -> Level {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f")
            && std::arch::is_x86_feature_detected!("avx512bw")
            && std::arch::is_x86_feature_detected!("avx512dq")
            && std::arch::is_x86_feature_detected!("avx512vl")
            && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx512;
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return Level::Avx2;
        }
    }
    Level::Base
}

/// Every level this CPU runs, widest first (for tests that compare them).
pub fn all_supported() -> Vec<Level> {
    [Level::Avx512, Level::Avx2, Level::Base]
        .into_iter()
        .filter(|&l| l <= detected())
        .collect()
}

thread_local! {
    static FORCED: std::cell::Cell<Option<Level>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with the multiversioned functions on this thread held to `level` (tests).
pub fn with_level<R>(level: Level, f: impl FnOnce() -> R) -> R {
    assert!(level <= detected(), "{level:?} does not run on this CPU");
    let old = FORCED.with(|c| c.replace(Some(level)));
    let out = f();
    FORCED.with(|c| c.set(old));
    out
}

/// The level for a call on this thread: [`with_level`]'s, else [`level`].
#[inline]
pub fn current() -> Level {
    FORCED.with(|c| c.get()).unwrap_or_else(level)
}

/// `fn name(args) -> ret { body }` compiled for AVX-512, for AVX2 + FMA and for the build's
/// target, choosing per call by [`current`]. The body must be safe code on slices and values;
/// the generated wrappers are the only `unsafe` (the CPU has been checked to support them).
macro_rules! multiversion {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn half($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match $crate::kernels::simd::current() {
                    // SAFETY: `current` only names a level whose features this CPU has.
                    $crate::kernels::simd::Level::Avx512 => return unsafe { wide($($arg),*) },
                    // SAFETY: as above, AVX2 and FMA.
                    $crate::kernels::simd::Level::Avx2 => return unsafe { half($($arg),*) },
                    $crate::kernels::simd::Level::Base => {}
                }
            }
            body($($arg),*)
        }
    };
}
pub(crate) use multiversion;

#[cfg(test)]
mod tests {
    use super::*;

    multiversion! {
        fn dot16(a: &[f32], b: &[f32]) -> f32 {
            let mut acc = [0f32; 16];
            for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
                for k in 0..16 {
                    acc[k] += x[k] * y[k];
                }
            }
            acc.iter().sum()
        }
    }

    #[test]
    fn every_level_computes_the_same_and_the_cap_holds() {
        let a: Vec<f32> = (0..1024).map(|i| (i % 13) as f32 * 0.25).collect();
        let b: Vec<f32> = (0..1024).map(|i| (i % 7) as f32 - 3.0).collect();
        let want: f32 = {
            let mut acc = [0f32; 16];
            for i in 0..1024 {
                acc[i % 16] += a[i] * b[i];
            }
            acc.iter().sum()
        };
        let levels = all_supported();
        assert_eq!(levels.last(), Some(&Level::Base));
        for l in levels {
            // same lanes, same order of sums: the same float at every width
            assert_eq!(with_level(l, || dot16(&a, &b)), want, "{l:?}");
            assert_eq!(with_level(l, current), l);
        }
        if detected() == Level::Base {
            eprintln!("simd: this CPU has neither AVX2 nor AVX-512; only the baseline body ran");
        }
    }
}
