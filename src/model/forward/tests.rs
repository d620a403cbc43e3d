//! The forward's unit tests (kept apart so forward.rs stays readable).

use super::*;
use crate::model::attention::{
    attention, exp_shift_sums, exp_shift_sums_dense, exp_shift_sums_masked, fast_exp,
    max_and_index, max_of, AttnDims,
};
use crate::model::ops::{dot_rows, logits_rows, scale_by, stream_fence, stream_store, swiglu_row};
use crate::model::weights::Mapped;
use crate::reference::{grouped_query_attention_f64, heads_to_rows};

#[test]
fn fast_exp_is_accurate_on_softmax_inputs() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x <= 0.0 {
        let want = (x as f64).exp();
        let got = fast_exp(x) as f64;
        worst = worst.max(((got - want) / want).abs());
        x += 0.0137;
    }
    assert!(worst < 3e-7, "worst relative error {worst:e}");
    assert_eq!(fast_exp(0.0), 1.0);
}

#[test]
fn max_and_index_finds_the_maximum_and_its_first_place() {
    for len in [0usize, 1, 15, 16, 17, 40, 63, 64, 65, 100, 130, 200] {
        // ties everywhere: every value occurs in many lanes
        let xs: Vec<f32> = (0..len).map(|i| (i % 7) as f32).collect();
        let want = |ys: &[f32]| {
            let m = ys.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            (m, ys.iter().position(|&x| x == m && m > f32::NEG_INFINITY))
        };
        assert_eq!(max_and_index(&xs), want(&xs), "len {len}");
        assert_eq!(max_and_index(&xs).0, max_of(&xs));
        // a lone maximum anywhere, the remainder included; and a tie at two places
        for at in 0..len {
            let mut ys = xs.clone();
            ys[at] = 9.0;
            assert_eq!(max_and_index(&ys), (9.0, Some(at)), "len {len} at {at}");
            if at + 3 < len {
                ys[at + 3] = 9.0;
                assert_eq!(
                    max_and_index(&ys),
                    (9.0, Some(at)),
                    "tie, len {len} at {at}"
                );
            }
        }
        let masked = vec![f32::NEG_INFINITY; len];
        assert_eq!(max_and_index(&masked), (f32::NEG_INFINITY, None));
    }
}

#[test]
fn all_finite_sees_every_nan_and_infinity() {
    for len in [0usize, 1, 15, 16, 17, 40] {
        let xs: Vec<f32> = (0..len).map(|i| i as f32 - 7.5).collect();
        assert!(all_finite(&xs));
        for at in 0..len {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut ys = xs.clone();
                ys[at] = bad;
                assert!(!all_finite(&ys), "{bad} at {at} of {len}");
            }
        }
    }
}

#[test]
fn a_nan_score_fails_the_layer() {
    let dims = causal_dims((2, 1, 4), 5, None);
    let mut rng = crate::reference::Rng::new(3);
    let (q, k, v) = (
        rng.normals(2 * 5 * 4, 1.0),
        rng.normals(5 * 4, 1.0),
        rng.normals(5 * 4, 1.0),
    );
    assert!(attention(
        3,
        &q,
        &k,
        &v,
        dims,
        &[false; 5],
        1 << 20,
        2,
        &mut crate::model::capture::NoCapture
    )
    .is_ok());
    for (at, key_block) in [(0usize, 2usize), (7, 5), (13, 1)] {
        let mut kk = k.clone();
        kk[at] = f32::NAN;
        let e = attention(
            3,
            &q,
            &kk,
            &v,
            dims,
            &[false; 5],
            1 << 20,
            key_block,
            &mut crate::model::capture::NoCapture,
        )
        .unwrap_err();
        assert!(matches!(e, Error::NonFinite { layer: Some(3), .. }), "{e}");
        // with a knocked-out key (the masked path) as well
        let e = attention(
            3,
            &q,
            &kk,
            &v,
            dims,
            &[false, false, true, false, false],
            1 << 20,
            key_block,
            &mut crate::model::capture::NoCapture,
        )
        .unwrap_err();
        assert!(matches!(e, Error::NonFinite { layer: Some(3), .. }), "{e}");
    }
}

