//! Which kernels this process runs, decided once from the CPU and two variables, so that every
//! kernel the engine may pick can be forced (tests and CI rerun the checks against transformers on
//! each) and a request the CPU cannot meet is refused with a clear error, never run as an illegal
//! instruction and never ignored.
//!
//! The kernels (docs/ARCHITECTURE.md, "Precisions, layouts and kernels"):
//!
//! | precision | kernel | when |
//! |---|---|---|
//! | `exact` | AMX tiles, a quantized file's integers and scales (`amx/scaled.rs`) | AMX (default there) |
//! | `exact` | AMX tiles, three bf16 parts (`amx.rs`, bf16x3) | AMX, `ATTNSCOPE_AMX=exact` |
//! | `exact` | f32 GEMM, AVX-512 / AVX2+FMA / plain micro-kernel (`gemm.rs`) | otherwise, and always for the attention itself |
//! | `fast` | AMX tiles, bf16 (`amx.rs`, bf16x1) | AMX |
//! | `fast` | 8-bit blocks on AVX-512 VNNI (`int8.rs`, `vnni-int8`) | VNNI without the tiles |
//! | `fast` | 8-bit blocks on AVX2 and FMA (`int8.rs`, `avx2-int8`: VNNI's bits) | AVX2+FMA without VNNI |
//! | `fast` | the f32 GEMM (the same numbers as `exact`) | none of these (`ATTNSCOPE_ISA=scalar`) |
//!
//! `--memory low` runs the same kernels from the file's blocks (`gemm_source`, `gemm_decoded`).
//!
//! `ATTNSCOPE_ISA` caps the instruction set every kernel may use: `amx` (the tiles; VNNI and
//! AVX-512 besides), `avx512` (no tiles: `exact` on the AVX-512 GEMM, `fast` on VNNI where the CPU
//! has it), `avx2` (the AVX2 GEMM, `fast` on 8-bit blocks with AVX2), `scalar` (plain code: `fast`
//! has no kernel of its own). The
//! element-wise loops ([`super::simd`]) are held to the same width. `ATTNSCOPE_AMX` picks among
//! the tiles' uses: `0` (or `off`, `no`, `false`: none), `f32` (`exact` on the f32 GEMM, `fast`
//! still on the tiles), `exact` (`exact` on three bf16 parts), `scaled` (the default). A value the
//! CPU cannot run, two that contradict each other, or one that names nothing is an error.

use super::gemm::Isa;
use std::sync::OnceLock;

/// What the CPU offers (asked once; the tests pass made-up ones to [`choose`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hardware {
    /// AMX-BF16 tiles that Linux granted this process
    pub amx: bool,
    /// AVX-512 F, BW and VNNI (the int8 kernel)
    pub vnni: bool,
    /// the widest f32 GEMM micro-kernel
    pub gemm: Isa,
}

impl Hardware {
    /// This machine's.
    pub fn detect() -> Hardware {
        Hardware {
            amx: super::amx::hardware_ready(),
            vnni: super::int8::vnni_supported(),
            gemm: Isa::best(),
        }
    }
}

/// What `exact` multiplies its projections with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExactOn {
    /// a quantized file's integers and scales on the AMX tiles (other matrices on the f32 GEMM)
    Scaled,
    /// three bf16 parts on the AMX tiles
    Bf16x3,
    /// the f32 GEMM
    F32,
}

/// What `fast` multiplies its projections with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FastOn {
    /// bf16 on the AMX tiles
    Bf16,
    /// 8-bit blocks on AVX-512 VNNI
    Int8,
    /// 8-bit blocks on AVX2 and FMA (the same bits as on VNNI)
    Int8Avx2,
    /// the f32 GEMM: `exact`'s numbers
    F32,
}

/// The kernels of this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Kernels {
    /// the f32 GEMM's micro-kernel (the attention's products, and the projections `exact` runs
    /// on f32 panels)
    pub gemm: Isa,
    /// whether any kernel may use the AMX tiles
    pub tiles: bool,
    /// whether the int8 kernel may use VNNI
    pub vnni: bool,
    pub exact: ExactOn,
    pub fast: FastOn,
    /// `ATTNSCOPE_ISA` and `ATTNSCOPE_AMX` as set, for `info`
    pub forced: Option<String>,
}

/// The variables' values: `(ATTNSCOPE_ISA, ATTNSCOPE_AMX)`.
pub type Request<'a> = (Option<&'a str>, Option<&'a str>);

