//! A whole forward of the default model (fetched on first use), with and without full pattern
//! capture, on the lesson's sentence and on 512 tokens of the built-in corpus.
//! `cargo bench --bench forward`; compare with the transformers figures in the README.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

use attnscope::model::capture::{AttnCache, CaptureSpec, NoCapture};
use attnscope::model::forward::RunOptions;
use attnscope::model::{Model, Precision};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let model =
        Model::load("qwen2.5-coder-0.5b", Precision::Exact, true).expect("the default model loads");
    let sentence = model
        .encode(
            "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.",
            false,
        )
        .unwrap();
    let corpus = model
        .encode(&attnscope::analysis::corpus::builtin().join("\n"), false)
        .unwrap();
    let mut g = c.benchmark_group("forward");
    g.sample_size(10)
        .warm_up_time(std::time::Duration::from_secs(1))
        .measurement_time(std::time::Duration::from_secs(3));
    for (label, tokens) in [("sentence", &sentence[..]), ("512", &corpus[..512])] {
        let n = tokens.len();
        g.bench_with_input(BenchmarkId::new("no_capture", label), &n, |b, _| {
            b.iter(|| {
                black_box(
                    model
                        .forward(tokens, &RunOptions::last_logits(n), &mut NoCapture)
                        .unwrap()
                        .logits,
                )
            })
        });
        g.bench_with_input(BenchmarkId::new("all_patterns", label), &n, |b, _| {
            b.iter(|| {
                let mut cache = AttnCache::new(&CaptureSpec::patterns(), n);
                model
                    .forward(tokens, &RunOptions::last_logits(n), &mut cache)
                    .unwrap();
                black_box(cache.entries.len())
            })
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