/// Causal attention dimensions of `(n_heads, n_kv_heads, head_dim)` over `n` queries and keys.
fn causal_dims((h, kv, d): (usize, usize, usize), n: usize, window: Option<usize>) -> AttnDims {
    AttnDims {
        n_heads: h,
        n_kv_heads: kv,
        head_dim: d,
        q_len: n,
        k_len: n,
        window,
        scale: None,
        softcap: None,
        causal: true,
    }
}

/// The largest `|q_i · k_i| · scale` of every head's query with its own position's key (rows
/// `[n, heads, d]`, query head `hh` reading KV head `hh / (h / kv)`), in float64.
fn largest_own_score(
    qr: &[f32],
    kr: &[f32],
    (h, kv, d): (usize, usize, usize),
    n: usize,
    scale: f64,
) -> f64 {
    let mut largest = 0f64;
    for hh in 0..h {
        let g = hh / (h / kv);
        for i in 0..n {
            let qi = &qr[(i * h + hh) * d..][..d];
            let kj = &kr[(i * kv + g) * d..][..d];
            let s = qi
                .iter()
                .zip(kj)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>()
                * scale;
            largest = largest.max(s.abs());
        }
    }
    largest
}

/// The largest difference of `got` from the float64 `want` (infinite for a NaN).
fn largest_difference(got: &[f32], want: &[f64]) -> f64 {
    got.iter().zip(want).fold(0f64, |m, (&got, &w)| {
        let diff = (got as f64 - w).abs();
        if diff.is_nan() {
            f64::INFINITY
        } else {
            m.max(diff)
        }
    })
}

/// Scores in the thousands that differ by a few units (Qwen2.5-1.5B's first layer): the
/// weights and outputs within 2e-6 of a float64 computation of the same q, k, v, streamed
/// or not, with a knockout and a sliding window (the masked paths); f32 scores alone miss by
/// ~1e-4 here (checked: this test fails with `EXACT_SCORES_ABOVE` raised out of reach).
#[test]
fn large_scores_are_rounded_after_the_shift_not_before() {
    let (h, kv, d, n) = (4usize, 2usize, 128usize, 40usize);
    let mut rng = crate::reference::Rng::new(5);
    // every key and query near one large direction: scores ≈ 4,000, spread of a few units
    let u: Vec<f32> = rng.normals(d, 1.0);
    let big = |rng: &mut crate::reference::Rng, rows: usize, c: f32| -> Vec<f32> {
        let noise = rng.normals(rows * d, 0.4);
        (0..rows * d).map(|i| c * u[i % d] + noise[i]).collect()
    };
    let q = big(&mut rng, h * n, 8.0);
    let k = big(&mut rng, kv * n, 40.0);
    let v = rng.normals(kv * n * d, 1.0);
    let scale = 1.0 / (d as f64).sqrt();
    let cases: [(Vec<bool>, Option<usize>, usize); 4] = [
        (vec![false; n], None, n),
        (vec![false; n], None, 8),
        ((0..n).map(|j| j % 7 == 3).collect(), None, 8),
        (vec![false; n], Some(9), 8),
    ];
    let mut largest = 0f64;
    for (knock, window, key_block) in cases {
        let dims = causal_dims((h, kv, d), n, window);
        let z = attention(
            0,
            &q,
            &k,
            &v,
            dims,
            &knock,
            1 << 20,
            key_block,
            &mut crate::model::capture::NoCapture,
        )
        .unwrap();
        let (qr, kr, vr) = (
            heads_to_rows(&q, h, d),
            heads_to_rows(&k, kv, d),
            heads_to_rows(&v, kv, d),
        );
        let want = grouped_query_attention_f64(&qr, &kr, &vr, (h, kv, d), |i, j| {
            crate::model::attention::visible(i, j, &knock, window)
        });
        // every query sees its own key: those scores show how large the scores are
        largest = largest.max(largest_own_score(&qr, &kr, (h, kv, d), n, scale));
        assert_eq!(z.len(), want.z.len());
        let worst = largest_difference(&z, &want.z);
        assert!(
            worst < 2e-6,
            "window {window:?}, key block {key_block}: output {worst:.2e} from float64"
        );
    }
    assert!(largest > 2_000.0, "the scores are large: {largest}");
}

