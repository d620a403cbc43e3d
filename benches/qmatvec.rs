//! The decode step's products from the file's blocks (`kernels::qmatvec::rows`), one core, on
//! 2,048 rows of 896 weights of each block type at each vector width this CPU runs. The
//! throughput is the blocks' bytes read: against the machine's bandwidth (`attnscope bench
//! --machine`), it says whether a decode step is bound by memory or by instructions.
//! `cargo bench --bench qmatvec`.

use attnscope::kernels::qmatvec::{matvec, rows, Blocks, Part};
use attnscope::kernels::simd::{all_supported, with_level};
use attnscope::reference::Rng;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;

const K: usize = 896;
const ROWS: usize = 2048;

/// Random bytes with every block's f16 scales set to finite, ordinary values (random bits
/// would give infinities, NaNs and subnormals, whose products run on slow paths).
fn blocks(ty: Blocks, rng: &mut Rng) -> Vec<u8> {
    let (_, wb) = ty.block();
    let n = ROWS * ty.row_bytes(K);
    let mut bytes: Vec<u8> = (0..n).map(|_| (rng.uniform() * 256.0) as u8).collect();
    let scales: &[usize] = match ty {
        Blocks::Q8_0 | Blocks::Q5_0 => &[0],
        Blocks::Q4_1 | Blocks::Q4K => &[0, 2],
        Blocks::Q6K => &[208],
        Blocks::F32 | Blocks::F16 | Blocks::Bf16 => &[],
    };
    let d = half::f16::from_f32(0.0123).to_le_bytes();
    for b in bytes.chunks_exact_mut(wb) {
        for &at in scales {
            b[at..at + 2].copy_from_slice(&d);
        }
    }
    if ty == Blocks::F32 {
        for w in bytes.chunks_exact_mut(4) {
            w.copy_from_slice(&((rng.uniform() - 0.5) as f32).to_le_bytes());
        }
    }
    bytes
}

fn each_type(c: &mut Criterion) {
    let mut rng = Rng::new(62);
    let x: Vec<f32> = rng.normals(K, 1.0);
    let mut g = c.benchmark_group("qmatvec_rows");
    g.sample_size(20)
        .measurement_time(std::time::Duration::from_secs(2));
    for ty in [
        Blocks::Q5_0,
        Blocks::Q8_0,
        Blocks::Q4K,
        Blocks::Q6K,
        Blocks::Q4_1,
        Blocks::F32,
    ] {
        let bytes = blocks(ty, &mut rng);
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        let mut ys = vec![0f32; ROWS];
        for level in all_supported() {
            let id = BenchmarkId::new(format!("{ty:?}"), level.name());
            g.bench_function(id, |b| {
                b.iter(|| with_level(level, || rows(ty, black_box(&bytes), &x, &mut ys, false)))
            });
        }
    }
    g.finish();
}

/// Every core through `matvec` on 512 MiB of rows, more than the caches hold: the rate a
/// decode step can reach from memory, against `bench --machine`'s bandwidth.
fn from_memory(c: &mut Criterion) {
    let mut rng = Rng::new(63);
    let x: Vec<f32> = rng.normals(K, 1.0);
    let mut g = c.benchmark_group("qmatvec_from_memory");
    g.sample_size(10)
        .measurement_time(std::time::Duration::from_secs(4));
    for ty in [Blocks::Q5_0, Blocks::Q8_0, Blocks::F32] {
        let rows = (512 << 20) / ty.row_bytes(K);
        let one = blocks(ty, &mut rng);
        let bytes: Vec<u8> = one
            .iter()
            .copied()
            .cycle()
            .take(rows * ty.row_bytes(K))
            .collect();
        let part = [Part {
            bytes: &bytes,
            ty,
            rows,
        }];
        let mut ys = vec![0f32; rows];
        g.throughput(Throughput::Bytes(bytes.len() as u64));
        g.bench_function(format!("{ty:?}"), |b| {
            b.iter(|| matvec(black_box(&part), &x, &mut ys, false))
        });
    }
    g.finish();
}

criterion_group!(benches, each_type, from_memory);
criterion_main!(benches);