/// The kernels `request` asks for on `hw`, or why it cannot be met.
pub fn choose(hw: Hardware, (isa, amx): Request) -> Result<Kernels, String> {
    let lacks = |what: &str| {
        format!("ATTNSCOPE_ISA={} asks for {what}, which this CPU lacks; leave it unset for the best this CPU runs, or pick one of: {}", isa.unwrap_or(""), offered(hw))
    };
    // the cap: which GEMM, and whether the tiles and VNNI may run
    let (gemm, tiles_allowed, vnni_allowed) = match isa {
        None => (hw.gemm, true, true),
        Some("amx") if hw.amx => (hw.gemm, true, true),
        Some("amx") => {
            return Err(lacks(
                "the AMX tiles (or Linux refused them to this process)",
            ))
        }
        Some("avx512") if runs(hw.gemm, Isa::Avx512) => (Isa::Avx512, false, true),
        Some("avx512") => return Err(lacks("AVX-512")),
        Some("avx2") if runs(hw.gemm, Isa::Avx2) => (Isa::Avx2, false, false),
        Some("avx2") => return Err(lacks("AVX2 and FMA")),
        Some("scalar") => (Isa::Scalar, false, false),
        Some(other) => {
            return Err(format!(
            "ATTNSCOPE_ISA={other} names no kernel; use amx, avx512, avx2 or scalar (this CPU: {})",
            offered(hw)
        ))
        }
    };
    let tiles = hw.amx && tiles_allowed;
    let exact = amx_use(amx, isa, tiles, hw.amx)?;
    let tiles = tiles && !matches!(amx, Some("0" | "off" | "no" | "false"));
    let vnni = hw.vnni && vnni_allowed;
    let fast = if tiles {
        FastOn::Bf16
    } else if vnni {
        FastOn::Int8
    } else if runs(gemm, Isa::Avx2) {
        // the GEMM's AVX2 micro-kernel needs AVX2 and FMA, as the int8 one does
        FastOn::Int8Avx2
    } else {
        FastOn::F32
    };
    let forced = [("ATTNSCOPE_ISA", isa), ("ATTNSCOPE_AMX", amx)]
        .iter()
        .filter_map(|(k, v)| v.map(|v| format!("{k}={v}")))
        .collect::<Vec<_>>();
    Ok(Kernels {
        gemm,
        tiles,
        vnni,
        exact,
        fast,
        forced: (!forced.is_empty()).then(|| forced.join(" ")),
    })
}

/// What `exact` runs on, as `ATTNSCOPE_AMX` says, given whether the tiles may run (`tiles`) and
/// whether the CPU has them (`hw_amx`).
fn amx_use(
    amx: Option<&str>,
    isa: Option<&str>,
    tiles: bool,
    hw_amx: bool,
) -> Result<ExactOn, String> {
    let wants_tiles = |what: &str| {
        if !hw_amx {
            format!("ATTNSCOPE_AMX={what} asks for the AMX tiles, which this CPU lacks (or Linux refused them to this process); unset it")
        } else {
            format!(
                "ATTNSCOPE_AMX={what} asks for the AMX tiles, which ATTNSCOPE_ISA={} rules out; unset one of the two",
                isa.unwrap_or("")
            )
        }
    };
    Ok(match amx {
        None if tiles => ExactOn::Scaled,
        None | Some("f32") => ExactOn::F32,
        Some("0" | "off" | "no" | "false") if isa == Some("amx") => {
            return Err(format!(
                "ATTNSCOPE_ISA=amx asks for the AMX tiles and ATTNSCOPE_AMX={} turns them off; unset one of the two",
                amx.unwrap_or("")
            ))
        }
        Some("0" | "off" | "no" | "false") => ExactOn::F32,
        Some("exact") if tiles => ExactOn::Bf16x3,
        Some("scaled") if tiles => ExactOn::Scaled,
        Some(v @ ("exact" | "scaled")) => return Err(wants_tiles(v)),
        Some(other) => {
            return Err(format!(
                "ATTNSCOPE_AMX={other} names no use of the AMX tiles; use 0 (none), f32, exact or scaled"
            ))
        }
    })
}

/// Whether a CPU whose widest GEMM micro-kernel is `best` runs `want`.
fn runs(best: Isa, want: Isa) -> bool {
    let rank = |i: Isa| match i {
        Isa::Scalar => 0,
        Isa::Avx2 => 1,
        Isa::Avx512 => 2,
    };
    rank(want) <= rank(best)
}

/// The `ATTNSCOPE_ISA` values this CPU runs, widest first.
fn offered(hw: Hardware) -> String {
    let mut v = Vec::new();
    if hw.amx {
        v.push("amx");
    }
    for (isa, name) in [
        (Isa::Avx512, "avx512"),
        (Isa::Avx2, "avx2"),
        (Isa::Scalar, "scalar"),
    ] {
        if runs(hw.gemm, isa) {
            v.push(name);
        }
    }
    v.join(", ")
}