/// Streamed key blocks of 512 and 1,024 keys (rows 2 and 4 KiB apart, which get
/// [`ROW_SLACK`]) give the reference's outputs, and with a knockout (the masked path) the
/// same as blocks whose rows get none.
#[test]
fn streamed_blocks_with_row_slack_match_the_reference() {
    let (h, kv, d, n) = (4usize, 2usize, 16usize, 1100usize);
    let mut rng = crate::reference::Rng::new(11);
    let (q, k, v) = (
        rng.normals(h * n * d, 1.0),
        rng.normals(kv * n * d, 1.0),
        rng.normals(kv * n * d, 1.0),
    );
    let dims = causal_dims((h, kv, d), n, None);
    let run = |knock: &[bool], key_block: usize| {
        attention(
            0,
            &q,
            &k,
            &v,
            dims,
            knock,
            1 << 20,
            key_block,
            &mut crate::model::capture::NoCapture,
        )
        .unwrap()
    };
    // the reference takes [position, head, dim] rows
    let rows = |x: &[f32], heads: usize| -> Vec<f32> {
        (0..n)
            .flat_map(|p| (0..heads).flat_map(move |g| x[(g * n + p) * d..][..d].to_vec()))
            .collect()
    };
    let want = crate::reference::grouped_query_attention(
        &rows(&q, h),
        &rows(&k, kv),
        &rows(&v, kv),
        h,
        kv,
        d,
        crate::reference::Mask::Causal { offset: 0 },
    )
    .z;
    let close = |a: &[f32], b: &[f32], what: &str| {
        assert_eq!(a.len(), b.len());
        let worst = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-5, "{what}: worst difference {worst:e}");
    };
    for key_block in [512, 1024] {
        close(
            &run(&vec![false; n], key_block),
            &want,
            &format!("key block {key_block}"),
        );
    }
    let mut knock = vec![false; n];
    for p in [3, 600, 1030] {
        knock[p] = true;
    }
    let plain = run(&knock, 300);
    for key_block in [512, 1024] {
        close(
            &run(&knock, key_block),
            &plain,
            &format!("knockout, key block {key_block}"),
        );
    }
}

#[test]
fn max_of_is_the_maximum() {
    for n in [0usize, 1, 15, 16, 17, 40, 63, 64, 65, 130, 200] {
        let xs: Vec<f32> = (0..n).map(|i| ((i * 7919) % 53) as f32 - 20.0).collect();
        let want = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        assert_eq!(max_of(&xs), want, "n = {n}");
    }
    assert_eq!(max_of(&[f32::NEG_INFINITY, -3.0, f32::NEG_INFINITY]), -3.0);
}

#[test]
fn streamed_stores_copy_exactly_their_stretch_at_any_alignment() {
    let src: Vec<f32> = (0..100).map(|i| i as f32 * 0.5 - 7.25).collect();
    for start in 0..17 {
        for len in [0, 1, 5, 15, 16, 17, 31, 32, 33, 47, 64, 70] {
            let mut buf = vec![f32::NAN; 120];
            stream_store(&mut buf[start..start + len], &src[..len]);
            stream_fence();
            for (i, x) in buf.iter().enumerate() {
                if i >= start && i < start + len {
                    assert_eq!(
                        x.to_bits(),
                        src[i - start].to_bits(),
                        "{start}+{len} at {i}"
                    );
                } else {
                    assert!(x.is_nan(), "{start}+{len}: wrote outside at {i}");
                }
            }
        }
    }
}

