//! The attention kernel over the sequence length: the readable reference (`reference`), the fast
//! path handing out every weight (`materialized`), and the same path streaming over key blocks
//! with per-row statistics only (`streaming`). Shapes of Qwen2.5-0.5B: 14 query heads sharing 2
//! KV heads of 64 dims. `cargo bench --bench attention`.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use attnscope::analysis::collect::Collector;
use attnscope::analysis::stream::StreamStats;
use attnscope::model::attention::{attention, AttnDims};
use attnscope::model::capture::Observer;
use attnscope::model::forward::RunOptions;
use attnscope::reference::{grouped_query_attention, Mask, Rng};
use criterion::measurement::WallTime;
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use std::hint::black_box;

const H: usize = 14;
const KV: usize = 2;
const D: usize = 64;

/// One sequence length's random queries, keys and values (`[heads, n, D]`), the kernel's shapes
/// and its (empty) knockout mask.
struct Inputs {
    n: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    dims: AttnDims,
    knock: Vec<bool>,
}

impl Inputs {
    fn new(n: usize) -> Self {
        let mut rng = Rng::new(n as u64);
        let (q, k, v) = (
            rng.normals(H * n * D, 1.0),
            rng.normals(KV * n * D, 1.0),
            rng.normals(KV * n * D, 1.0),
        );
        let dims = AttnDims {
            n_heads: H,
            n_kv_heads: KV,
            head_dim: D,
            q_len: n,
            k_len: n,
            window: None,
            scale: None,
            softcap: None,
            causal: true,
        };
        Inputs {
            n,
            q,
            k,
            v,
            dims,
            knock: vec![false; n],
        }
    }

    /// `x` (`[heads, n, D]`) as the reference takes it: `[pos, head, dim]` rows.
    fn to_rows(&self, x: &[f32], heads: usize) -> Vec<f32> {
        let n = self.n;
        (0..n)
            .flat_map(|p| (0..heads).flat_map(move |h| x[(h * n + p) * D..][..D].to_vec()))
            .collect()
    }
}

/// The readable reference, on `[pos, head, dim]` rows.
fn bench_reference(g: &mut BenchmarkGroup<WallTime>, x: &Inputs) {
    let (qr, kr, vr) = (x.to_rows(&x.q, H), x.to_rows(&x.k, KV), x.to_rows(&x.v, KV));
    g.bench_with_input(BenchmarkId::new("reference", x.n), &x.n, |b, _| {
        b.iter(|| {
            black_box(grouped_query_attention(
                &qr,
                &kr,
                &vr,
                H,
                KV,
                D,
                Mask::Causal { offset: 0 },
            ))
        })
    });
}

/// The fast kernel handing what it computes to the observer `observer()` makes afresh for each
/// iteration.
fn bench_kernel<O: Observer>(
    g: &mut BenchmarkGroup<WallTime>,
    name: &str,
    x: &Inputs,
    observer: impl Fn() -> O,
) {
    g.bench_with_input(BenchmarkId::new(name, x.n), &x.n, |b, _| {
        b.iter(|| {
            let mut o = observer();
            black_box(
                attention(
                    0,
                    &x.q,
                    &x.k,
                    &x.v,
                    x.dims,
                    &x.knock,
                    RunOptions::default().block_bytes,
                    1024,
                    &mut o,
                )
                .unwrap(),
            )
        })
    });
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    for n in [64usize, 256, 1024, 4096] {
        let x = Inputs::new(n);
        g.throughput(Throughput::Elements((H * n * (n + 1) / 2) as u64)); // (query, key) pairs
        if n <= 1024 {
            bench_reference(&mut g, &x);
        }
        if n <= 2048 {
            bench_kernel(&mut g, "materialized", &x, || {
                Collector::new(1, H, n, n - 1)
            });
        }
        bench_kernel(&mut g, "streaming", &x, || {
            StreamStats::new(1, H, n, 5, Box::new(|_| {}))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