fn from_env() -> &'static Result<Kernels, String> {
    static CHOICE: OnceLock<Result<Kernels, String>> = OnceLock::new();
    CHOICE.get_or_init(|| {
        let isa = std::env::var("ATTNSCOPE_ISA").ok();
        let amx = std::env::var("ATTNSCOPE_AMX").ok();
        choose(Hardware::detect(), (isa.as_deref(), amx.as_deref()))
    })
}

/// Whether `ATTNSCOPE_ISA` and `ATTNSCOPE_AMX` ask for kernels this CPU runs, and
/// `ATTNSCOPE_DECODE` names a way to decode ([`super::qmatvec::check`]): the command line and the
/// model loaders call this first, and refuse (exit 2) with its message.
pub fn check() -> Result<(), String> {
    from_env().as_ref().map(|_| ()).map_err(Clone::clone)?;
    super::qmatvec::check()
}

/// The kernels of this process. Every entry point has called [`check`] before a kernel runs;
/// a kernel reached without it, with variables this CPU cannot meet, stops here rather than run
/// an instruction the CPU lacks.
pub fn kernels() -> &'static Kernels {
    match from_env() {
        Ok(k) => k,
        Err(e) => panic!("{e}"),
    }
}

impl Kernels {
    /// The name of `exact`'s projection kernel: `amx-scaled`, `amx-bf16x3`, `f32-<isa>`.
    pub fn exact_name(&self) -> String {
        match self.exact {
            ExactOn::Scaled => "amx-scaled".into(),
            ExactOn::Bf16x3 => "amx-bf16x3".into(),
            ExactOn::F32 => format!("f32-{}", self.gemm.name()),
        }
    }

    /// The code that multiplies 8-bit blocks in this process: `fast`'s where it runs on them,
    /// else VNNI where it may run, else plain code.
    pub fn int8(&self) -> super::int8::Int8Kernel {
        use super::int8::Int8Kernel;
        match self.fast {
            FastOn::Int8 => Int8Kernel::Vnni,
            FastOn::Int8Avx2 => Int8Kernel::Avx2,
            _ if self.vnni => Int8Kernel::Vnni,
            _ => Int8Kernel::Plain,
        }
    }

    /// The name of `fast`'s projection kernel: `amx-bf16`, `vnni-int8`, `avx2-int8`, `f32-<isa>`.
    pub fn fast_name(&self) -> String {
        match self.fast {
            FastOn::Bf16 => "amx-bf16".into(),
            FastOn::Int8 => "vnni-int8".into(),
            FastOn::Int8Avx2 => "avx2-int8".into(),
            FastOn::F32 => format!("f32-{}", self.gemm.name()),
        }
    }

    /// Why `fast` has no kernel of its own (when [`FastOn::F32`]): the CPU, or the variables.
    pub fn why_no_fast_kernel(&self) -> String {
        match &self.forced {
            Some(f) if runs(Hardware::detect().gemm, Isa::Avx2) => {
                format!("{f} holds the kernels below AMX, AVX-512 VNNI and AVX2")
            }
            _ => "this CPU has none of AMX, AVX-512 VNNI and AVX2 with FMA".into(),
        }
    }