#[test]
fn dense_exp_sums_equal_the_masked_version_on_finite_rows() {
    let xs: Vec<f32> = (0..37)
        .map(|i| ((i * 7919) % 101) as f32 * 0.1 - 5.0)
        .collect();
    let (mut a, mut b) = (xs.clone(), xs.clone());
    let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (la, ta) = exp_shift_sums::<true>(&mut a, m);
    let (lb, tb) = exp_shift_sums::<false>(&mut b, m);
    assert!(
        (la - lb).abs() < 1e-6 && (ta - tb).abs() < 1e-5,
        "{la} {lb} {ta} {tb}"
    );
    assert_eq!(a, b);
}

#[test]
fn exp_shift_sums_zeroes_masked_entries() {
    let mut xs = vec![
        0.5,
        f32::NEG_INFINITY,
        0.25,
        1.0,
        f32::NEG_INFINITY,
        0.0,
        -1.0,
        2.0,
        0.3,
        f32::NEG_INFINITY,
    ];
    let orig = xs.clone();
    let (l, t) = exp_shift_sums::<true>(&mut xs, 2.0);
    let want_l: f64 = orig
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| ((x - 2.0) as f64).exp())
        .sum();
    let want_t: f64 = orig
        .iter()
        .filter(|x| x.is_finite())
        .map(|&x| ((x - 2.0) as f64).exp() * x as f64)
        .sum();
    assert!((l - want_l).abs() < 1e-6 && (t - want_t).abs() < 1e-6);
    assert_eq!((xs[1], xs[4], xs[9]), (0.0, 0.0, 0.0));
}

/// `dot_rows`'s tiles (4 x 6 on AVX-512, 3 x 2 on AVX2, 4 x 2 elsewhere, the edges in smaller
/// ones) give each product [`dot16`]'s bits, for every count of rows and vocabulary rows around
/// the tiles' edges (rows 0..=13, vocabulary rows 0..=10) and `d` shorter than 16 or with a
/// tail, at every vector width this CPU runs.
#[test]
fn dot_rows_gives_dot16s_bits_in_its_tiles() {
    use crate::kernels::simd::{all_supported, with_level};
    use crate::model::ops::dot16;
    for d in [5, 37, 64, 100, 576] {
        let h: Vec<f32> = (0..13 * d)
            .map(|i| ((i * 7919) % 113) as f32 * 0.013 - 0.7)
            .collect();
        let w: Vec<f32> = (0..10 * d)
            .map(|i| ((i * 104_729) % 97) as f32 * 0.021 - 1.0)
            .collect();
        let mut checked = 0;
        for rows in 0..=13 {
            for nv in 0..=10 {
                for l in all_supported() {
                    let mut out = vec![vec![f32::NAN; nv]; rows];
                    let mut refs: Vec<&mut [f32]> = out.iter_mut().map(|r| &mut r[..]).collect();
                    with_level(l, || dot_rows(&h[..rows * d], &w[..nv * d], d, &mut refs));
                    for (i, row) in out.iter().enumerate() {
                        for (v, &got) in row.iter().enumerate() {
                            let want = dot16(&h[i * d..(i + 1) * d], &w[v * d..(v + 1) * d]);
                            assert_eq!(got.to_bits(), want.to_bits(), "{l:?} d {d} ({i}, {v})");
                            checked += 1;
                        }
                    }
                }
            }
        }
        assert_eq!(checked, 91 * 55 * all_supported().len(), "d {d}");
    }
}

