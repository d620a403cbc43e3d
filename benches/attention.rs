//! The attention kernel over the sequence length: the readable reference (`reference`), the fast
//! path handing out every weight (`materialized`), and the same path streaming over key blocks
//! with per-row statistics only (`streaming`). Shapes of Qwen2.5-0.5B: 14 query heads sharing 2
//! KV heads of 64 dims. `cargo bench --bench attention`.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use attnscope::analysis::collect::Collector;
use attnscope::analysis::stream::StreamStats;
use attnscope::model::forward::{attention, AttnDims, RunOptions};
use attnscope::reference::{grouped_query_attention, Mask, Rng};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

const H: usize = 14;
const KV: usize = 2;
const D: usize = 64;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    for n in [64usize, 256, 1024, 4096] {
        let mut rng = Rng::new(n as u64);
        let (q, k, v) = (
            rng.normals(H * n * D, 1.0),
            rng.normals(KV * n * D, 1.0),
            rng.normals(KV * n * D, 1.0),
        );
        g.throughput(Throughput::Elements((H * n * (n + 1) / 2) as u64)); // (query, key) pairs
        let (qt, kt, vt) = (&q, &k, &v); // [heads, n, D]
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
        let knock = vec![false; n];
        if n <= 1024 {
            // the reference takes [pos, head, dim] rows
            let to_rows = |x: &[f32], heads: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|p| (0..heads).flat_map(move |h| x[(h * n + p) * D..][..D].to_vec()))
                    .collect()
            };
            let (qr, kr, vr) = (to_rows(&q, H), to_rows(&k, KV), to_rows(&v, KV));
            g.bench_with_input(BenchmarkId::new("reference", n), &n, |b, _| {
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
        if n <= 2048 {
            g.bench_with_input(BenchmarkId::new("materialized", n), &n, |b, _| {
                b.iter(|| {
                    let mut c = Collector::new(1, H, n, n - 1);
                    black_box(
                        attention(
                            0,
                            qt,
                            kt,
                            vt,
                            dims,
                            &knock,
                            RunOptions::default().block_bytes,
                            1024,
                            &mut c,
                        )
                        .unwrap(),
                    )
                })
            });
        }
        g.bench_with_input(BenchmarkId::new("streaming", n), &n, |b, _| {
            b.iter(|| {
                let mut s = StreamStats::new(1, H, n, 5, Box::new(|_| {}));
                black_box(
                    attention(
                        0,
                        qt,
                        kt,
                        vt,
                        dims,
                        &knock,
                        RunOptions::default().block_bytes,
                        1024,
                        &mut s,
                    )
                    .unwrap(),
                )
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