    /// What runs, for `info`: the GEMM, the tiles' and VNNI's uses, what forced them.
    pub fn describe(&self) -> String {
        let exact = match self.exact {
            ExactOn::Scaled => "exact: a quantized file's integers and scales on AMX tiles (amx-scaled), other matrices",
            ExactOn::Bf16x3 => "exact: three bf16 parts on AMX tiles (amx-bf16x3); the attention",
            ExactOn::F32 => "exact: everything",
        };
        let fast = match self.fast {
            FastOn::Bf16 => "fast: bf16 on AMX tiles (amx-bf16)",
            FastOn::Int8 => "fast: 8-bit blocks on AVX-512 VNNI (vnni-int8)",
            FastOn::Int8Avx2 => "fast: 8-bit blocks on AVX2 (avx2-int8)",
            FastOn::F32 => "fast: no kernel of its own (exact's)",
        };
        format!(
            "{exact} on the f32 GEMM ({}); {fast}; element-wise loops {}{}",
            self.gemm.name(),
            super::simd::level().name(),
            self.forced
                .as_ref()
                .map(|f| format!(" (set by {f})"))
                .unwrap_or_default()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AMX: Hardware = Hardware {
        amx: true,
        vnni: true,
        gemm: Isa::Avx512,
    };
    const VNNI: Hardware = Hardware {
        amx: false,
        vnni: true,
        gemm: Isa::Avx512,
    };
    const AVX2: Hardware = Hardware {
        amx: false,
        vnni: false,
        gemm: Isa::Avx2,
    };

    fn pick(hw: Hardware, isa: Option<&str>, amx: Option<&str>) -> (Isa, bool, ExactOn, FastOn) {
        let k = choose(hw, (isa, amx)).unwrap_or_else(|e| panic!("{isa:?} {amx:?}: {e}"));
        (k.gemm, k.tiles, k.exact, k.fast)
    }

    /// Each kernel is reachable, and the defaults are the best the CPU runs.
    #[test]
    fn every_kernel_can_be_forced() {
        use ExactOn as E;
        use FastOn as F;
        let cases = [
            (AMX, None, None, (Isa::Avx512, true, E::Scaled, F::Bf16)),
            (
                AMX,
                Some("amx"),
                Some("exact"),
                (Isa::Avx512, true, E::Bf16x3, F::Bf16),
            ),
            (
                AMX,
                None,
                Some("scaled"),
                (Isa::Avx512, true, E::Scaled, F::Bf16),
            ),
            (AMX, None, Some("f32"), (Isa::Avx512, true, E::F32, F::Bf16)),
            (AMX, None, Some("0"), (Isa::Avx512, false, E::F32, F::Int8)),
            (
                AMX,
                Some("avx512"),
                None,
                (Isa::Avx512, false, E::F32, F::Int8),
            ),
            (VNNI, None, None, (Isa::Avx512, false, E::F32, F::Int8)),
            (
                VNNI,
                None,
                Some("f32"),
                (Isa::Avx512, false, E::F32, F::Int8),
            ),
            (AVX2, None, None, (Isa::Avx2, false, E::F32, F::Int8Avx2)),
            (
                AVX2,
                Some("scalar"),
                None,
                (Isa::Scalar, false, E::F32, F::F32),
            ),
        ];
        for (hw, isa, amx, want) in cases {
            assert_eq!(pick(hw, isa, amx), want, "{hw:?} {isa:?} {amx:?}");
        }
        let want = (Isa::Avx2, false, E::F32, F::Int8Avx2);
        assert_eq!(pick(AMX, Some("avx2"), None), want);
        assert_eq!(pick(VNNI, Some("avx2"), None), want);
        // the int8 products' code: VNNI wherever it may run, AVX2 where fast is on it
        use crate::kernels::int8::Int8Kernel as K;
        for (hw, isa, amx, want) in [
            (AMX, None, None, K::Vnni),
            (AMX, None, Some("0"), K::Vnni),
            (AMX, Some("avx2"), None, K::Avx2),
            (AVX2, None, None, K::Avx2),
            (AVX2, Some("scalar"), None, K::Plain),
        ] {
            let k = choose(hw, (isa, amx)).unwrap();
            assert_eq!(k.int8(), want, "{hw:?} {isa:?} {amx:?}");
        }
    }

    /// What the CPU lacks, what contradicts itself and what names nothing is refused, naming
    /// the variable and what to do.
    #[test]
    fn what_cannot_run_is_refused_by_name() {
        for (hw, isa, amx, want) in [
            (
                VNNI,
                Some("amx"),
                None,
                "ATTNSCOPE_ISA=amx asks for the AMX tiles",
            ),
            (
                AVX2,
                None,
                Some("exact"),
                "ATTNSCOPE_AMX=exact asks for the AMX tiles, which this CPU lacks",
            ),
            (VNNI, None, Some("scaled"), "which this CPU lacks"),
            (
                AMX,
                Some("avx512"),
                Some("exact"),
                "which ATTNSCOPE_ISA=avx512 rules out",
            ),
            (AMX, Some("amx"), Some("0"), "turns them off"),
            (
                AMX,
                Some("avx-512"),
                None,
                "ATTNSCOPE_ISA=avx-512 names no kernel",
            ),
            (AMX, None, Some("yes"), "ATTNSCOPE_AMX=yes names no use"),
        ] {
            let e = choose(hw, (isa, amx)).expect_err(&format!("{isa:?} {amx:?} was accepted"));
            assert!(e.contains(want), "{isa:?} {amx:?}: {e}");
        }
        let e = choose(AVX2, (Some("avx512"), None)).unwrap_err();
        assert!(e.contains("AVX-512, which this CPU lacks"), "{e}");
        assert!(e.contains("pick one of: avx2, scalar"), "{e}");
    }
}
