//! The output head's logits of 1, 8 and 120 rows (`ops::logits_rows`: chunks of vocabulary rows on
//! every core) on smollm2-135m's shapes (49,152 vocabulary rows of 576), and one chunk's products
//! on one core (`ops::dot_rows`) at each vector width this CPU runs. `cargo bench --bench logits`.

use attnscope::kernels::simd::{all_supported, with_level};
use attnscope::model::ops::{dot_rows, logits_rows};
use attnscope::model::weights::Head;
use attnscope::reference::Rng;
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

const VOCAB: usize = 49_152;
const D: usize = 576;
const ROWS: [usize; 3] = [1, 8, 120];

/// Every row's logits against the whole head, on every core.
fn whole_head(c: &mut Criterion) {
    let mut rng = Rng::new(60);
    let w = Tensor::from_vec(rng.normals(VOCAB * D, 0.05), (VOCAB, D), &Device::Cpu)
        .expect("a [vocab, d] head");
    let head = Head::Dense(w);
    let mut g = c.benchmark_group("logits_rows");
    g.sample_size(10)
        .measurement_time(std::time::Duration::from_secs(3));
    for rows in ROWS {
        let h = rng.normals(rows * D, 1.0);
        g.throughput(Throughput::Elements((rows * VOCAB * D) as u64));
        g.bench_with_input(BenchmarkId::from_parameter(rows), &h, |b, h| {
            b.iter(|| black_box(logits_rows(&head, h.clone(), rows, D).expect("logits")))
        });
    }
    g.finish();
}

/// One 256-row chunk of the head on one core, at each vector width.
fn one_chunk(c: &mut Criterion) {
    let n = 256;
    let mut rng = Rng::new(61);
    let w = rng.normals(n * D, 0.05);
    let mut g = c.benchmark_group("dot_rows");
    g.sample_size(20)
        .measurement_time(std::time::Duration::from_secs(2));
    for level in all_supported() {
        for rows in ROWS {
            let h = rng.normals(rows * D, 1.0);
            let mut out = vec![vec![0f32; n]; rows];
            g.throughput(Throughput::Elements((rows * n * D) as u64));
            let id = BenchmarkId::new(level.name(), rows);
            g.bench_function(id, |b| {
                b.iter(|| {
                    let mut refs: Vec<&mut [f32]> = out.iter_mut().map(|r| &mut r[..]).collect();
                    with_level(level, || dot_rows(&h, &w, D, &mut refs));
                })
            });
        }
    }
    g.finish();
}

criterion_group!(benches, one_chunk, whole_head);
criterion_main!(benches);
