use super::*;

/// A quantized tensor's values as candle dequantizes them, flat.
fn candles_values(q: &QTensor) -> Vec<f32> {
    q.dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The block type of a type name of tests/golden/gguf_dequant.json (`None`: one attnscope
/// does not read).
fn golden_block_type(name: &str) -> Option<BlockType> {
    Some(match name {
        "F16" => GgmlDType::F16.into(),
        "BF16" => GgmlDType::BF16.into(),
        "Q4_0" => GgmlDType::Q4_0.into(),
        "Q4_1" => GgmlDType::Q4_1.into(),
        "Q5_0" => GgmlDType::Q5_0.into(),
        "Q5_1" => GgmlDType::Q5_1.into(),
        "Q8_0" => GgmlDType::Q8_0.into(),
        "Q2_K" => GgmlDType::Q2K.into(),
        "Q3_K" => GgmlDType::Q3K.into(),
        "Q4_K" => GgmlDType::Q4K.into(),
        "Q5_K" => GgmlDType::Q5K.into(),
        "Q6_K" => GgmlDType::Q6K.into(),
        "IQ4_NL" => BlockType::Iq4Nl,
        "IQ4_XS" => BlockType::Iq4Xs,
        _ => return None,
    })
}

/// A golden type's blocks (its `hex`) and gguf-py's values for them (its `values`).
fn golden_blocks_and_values(t: &serde_json::Value) -> (Vec<u8>, Vec<f32>) {
    let hex = t["hex"].as_str().unwrap();
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let want: Vec<f32> = t["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap() as f32)
        .collect();
    (bytes, want)
}

/// A type `exact` reads as integers and scales on the AMX tiles: [`decode_scaled`] reads
/// `bytes`, every `S · Q + O` is the dequantized weight in `want`, and every `Q` is exact in
/// bf16. Returns the offsets `O`.
fn assert_scaled_decodes_to(dtype: BlockType, bytes: &[u8], want: &[f32], what: &str) -> Vec<f32> {
    let n = want.len();
    let (mut q, mut s, mut o) = (
        vec![f32::NAN; n],
        vec![f32::NAN; n / 32],
        vec![0f32; n / 32],
    );
    assert!(
        decode_scaled(dtype, bytes, &mut q, &mut s, &mut o),
        "{what}"
    );
    for i in 0..n {
        assert_eq!(q[i] * s[i / 32] + o[i / 32], want[i], "{what} weight {i}");
        assert_eq!(
            half::bf16::from_f32(q[i]).to_f32(),
            q[i],
            "{what}: q in bf16"
        );
    }
    o
}

/// Every GGUF block type attnscope reads, dequantized as gguf-py (llama.cpp's own Python
/// package) reads it: tests/golden/gguf_dequant.json holds one tensor of 256 weights per type
/// (gguf-py's quantization of random values, or random blocks with sane f16 scales for the
/// K-quants and IQ4 types, which gguf-py cannot quantize) and gguf-py's values for it.
#[test]
fn every_block_type_dequantizes_as_gguf_py_does() {
    let golden: serde_json::Value =
        serde_json::from_str(include_str!("../../../tests/golden/gguf_dequant.json")).unwrap();
    let types = golden["types"].as_object().unwrap();
    let mut unread = Vec::new();
    let (mut checked, mut scaled) = (0, 0);
    for (name, t) in types {
        let Some(dtype) = golden_block_type(name) else {
            unread.push(name.as_str());
            continue;
        };
        let (bytes, want) = golden_blocks_and_values(t);
        assert_eq!(
            bytes.len() / dtype.type_size() * dtype.block_size(),
            want.len(),
            "{name}: the block sizes"
        );
        let mut got = vec![f32::NAN; want.len()];
        dequantize_into(dtype, &bytes, &mut got).unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            // gguf-py computes in float32 numpy, in its own order of operations
            assert!(
                (g - w).abs() <= 1e-6 * scale.max(1.0) && g.is_finite(),
                "{name}: weight {i} is {g}, gguf-py says {w}"
            );
        }
        // a type `exact` reads as integers and scales on the AMX tiles
        if scaled_kind(dtype).is_some() && dtype != GgmlDType::BF16.into() {
            assert_scaled_decodes_to(dtype, &bytes, &got, name);
            scaled += 1;
        }
        checked += 1;
    }
    // IQ4_NL and IQ4_XS are read by attnscope's own code (candle's reader does not know them)
    assert_eq!(checked, 14);
    assert_eq!(
        scaled, 8,
        "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, IQ4_NL, IQ4_XS"
    );
    assert!(unread.is_empty(), "{unread:?}");
}

#[test]
fn own_q8_0_and_q5_0_dequantization_equals_candles_bit_for_bit() {
    use crate::kernels::simd::{all_supported, with_level};
    let mut rng = crate::reference::Rng::new(6);
    // large and tiny weights, and a block of zeros (scale 0)
    let mut w = rng.normals(8 * 64, 1.0);
    w[64..96].iter_mut().for_each(|x| *x *= 1e-4);
    w[96..128].iter_mut().for_each(|x| *x = 0.0);
    let t = Tensor::from_vec(w, (8, 64), &Device::Cpu).unwrap();
    for dtype in [GgmlDType::Q8_0, GgmlDType::Q5_0] {
        let q = QTensor::quantize(&t, dtype).unwrap();
        let want = candles_values(&q);
        let bytes = q.data().unwrap();
        for level in all_supported() {
            let mut got = vec![f32::NAN; want.len()];
            with_level(level, || dequantize_into(dtype, &bytes, &mut got)).unwrap();
            let same = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{dtype:?} at {level:?}");
        }
        // a length that is not whole blocks is refused
        let mut short = vec![0f32; want.len() - 32];
        assert!(dequantize_into(dtype, &bytes, &mut short).is_err());
    }
}

/// Whether [`decode_scaled`] reads `bytes` as `cols` integers with their scales and offsets.
fn decodes_scaled(dtype: impl Into<BlockType>, bytes: &[u8], cols: usize) -> bool {
    let (mut q, mut s, mut o) = (
        vec![0f32; cols],
        vec![0f32; cols / 32],
        vec![0f32; cols / 32],
    );
    decode_scaled(dtype, bytes, &mut q, &mut s, &mut o)
}

/// Every type `exact` reads as integers and scales: the decoded `S · Q + O` of every
/// weight equals the dequantized value, and every `Q` is exact in bf16.
#[test]
fn every_scaled_type_decodes_to_its_dequantized_weights() {
    let mut rng = crate::reference::Rng::new(9);
    let (rows, cols) = (3, 512);
    let mut w = rng.normals(rows * cols, 1.0);
    // tiny and zero blocks (scale 0), a large one
    w[64..96].iter_mut().for_each(|x| *x *= 1e-4);
    w[96..128].iter_mut().for_each(|x| *x = 0.0);
    w[600..632].iter_mut().for_each(|x| *x *= 300.0);
    for (dtype, bytes) in quant::scaled_types_of(&w, rows, cols) {
        let rb = bytes.len() / rows;
        let offsets = scaled_kind(dtype).expect("a scaled type");
        for r in 0..rows {
            let row = &bytes[r * rb..(r + 1) * rb];
            let mut want = vec![f32::NAN; cols];
            dequantize_into(dtype, row, &mut want).unwrap();
            let o =
                assert_scaled_decodes_to(dtype.into(), row, &want, &format!("{dtype:?} row {r}"));
            assert!(
                offsets || o.iter().all(|&x| x == 0.0),
                "{dtype:?} has no offsets"
            );
        }
        // a length that is not whole blocks is refused
        assert!(!decodes_scaled(dtype, &bytes[..rb - 2], cols));
    }
    // Q6_K's groups are 16 long: not read as integers and scales
    assert_eq!(scaled_kind(GgmlDType::Q6K), None);
    let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).unwrap();
    let q6 = QTensor::quantize(&t, GgmlDType::Q6K)
        .unwrap()
        .data()
        .unwrap()
        .to_vec();
    assert!(!decodes_scaled(
        GgmlDType::Q6K,
        &q6[..q6.len() / rows],
        cols
    ));
}

/// A fused matrix of three quantized parts of different types packs as integers and scales
/// whose every weight is the dequantized one; a part of another type (Q6_K) or floats leave
/// the matrix to the f32 kernels.
#[test]
fn a_fused_quantized_matrix_packs_as_integers_and_scales() {
    let mut rng = crate::reference::Rng::new(4);
    let k = 256;
    let mut part = |dtype: GgmlDType, rows: usize| -> Raw {
        let t = Tensor::from_vec(rng.normals(rows * k, 0.1), (rows, k), &Device::Cpu).unwrap();
        let bytes = QTensor::quantize(&t, dtype)
            .unwrap()
            .data()
            .unwrap()
            .to_vec();
        let len = bytes.len();
        Raw::Mapped(Mapped {
            map: Arc::new(super::super::gguf::Backing::Bytes(bytes)),
            offset: 0,
            len,
            dtype: dtype.into(),
            dims: vec![rows, k],
        })
    };
    let parts = vec![
        part(GgmlDType::Q5_0, 40),
        part(GgmlDType::Q8_0, 8),
        part(GgmlDType::Q4K, 20),
    ];
    let widths = [40, 8, 20];
    let starts = [0, 40, 48];
    let dense = vec![None, None, None];
    let packed = scaled_matrix(&parts, &dense, &starts, 68, k)
        .unwrap()
        .expect("every part is integers and scales");
    assert!(packed.has_offsets(), "Q4_K brings offsets");
    for (p, w) in parts.iter().enumerate() {
        let vals = w.to_vec().unwrap();
        for r in 0..widths[p] {
            for i in 0..k {
                assert_eq!(
                    packed.weight(starts[p] + r, i),
                    vals[r * k + i],
                    "part {p} ({r}, {i})"
                );
            }
        }
    }
    let mut mixed = parts;
    mixed[1] = part(GgmlDType::Q6K, 8);
    assert!(scaled_matrix(&mixed, &dense, &starts, 68, k)
        .unwrap()
        .is_none());
    let floats = Raw::F(Tensor::zeros((8, k), DType::F32, &Device::Cpu).unwrap());
    mixed[1] = floats;
    assert!(scaled_matrix(&mixed, &dense, &starts, 68, k)
        .unwrap()
        .is_none());
    // bf16 floats (a Hugging Face folder's): each weight its own value, scale 1
    let bf = Tensor::from_vec(rng.normals(8 * k, 0.1), (8, k), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let values: Vec<f32> = bf
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    mixed[1] = Raw::F(bf);
    let dense = vec![None, Some(values.clone()), None];
    let packed = scaled_matrix(&mixed, &dense, &starts, 68, k)
        .unwrap()
        .expect("bf16 floats are integers and scales of scale 1");
    for r in 0..8 {
        for i in 0..k {
            assert_eq!(
                packed.weight(40 + r, i),
                values[r * k + i],
                "bf16 ({r}, {i})"
            );
        }
    }
}

#[test]
fn q5_0_repacks_to_q8_0_exactly() {
    let mut rng = crate::reference::Rng::new(5);
    let t = Tensor::from_vec(rng.normals(4 * 64, 1.0), (4, 64), &Device::Cpu).unwrap();
    let q5 = QTensor::quantize(&t, GgmlDType::Q5_0).unwrap();
    let q8 = repack_q5_0_to_q8_0(&q5).unwrap();
    assert_eq!(q8.dtype(), GgmlDType::Q8_0);
    assert_eq!(candles_values(&q5), candles_values(&q8));
}