/// The logits of many rows on every core (chunks of vocabulary rows, each in `dot_rows`'s
/// tiles) are each row's [`dot16`]s: the same bits as that row alone, whatever the rows beside it.
#[test]
fn many_rows_logits_are_each_rows_dot16s() {
    use crate::model::ops::dot16;
    let (vocab, d, rows) = (601, 72, 11);
    let mut rng = crate::reference::Rng::new(60);
    let wv = rng.normals(vocab * d, 0.5);
    let w = Tensor::from_vec(wv.clone(), (vocab, d), &Device::Cpu).unwrap();
    let h = rng.normals(rows * d, 1.0);
    let got = logits_rows(&Head::Dense(w.clone()), h.clone(), rows, d).unwrap();
    assert_eq!(got.len(), rows);
    for (i, g) in got.iter().enumerate() {
        let alone = logits_rows(
            &Head::Dense(w.clone()),
            h[i * d..(i + 1) * d].to_vec(),
            1,
            d,
        );
        assert_eq!(alone.unwrap()[0], *g, "row {i} alone");
        for (v, &x) in g.iter().enumerate() {
            let want = dot16(&h[i * d..(i + 1) * d], &wv[v * d..(v + 1) * d]);
            assert_eq!(x.to_bits(), want.to_bits(), "row {i} logit {v}");
        }
    }
}

#[test]
fn dense_logits_match_candles_matmul() {
    // a [vocab, d] head: the rows read in place against candle's matmul on the same tensor
    let (vocab, d, rows) = (1000, 72, 3);
    let mut rng = crate::reference::Rng::new(11);
    let w = Tensor::from_vec(rng.normals(vocab * d, 0.5), (vocab, d), &Device::Cpu).unwrap();
    let h = rng.normals(rows * d, 1.0);
    let got = logits_rows(&Head::Dense(w.clone()), h.clone(), rows, d).unwrap();
    let want: Vec<Vec<f32>> = Tensor::from_vec(h.clone(), (rows, d), &Device::Cpu)
        .unwrap()
        .matmul(&w.t().unwrap())
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(got.len(), rows);
    let wv: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    for (i, (g, c)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), vocab);
        for v in 0..vocab {
            let exact: f64 = (0..d)
                .map(|j| h[i * d + j] as f64 * wv[v * d + j] as f64)
                .sum();
            assert!((g[v] as f64 - exact).abs() < 1e-5, "row {i} logit {v}");
            assert!(
                (g[v] - c[v]).abs() < 1e-5,
                "row {i} logit {v} against candle"
            );
        }
    }
}

