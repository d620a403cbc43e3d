//! Attention invariants over random shapes (proptest): rows sum to 1, masked entries are 0,
//! grouped-query attention equals multi-head attention with repeated K/V, and the fast path
//! (materialized or streamed over key blocks) equals the reference.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;
use attnscope::analysis::stream::StreamStats;
use attnscope::model::attention::{attention, AttnDims};
use attnscope::model::capture::{AttnCache, CaptureSpec};
use attnscope::reference::{grouped_query_attention, head_slice, repeat_kv, Mask, Rng};
use proptest::prelude::*;

/// (n_heads, n_kv_heads, head_dim, q_len, prefix, seed)
fn shapes() -> impl Strategy<Value = (usize, usize, usize, usize, usize, u64)> {
    (
        1usize..=4,
        1usize..=4,
        prop::sample::select(vec![2usize, 4, 8, 16]),
        1usize..=24,
        0usize..=6,
        any::<u64>(),
    )
        .prop_map(|(kv, g, d, n, p, s)| (kv * g, kv, d, n, p, s))
}

/// [pos, heads·d] rows → [heads, pos, d]
fn to_heads(x: &[f32], _len: usize, heads: usize, d: usize) -> Vec<f32> {
    (0..heads)
        .flat_map(|h| head_slice(x, h, heads, d))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn reference_rows_sum_to_one_and_masked_are_zero((h, kv, d, n, p, seed) in shapes()) {
        let mut rng = Rng::new(seed);
        let k_len = n + p;
        let (q, k, v) = (rng.normals(n * h * d, 2.0), rng.normals(k_len * kv * d, 2.0), rng.normals(k_len * kv * d, 1.0));
        let out = grouped_query_attention(&q, &k, &v, h, kv, d, Mask::Causal { offset: p });
        for (r, row) in out.pattern.chunks(k_len).enumerate() {
            let i = r % n;
            prop_assert!((row.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            prop_assert!(row[i + p + 1..].iter().all(|&w| w == 0.0));
        }
    }

    #[test]
    fn gqa_equals_mha_with_repeated_kv((h, kv, d, n, _p, seed) in shapes()) {
        let mut rng = Rng::new(seed);
        let (q, k, v) = (rng.normals(n * h * d, 1.0), rng.normals(n * kv * d, 1.0), rng.normals(n * kv * d, 1.0));
        let gqa = grouped_query_attention(&q, &k, &v, h, kv, d, Mask::Causal { offset: 0 });
        let mha = grouped_query_attention(&q, &repeat_kv(&k, kv, h / kv, d), &repeat_kv(&v, kv, h / kv, d), h, h, d, Mask::Causal { offset: 0 });
        prop_assert_eq!(gqa.pattern, mha.pattern);
        prop_assert_eq!(gqa.z, mha.z);
    }

    /// The fast attention (with a reused prefix of p keys, query blocks of a few rows, and keys
    /// streamed in blocks of `kb`) equals the reference: outputs, and patterns when materialized.
    #[test]
    fn fast_path_equals_reference((h, kv, d, n, p, seed) in shapes(), kb in 1usize..=9, rows_budget in 1usize..=5, window in proptest::option::of(1usize..=6)) {
        let mut rng = Rng::new(seed);
        let k_len = n + p;
        let (q, k, v) = (rng.normals(n * h * d, 1.5), rng.normals(k_len * kv * d, 1.5), rng.normals(k_len * kv * d, 1.0));
        let mask = match window {
            Some(window) => Mask::Sliding { offset: p, window },
            None => Mask::Causal { offset: p },
        };
        let want = grouped_query_attention(&q, &k, &v, h, kv, d, mask);
        let (qt, kt, vt) = (to_heads(&q, n, h, d), to_heads(&k, k_len, kv, d), to_heads(&v, k_len, kv, d));
        let block_bytes = rows_budget * h * k_len.min(kb) * 4;
        let knock = vec![false; k_len];
        // materialized: the cache sees every weight
        let mut cache = AttnCache::new(&CaptureSpec::patterns(), k_len);
        let dims = AttnDims { n_heads: h, n_kv_heads: kv, head_dim: d, q_len: n, k_len, window, scale: None, softcap: None, causal: true };
        let z = attention(0, &qt, &kt, &vt, dims, &knock, block_bytes, kb, &mut cache).unwrap();
        // z is [pos, head, d], the reference's layout
        prop_assert_eq!(z.len(), want.z.len());
        common::assert_close(&z, &want.z, 1e-5, "materialized z");
        let pat = cache.pattern(0).unwrap();
        for hh in 0..h {
            for i in 0..n {
                let got = pat.row_at(hh, p + i).unwrap();
                common::assert_close(got, &want.pattern[(hh * n + i) * k_len..][..k_len], 1e-5, "materialized pattern");
            }
        }
        // streamed over key blocks of kb: same outputs
        let mut stats = StreamStats::new(1, h, k_len, 2, Box::new(|_| {}));
        let zs = attention(0, &qt, &kt, &vt, dims, &knock, block_bytes, kb, &mut stats).unwrap();
        common::assert_close(&zs, &want.z, 1e-5, "streamed z");
    }
}