#[test]
fn a_quantized_head_read_a_chunk_at_a_time_equals_its_dequantized_matrix() {
    // Q8_0 blocks (`exact` keeps a file's quantized head as blocks and dequantizes 256
    // vocabulary rows at a time): the same bits as the dense dequantized head, for a vocab
    // that is not a whole number of chunks; fast's candle matmul on the blocks close by
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    let (vocab, d, rows) = (700, 64, 3);
    let mut rng = crate::reference::Rng::new(12);
    let w = Tensor::from_vec(rng.normals(vocab * d, 0.5), (vocab, d), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let bytes = q.data().unwrap().to_vec();
    let blocks = Mapped {
        offset: 0,
        len: bytes.len(),
        map: std::sync::Arc::new(super::super::gguf::Backing::Bytes(bytes)),
        dtype: GgmlDType::Q8_0.into(),
        dims: vec![vocab, d],
    };
    let h = rng.normals(rows * d, 1.0);
    let dense = Head::Dense(q.dequantize(&Device::Cpu).unwrap());
    let want = logits_rows(&dense, h.clone(), rows, d).unwrap();
    let got = logits_rows(&Head::Rows(blocks), h.clone(), rows, d).unwrap();
    assert_eq!(got, want);
    let quant = logits_rows(&Head::Quant(QMatMul::from_qtensor(q).unwrap()), h, rows, d);
    for (g, c) in quant.unwrap().iter().zip(&want) {
        assert_eq!(g.len(), vocab);
        // candle quantizes the rows to 8 bits too
        assert!(g
            .iter()
            .zip(c)
            .all(|(a, b)| (a - b).abs() < 0.05 * (1.0 + b.abs())));
    }
    // a head whose rows are not `d` wide is refused, not read askew
    let bad = Mapped {
        offset: 0,
        len: 34,
        map: std::sync::Arc::new(super::super::gguf::Backing::Bytes(vec![0; 34])),
        dtype: GgmlDType::Q8_0.into(),
        dims: vec![1, 32],
    };
    assert!(logits_rows(&Head::Rows(bad), vec![0.0; d], 1, d).is_err());
}

#[test]
fn every_vector_width_gives_the_same_bits() {
    use crate::kernels::simd::{all_supported, with_level, Level};
    // 1,000 values: 62 lanes of 16 and a remainder; scores, gates and a masked stretch
    let xs: Vec<f32> = (0..1000)
        .map(|i| ((i * 7919) % 1013) as f32 * 0.02 - 10.0)
        .collect();
    let mut masked = xs.clone();
    masked[100..180]
        .iter_mut()
        .for_each(|x| *x = f32::NEG_INFINITY);
    let m = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let run = |l: Level| {
        with_level(l, || {
            let (mut d, mut k) = (xs.clone(), masked.clone());
            let sd = exp_shift_sums_dense(&mut d, m);
            let sk = exp_shift_sums_masked(&mut k, m);
            let mut out = vec![0f32; 500];
            swiglu_row(&xs[..500], &xs[500..], &mut out);
            let mut scaled = xs.clone();
            scale_by(&mut scaled, 0.37);
            let mut bad = xs.clone();
            bad[999] = f32::NAN;
            // logits: 3 rows of 100 values (6 lanes of 16 and a remainder) against 10 rows
            let mut logits = vec![0f32; 30];
            let mut rows: Vec<&mut [f32]> = logits.chunks_mut(10).collect();
            dot_rows(&xs[..300], &xs[..1000], 100, &mut rows);
            (
                (max_of(&xs), max_of(&masked), sd, sk),
                (d, k, out, scaled, logits),
                (all_finite(&xs), all_finite(&bad)),
            )
        })
    };
    let levels = all_supported();
    let base = run(Level::Base);
    assert_eq!(base.0 .0, m);
    assert_eq!(base.2, (true, false));
    for l in levels {
        let got = run(l);
        assert_eq!(got.0, base.0, "{l:?}");
        assert_eq!(got.2, base.2, "{l:?}");
        // bit for bit (the loops never fuse a multiply and an add, at any width)
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (a, b) in [
            (&got.1 .0, &base.1 .0),
            (&got.1 .1, &base.1 .1),
            (&got.1 .2, &base.1 .2),
            (&got.1 .3, &base.1 .3),
            (&got.1 .4, &base.1 .4),
        ] {
            assert_eq!(bits(a), bits(b), "{l:?}");
        }
    }
    if all_supported().len() < 3 {
        eprintln!(
            "simd: this CPU runs {:?} only; the wider bodies were not checked here",
            all_supported()
        );
    }
}

#[test]
fn erf_and_the_exact_gelu_match_pythons_math_erf() {
    use crate::model::ops::{erf64, gelu_erf_of};
    // Python's math.erf
    for (z, want) in [
        (0.5, 0.5204998778130465),
        (1.0, 0.8427007929497149),
        (2.0, 0.9953222650189527),
        (3.5, 0.9999992569016276),
        (-1.0, -0.8427007929497149),
        (4.2, 0.9999999971445058),
    ] {
        // the series loses ~1e-12 to cancellation near |z| = 4: far below f32's precision
        assert!(
            (erf64(z) - want).abs() < 1e-11,
            "erf({z}): {:e}",
            erf64(z) - want
        );
    }
    // 0.5·x·(1 + math.erf(x/√2)), relative to f32's precision
    for (x, want) in [
        (1.0f32, 0.8413447460685429f64),
        (-0.5, -0.15426876936299344),
        (3.0, 2.99595030590511),
        (-4.0, -0.00012668496733247991),
        (-7.0, -8.958687807200846e-12),
        (7.0, 6.999999999991041),
    ] {
        let got = gelu_erf_of(x) as f64;
        assert!(
            (got - want).abs() <= 1e-6 * want.abs().max(1e-5),
            "gelu({x}) = {got}, want {want}"
        );
    }
}

/// The branch-free f64 exponential behind the exact GELU is libm's `exp` to 1e-15 relative over
/// the range it takes (and e^-708 below it), and the GELU's vector loop gives the scalar's bits
/// at every vector width, NaN and the infinities included.
#[test]
fn the_vectorized_exact_gelu_is_libms_exponential_at_every_width() {
    use crate::kernels::simd::{all_supported, with_level};
    use crate::model::ops::{exp64, gelu_erf_lanes, gelu_erf_of};
    let mut worst = 0f64;
    for i in 0..=200_000 {
        let a = -708.0 + i as f64 * (708.0 + 709.0) / 200_000.0;
        let (got, want) = (exp64(a), a.exp());
        worst = worst.max(((got - want) / want).abs());
    }
    eprintln!("exp64: worst relative error {worst:e} against libm");
    assert!(worst < 1e-15, "exp64: worst relative error {worst:e}");
    assert_eq!(exp64(-800.0), exp64(-708.0));
    assert_eq!(exp64(0.0), 1.0);
    let mut xs: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.0123).collect();
    xs.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        -0.0,
        0.0,
        -60.0,
        1e-30,
    ]);
    let scalar: Vec<u32> = xs.iter().map(|&x| gelu_erf_of(x).to_bits()).collect();
    for l in all_supported() {
        let mut out = vec![0f32; xs.len()];
        with_level(l, || gelu_erf_lanes(&xs, &mut out));
        let bits: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
        assert_eq!(bits, scalar, "{l:?}");
    }
    // +inf stays +inf; -inf·0 is NaN as in ½x(1 + erf(x/√2)) computed in floats
    let n = xs.len();
    assert_eq!(f32::from_bits(scalar[n - 6]), f32::INFINITY);
    assert!(f32::from_bits(scalar[n - 7]).is_nan());
    assert_eq!(f32::from_bits(scalar[n - 2]), -0.0);
}

/// The keys' bound a [`KvPrefix`] keeps (so a decode step reads only its new keys for the
/// attention's score bound) is the one its keys give, to the bit: after a prefill, after each
/// step on top of it, and after a truncation; so the attention takes the path it would take
/// with the bound computed from every key.
#[cfg(feature = "test-fixtures")]
#[test]
fn a_kv_prefix_keeps_its_keys_bound() {
    use crate::model::capture::NoCapture;
    use crate::model::tiny::{tiny_model, write_gguf};
    use crate::model::{Arch, Precision};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    let dtype = candle_core::quantized::GgmlDType::F32;
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, dtype, &path).unwrap();
    let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
    let check = |p: &KvPrefix, what: &str| {
        assert_eq!(p.k_sq.len(), model.dims.n_layers, "{what}");
        for (l, (k, _)) in p.layers.iter().enumerate() {
            assert_eq!(k.len(), p.n_kv * p.len * p.head_dim, "{what}");
            let want = max_row_sq(k, p.head_dim);
            assert!(want > 0.0, "{what}: layer {l} has keys");
            assert_eq!(p.k_sq[l].to_bits(), want.to_bits(), "{what}: layer {l}");
        }
    };
    let opts = |at: usize| RunOptions {
        logits_at: vec![at],
        keep_kv: true,
        ..Default::default()
    };
    let prompt = [72, 101, 108, 108];
    let out = model
        .forward_from(None, &prompt, &opts(3), &mut NoCapture)
        .unwrap();
    let mut kv = out.kv.unwrap();
    check(&kv, "prefill");
    for t in [111u32, 32, 256] {
        let at = kv.len;
        let out = model
            .forward_from(Some(&kv), &[t], &opts(at), &mut NoCapture)
            .unwrap();
        kv = out.kv.unwrap();
        check(&kv, &format!("step at {at}"));
    }
    assert_eq!(kv.len, 7);
    check(&kv.truncate(2).unwrap(), "truncated");
}
