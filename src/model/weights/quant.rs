//! GGUF blocks to f32 (the dequantization every precision starts from, checked against
//! gguf-py's), and the integer-and-scale reading of the block types the AMX path multiplies as
//! they are.

use super::*;

pub(super) fn dequantize_blocks<T: GgmlType>(bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let size = std::mem::size_of::<T>();
    if !bytes.len().is_multiple_of(size) || out.len() != bytes.len() / size * T::BLCK_SIZE {
        return Err(Error::BlockBytes {
            what: format!("{:?}", T::DTYPE),
            bytes: bytes.len(),
            values: out.len(),
        });
    }
    if (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
        // SAFETY: the block types are plain old data (integers and f16), the length is a whole
        // number of blocks and the pointer is aligned for T.
        let blocks =
            unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) };
        T::to_float(blocks, out);
    } else {
        let mut blocks = vec![T::zeros(); bytes.len() / size];
        // SAFETY: as above; the destination is a fresh, aligned buffer of the same byte length.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                blocks.as_mut_ptr() as *mut u8,
                bytes.len(),
            )
        };
        T::to_float(&blocks, out);
    }
    Ok(())
}

/// Dequantizes blocks of 32 weights (`block` bytes each) with `f`, after checking the lengths.
/// Q8_0 and Q5_0 (the default model's main types) are read here from the bytes in lanes that
/// vectorize: candle's loops took ~15% of a short `inspect`'s time at load. The values are
/// candle's, bit for bit (`q as f32 · d`, one rounding; see the test).
pub(super) fn dequantize_simple(
    bytes: &[u8],
    block: usize,
    out: &mut [f32],
    f: fn(&[u8], &mut [f32]),
) -> Result<()> {
    if !bytes.len().is_multiple_of(block) || out.len() != bytes.len() / block * 32 {
        return Err(Error::BlockBytes {
            what: format!("{block}-byte blocks"),
            bytes: bytes.len(),
            values: out.len(),
        });
    }
    f(bytes, out);
    Ok(())
}

/// The block's scale: an f16 (exactly representable as f32).
#[inline(always)]
pub(super) fn block_scale(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

crate::kernels::simd::multiversion! {
    /// Q8_0 (34 bytes: f16 `d`, 32 × i8 `q`): `w = q · d`.
    pub(super) fn dequantize_q8_0(bytes: &[u8], out: &mut [f32]) {
        for (b, o) in bytes.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
            let d = block_scale(b);
            for (y, &q) in o.iter_mut().zip(&b[2..34]) {
                *y = q as i8 as f32 * d;
            }
        }
    }
}

crate::kernels::simd::multiversion! {
    /// Q5_0 (22 bytes: f16 `d`, u32 of fifth bits, 16 bytes of nibbles): weight `j` and
    /// `j + 16` share byte `j`, low and high nibble; `w = (q5 - 16) · d`.
    pub(super) fn dequantize_q5_0(bytes: &[u8], out: &mut [f32]) {
        for (b, o) in bytes.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
            let d = block_scale(b);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            let (lo, hi) = o.split_at_mut(16);
            for j in 0..16 {
                let q = b[6 + j] as u32;
                let x0 = ((q & 0x0F) | (((qh >> j) << 4) & 0x10)) as i32 - 16;
                let x1 = ((q >> 4) | ((qh >> (j + 12)) & 0x10)) as i32 - 16;
                lo[j] = x0 as f32 * d;
                hi[j] = x1 as f32 * d;
            }
        }
    }
}

/// A GGUF tensor's block type: one candle reads, or one of the two non-linear 4-bit types
/// (IQ4_NL, IQ4_XS) that attnscope reads itself (candle's GGUF reader does not know them:
/// [`super::super::gguf`] hands candle a copy of the header with their ids replaced, and keeps the
/// real type by tensor).
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum BlockType {
    /// A type candle's reader knows.
    Ggml(GgmlDType),
    /// IQ4_NL (GGML type 20): blocks of 32, an f16 `d` and 16 bytes of nibbles, `w = d ·
    /// kvalues[q]`.
    Iq4Nl,
    /// IQ4_XS (GGML type 23): super-blocks of 256 (f16 `d`, 8 six-bit scales `ls`, 128 bytes of
    /// nibbles), sub-block `j` of 32: `w = (d · (ls_j − 32)) · kvalues[q]`.
    Iq4Xs,
}

/// The 16 values IQ4_NL and IQ4_XS map a nibble to (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

impl BlockType {
    /// The type of GGML type id `id` that attnscope reads itself, if it is one.
    pub fn own(id: u32) -> Option<BlockType> {
        match id {
            20 => Some(BlockType::Iq4Nl),
            23 => Some(BlockType::Iq4Xs),
            _ => None,
        }
    }
    /// Weights per block.
    pub fn block_size(self) -> usize {
        match self {
            BlockType::Ggml(d) => d.block_size(),
            BlockType::Iq4Nl => 32,
            BlockType::Iq4Xs => 256,
        }
    }
    /// Bytes per block.
    pub fn type_size(self) -> usize {
        match self {
            BlockType::Ggml(d) => d.type_size(),
            BlockType::Iq4Nl => 18,
            BlockType::Iq4Xs => 136,
        }
    }
    /// candle's type, if it is one of candle's.
    pub fn ggml(self) -> Option<GgmlDType> {
        match self {
            BlockType::Ggml(d) => Some(d),
            _ => None,
        }
    }
}

impl From<GgmlDType> for BlockType {
    fn from(d: GgmlDType) -> Self {
        BlockType::Ggml(d)
    }
}

impl std::fmt::Debug for BlockType {
    /// candle's names for its types (`Q4K`, `Q8_0`), GGML's for the others (`IQ4_NL`).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlockType::Ggml(d) => write!(f, "{d:?}"),
            BlockType::Iq4Nl => f.write_str("IQ4_NL"),
            BlockType::Iq4Xs => f.write_str("IQ4_XS"),
        }
    }
}

/// One 32-weight IQ4 group: nibbles `qs` (16 bytes: byte j holds weights j (low) and j + 16
/// (high)) as `kvalues`, times `d`.
#[inline(always)]
fn iq4_group(qs: &[u8], d: f32, o: &mut [f32]) {
    let (lo, hi) = o.split_at_mut(16);
    for j in 0..16 {
        lo[j] = d * KVALUES_IQ4[(qs[j] & 0x0f) as usize] as f32;
        hi[j] = d * KVALUES_IQ4[(qs[j] >> 4) as usize] as f32;
    }
}

/// IQ4_XS's six-bit scale `ls` of sub-block `j` (`scales_h`: 2 high bits each; `scales_l`: 4
/// low bits each, two to a byte), as ggml's `dequantize_row_iq4_xs` reads it.
#[inline(always)]
fn iq4_xs_scale(b: &[u8], j: usize) -> i32 {
    let sh = u16::from_le_bytes([b[2], b[3]]) as i32;
    let sl = b[4 + j / 2] as i32;
    (((sl >> (4 * (j % 2))) & 0x0f) | (((sh >> (2 * j)) & 3) << 4)) - 32
}

crate::kernels::simd::multiversion! {
    /// IQ4_NL (18 bytes: f16 `d`, 16 bytes of nibbles): `w = d · kvalues[q]`.
    pub(super) fn dequantize_iq4_nl(bytes: &[u8], out: &mut [f32]) {
        for (b, o) in bytes.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
            iq4_group(&b[2..18], block_scale(b), o);
        }
    }
}

crate::kernels::simd::multiversion! {
    /// IQ4_XS (136 bytes: f16 `d`, u16 `scales_h`, 4 bytes `scales_l`, 128 of nibbles):
    /// sub-block `j` of 32 is `(d · (ls_j − 32)) · kvalues[q]`, the scale rounded to f32 first
    /// (ggml's and gguf-py's order).
    pub(super) fn dequantize_iq4_xs(bytes: &[u8], out: &mut [f32]) {
        for (b, o) in bytes.chunks_exact(136).zip(out.chunks_exact_mut(256)) {
            let d = block_scale(b);
            for (j, o) in o.chunks_exact_mut(32).enumerate() {
                iq4_group(&b[8 + 16 * j..24 + 16 * j], d * iq4_xs_scale(b, j) as f32, o);
            }
        }
    }
}

/// Dequantizes whole blocks of `dtype` (`bytes`) into `out`; an error if the lengths disagree.
pub(super) fn dequantize_into(
    dtype: impl Into<BlockType>,
    bytes: &[u8],
    out: &mut [f32],
) -> Result<()> {
    let dtype = match dtype.into() {
        BlockType::Ggml(d) => d,
        BlockType::Iq4Nl => return dequantize_simple(bytes, 18, out, dequantize_iq4_nl),
        BlockType::Iq4Xs => {
            if !bytes.len().is_multiple_of(136) || out.len() != bytes.len() / 136 * 256 {
                return Err(Error::BlockBytes {
                    what: "IQ4_XS".into(),
                    bytes: bytes.len(),
                    values: out.len(),
                });
            }
            dequantize_iq4_xs(bytes, out);
            return Ok(());
        }
    };
    use candle_core::quantized::k_quants::*;
    match dtype {
        GgmlDType::F32 => dequantize_blocks::<f32>(bytes, out),
        GgmlDType::F16 => dequantize_blocks::<half::f16>(bytes, out),
        GgmlDType::BF16 => dequantize_blocks::<half::bf16>(bytes, out),
        GgmlDType::Q4_0 => dequantize_blocks::<BlockQ4_0>(bytes, out),
        GgmlDType::Q4_1 => dequantize_blocks::<BlockQ4_1>(bytes, out),
        GgmlDType::Q5_0 => dequantize_simple(bytes, 22, out, dequantize_q5_0),
        GgmlDType::Q5_1 => dequantize_blocks::<BlockQ5_1>(bytes, out),
        GgmlDType::Q8_0 => dequantize_simple(bytes, 34, out, dequantize_q8_0),
        GgmlDType::Q8_1 => dequantize_blocks::<BlockQ8_1>(bytes, out),
        GgmlDType::Q2K => dequantize_blocks::<BlockQ2K>(bytes, out),
        GgmlDType::Q3K => dequantize_blocks::<BlockQ3K>(bytes, out),
        GgmlDType::Q4K => dequantize_blocks::<BlockQ4K>(bytes, out),
        GgmlDType::Q5K => dequantize_blocks::<BlockQ5K>(bytes, out),
        GgmlDType::Q6K => dequantize_blocks::<BlockQ6K>(bytes, out),
        GgmlDType::Q8K => dequantize_blocks::<BlockQ8K>(bytes, out),
    }
}

/// Whether a GGUF type's weights are `S · Q + O` per group of 32 with `Q` an integer bf16 holds
/// exactly: `Some(false)` without offsets (`d · q`), `Some(true)` with, `None` for the other
/// types (Q6_K's groups are 16 long, Q2_K/Q3_K/Q5_K/Q8_K and floats are not read so).
/// IQ4_NL and IQ4_XS are `d · k` with `k` one of [`KVALUES_IQ4`] (integers of at most 7 bits).
pub(super) fn scaled_kind(dtype: impl Into<BlockType>) -> Option<bool> {
    match dtype.into() {
        BlockType::Iq4Nl | BlockType::Iq4Xs => Some(false),
        BlockType::Ggml(GgmlDType::Q8_0 | GgmlDType::Q5_0 | GgmlDType::Q4_0 | GgmlDType::BF16) => {
            Some(false)
        }
        BlockType::Ggml(GgmlDType::Q4_1 | GgmlDType::Q5_1 | GgmlDType::Q4K) => Some(true),
        _ => None,
    }
}

/// One row of a GGUF tensor of a [`scaled_kind`] type, from its blocks: the integers `q`, the
/// scales `s` and offsets `o` of each group of 32. `false` for another type or a length that is
/// not whole blocks. (The caller checks every weight against the dequantized row.)
pub(super) fn decode_scaled(
    dtype: impl Into<BlockType>,
    bytes: &[u8],
    q: &mut [f32],
    s: &mut [f32],
    o: &mut [f32],
) -> bool {
    let dtype = dtype.into();
    let (bs, per) = (dtype.type_size(), dtype.block_size());
    if !bytes.len().is_multiple_of(bs)
        || bytes.len() / bs * per != q.len()
        || q.len() != s.len() * 32
    {
        return false;
    }
    let nibbles = |b: &[u8], q: &mut [f32], bias: f32, qh: Option<u32>| {
        for (q, x) in q.iter_mut().zip(block_nibbles(b, qh)) {
            *q = x as f32 - bias;
        }
    };
    let dtype = match dtype {
        BlockType::Ggml(d) => d,
        iq4 => {
            iq4_scaled(iq4, bytes, q, s);
            return true;
        }
    };
    if dtype == GgmlDType::BF16 {
        // each weight its own value, scale 1
        for (q, b) in q.iter_mut().zip(bytes.chunks_exact(2)) {
            *q = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
        }
        s.fill(1.0);
        return true;
    }
    for (i, b) in bytes.chunks_exact(bs).enumerate() {
        let q = &mut q[i * per..(i + 1) * per];
        match dtype {
            GgmlDType::Q8_0 => {
                s[i] = block_scale(b);
                q.iter_mut()
                    .zip(&b[2..34])
                    .for_each(|(q, &x)| *q = x as i8 as f32);
            }
            GgmlDType::Q5_0 => {
                s[i] = block_scale(b);
                nibbles(
                    &b[6..22],
                    q,
                    16.0,
                    Some(u32::from_le_bytes([b[2], b[3], b[4], b[5]])),
                );
            }
            GgmlDType::Q4_0 => {
                s[i] = block_scale(b);
                nibbles(&b[2..18], q, 8.0, None);
            }
            GgmlDType::Q4_1 => {
                (s[i], o[i]) = (block_scale(b), block_scale(&b[2..]));
                nibbles(&b[4..20], q, 0.0, None);
            }
            GgmlDType::Q5_1 => {
                (s[i], o[i]) = (block_scale(b), block_scale(&b[2..]));
                nibbles(
                    &b[8..24],
                    q,
                    0.0,
                    Some(u32::from_le_bytes([b[4], b[5], b[6], b[7]])),
                );
            }
            GgmlDType::Q4K => q4k_scaled(b, q, &mut s[i * 8..][..8], &mut o[i * 8..][..8]),
            _ => return false,
        }
    }
    true
}

/// IQ4_NL and IQ4_XS blocks (whole ones, as [`decode_scaled`] checked) as its integers (the
/// non-linear table's values) and scales.
fn iq4_scaled(dtype: BlockType, bytes: &[u8], q: &mut [f32], s: &mut [f32]) {
    let kv = |qs: &[u8], q: &mut [f32]| {
        for j in 0..16 {
            q[j] = KVALUES_IQ4[(qs[j] & 0x0f) as usize] as f32;
            q[j + 16] = KVALUES_IQ4[(qs[j] >> 4) as usize] as f32;
        }
    };
    let bs = dtype.type_size();
    if dtype == BlockType::Iq4Nl {
        for (i, b) in bytes.chunks_exact(bs).enumerate() {
            s[i] = block_scale(b);
            kv(&b[2..18], &mut q[i * 32..(i + 1) * 32]);
        }
        return;
    }
    for (i, b) in bytes.chunks_exact(bs).enumerate() {
        let d = block_scale(b);
        for j in 0..8 {
            s[i * 8 + j] = d * iq4_xs_scale(b, j) as f32;
            kv(
                &b[8 + 16 * j..24 + 16 * j],
                &mut q[(i * 8 + j) * 32..][..32],
            );
        }
    }
}

/// One Q4_K super-block (144 bytes: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 of
/// nibbles) as [`decode_scaled`] reads it: sub-block j of 32 is `w = d·sc_j · q − dmin·m_j`
/// (llama.cpp's get_scale_min_k4), so `s[j] = d·sc_j`, `o[j] = −dmin·m_j`.
fn q4k_scaled(b: &[u8], q: &mut [f32], s: &mut [f32], o: &mut [f32]) {
    let (d, dmin, sc, qs) = (block_scale(b), block_scale(&b[2..]), &b[4..16], &b[16..144]);
    let scale_min = |j: usize| -> (u8, u8) {
        if j < 4 {
            (sc[j] & 63, sc[j + 4] & 63)
        } else {
            (
                (sc[j + 4] & 0x0f) | ((sc[j - 4] >> 6) << 4),
                (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4),
            )
        }
    };
    for j in 0..8 {
        let (scale, min) = scale_min(j);
        s[j] = d * scale as f32;
        o[j] = -(dmin * min as f32);
        let bytes = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
        for (l, &x) in bytes.iter().enumerate() {
            q[j * 32 + l] = if j % 2 == 0 { x & 0x0f } else { x >> 4 } as f32;
        }
    }
}

/// [`decode_scaled`] with the integers as bf16 pairs, as the AMX tiles read them: `q[16 ·
/// groups]`, pair r of a group holding weight 2r in its low half and 2r + 1 in its high half.
/// Q8_0, Q5_0 and Q4_0 (the default model's types) are read straight into the pairs; the other
/// types through [`decode_scaled`]'s f32 integers. `false` for another type, a length that is
/// not whole blocks, or an integer that is not exact in bf16 (none of these types has one).
pub(super) fn decode_pairs(
    dtype: impl Into<BlockType>,
    bytes: &[u8],
    q: &mut [u32],
    s: &mut [f32],
    o: &mut [f32],
) -> bool {
    let dtype = dtype.into();
    let (bs, per) = (dtype.type_size(), dtype.block_size());
    if !bytes.len().is_multiple_of(bs)
        || bytes.len() / bs * per != q.len() * 2
        || q.len() != s.len() * 16
    {
        return false;
    }
    // a small integer's bf16 bits: its f32 bits' upper half (exact below 2⁸)
    let bf = |x: i32| (x as f32).to_bits() >> 16;
    let pairs = |v: &[i32; 32], q: &mut [u32]| {
        for (r, d) in q.iter_mut().enumerate() {
            *d = bf(v[2 * r]) | (bf(v[2 * r + 1]) << 16);
        }
    };
    let nibbles = |b: &[u8], q: &mut [u32], bias: i32, qh: Option<u32>| {
        pairs(&block_nibbles(b, qh).map(|x| x as i32 - bias), q);
    };
    match dtype {
        BlockType::Ggml(GgmlDType::Q8_0) => {
            for ((b, q), s) in bytes.chunks_exact(34).zip(q.chunks_exact_mut(16)).zip(s) {
                *s = block_scale(b);
                for (r, d) in q.iter_mut().enumerate() {
                    let (x0, x1) = (b[2 + 2 * r] as i8, b[3 + 2 * r] as i8);
                    *d = bf(x0 as i32) | (bf(x1 as i32) << 16);
                }
            }
            true
        }
        BlockType::Ggml(GgmlDType::Q5_0) => {
            for ((b, q), s) in bytes.chunks_exact(22).zip(q.chunks_exact_mut(16)).zip(s) {
                *s = block_scale(b);
                let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                nibbles(&b[6..22], q, 16, Some(qh));
            }
            true
        }
        BlockType::Ggml(GgmlDType::Q4_0) => {
            for ((b, q), s) in bytes.chunks_exact(18).zip(q.chunks_exact_mut(16)).zip(s) {
                *s = block_scale(b);
                nibbles(&b[2..18], q, 8, None);
            }
            true
        }
        _ => PAIRS_F32.with(|cell| {
            let mut f = cell.borrow_mut();
            f.resize(q.len() * 2, 0.0);
            if !decode_scaled(dtype, bytes, &mut f, s, o) {
                return false;
            }
            let mut low_bits = 0u32;
            for (d, pair) in q.iter_mut().zip(f.chunks_exact(2)) {
                let (b0, b1) = (pair[0].to_bits(), pair[1].to_bits());
                low_bits |= (b0 | b1) & 0xffff;
                *d = (b0 >> 16) | (b1 & 0xffff_0000);
            }
            low_bits == 0
        }),
    }
}

thread_local! {
    /// [`decode_pairs`]'s f32 integers for the types it reads through [`decode_scaled`].
    static PAIRS_F32: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The part of a fused matrix whose rows start at `starts` that holds row `j`, and the row's
/// place in it.
pub(super) fn part_of(starts: &[usize], j: usize) -> (usize, usize) {
    let part = starts.partition_point(|&st| st <= j) - 1;
    (part, j - starts[part])
}

/// The matrix of `parts` (rows `starts[i]..` each) as integers and scales on the AMX tiles, if
/// every part is a GGUF tensor of a [`scaled_kind`] type or bf16 floats, and every weight is
/// exactly `S · Q + O` of what its blocks say (checked against the dequantized values, which
/// the f32 path would use); `None` otherwise.
pub(super) fn scaled_matrix(
    parts: &[Raw],
    dense: &[Option<Vec<f32>>],
    starts: &[usize],
    n: usize,
    k: usize,
) -> Result<Option<PackedScaled>> {
    let mut offsets = false;
    for w in parts {
        match w {
            Raw::Mapped(m) => match scaled_kind(m.dtype) {
                Some(o) => offsets |= o,
                None => return Ok(None),
            },
            Raw::F(t) if t.dtype() == DType::BF16 => {}
            Raw::F(_) => return Ok(None),
        }
    }
    let row = |j: usize, q: &mut [f32], s: &mut [f32], o: &mut [f32]| -> bool {
        let (part, local) = part_of(starts, j);
        match (&parts[part], &dense[part]) {
            (Raw::Mapped(m), None) => {
                let rb = m.row_bytes();
                let Some(bytes) = m.bytes().get(local * rb..(local + 1) * rb) else {
                    return false;
                };
                let mut w = vec![0f32; k];
                decode_scaled(m.dtype, bytes, q, s, o)
                    && m.rows_to_f32(local, &mut w).is_ok()
                    && w.iter()
                        .enumerate()
                        .all(|(i, &x)| q[i] * s[i / 32] + o[i / 32] == x)
            }
            (Raw::F(_), Some(d)) => {
                // bf16 floats: each weight its own integer-like value, scale 1
                q.copy_from_slice(&d[local * k..(local + 1) * k]);
                s.fill(1.0);
                true
            }
            _ => false,
        }
    };
    Ok(PackedScaled::from_row_source(n, k, offsets, row))
}

/// The 32 unsigned values of a 32-weight block's nibbles (`qs`, 16 bytes: byte j holds weights
/// j (low nibble) and j + 16 (high)), with the fifth bits of `qh` where the type has them (Q5_0,
/// Q5_1: bit j for weight j).
pub(super) fn block_nibbles(qs: &[u8], qh: Option<u32>) -> [u8; 32] {
    let mut v = [0u8; 32];
    for j in 0..16 {
        let (h0, h1) = qh.map_or((0, 0), |h| {
            (
                (((h >> j) & 1) << 4) as u8,
                (((h >> (j + 16)) & 1) << 4) as u8,
            )
        });
        v[j] = (qs[j] & 0x0f) | h0;
        v[j + 16] = (qs[j] >> 4) | h1;
    }
    v
}

/// Rewrites Q5_0 blocks as Q8_0 blocks without changing a single value: both store 32 weights
/// as `d · q` with one f16 scale `d`; Q5_0's 5-bit q (−16..15) fits Q8_0's int8.
/// Q5_0 block (22 bytes): d f16, qh u32 (the 5th bits), qs[16] (low nibbles: weights j and j+16).
pub(super) fn repack_q5_0_to_q8_0(q: &QTensor) -> Result<QTensor> {
    let data = q.data()?;
    let n_blocks = data.len() / 22;
    let mut out = Vec::with_capacity(n_blocks * 34);
    for b in data.chunks_exact(22) {
        out.extend_from_slice(&b[0..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        out.extend(
            block_nibbles(&b[6..22], Some(qh))
                .iter()
                .map(|&v| (v as i8 - 16) as u8),
        );
    }
    let storage = QStorage::from_data(Cow::Owned(out), &Device::Cpu, GgmlDType::Q8_0)?;
    Ok(QTensor::new(storage, q.shape().clone())?)
}

/// The types `exact` reads as integers and scales, each with the `rows × cols` weights `w` in
/// its bytes (candle's quantization, or BF16's bits).
#[cfg(test)]
pub(super) fn scaled_types_of(w: &[f32], rows: usize, cols: usize) -> Vec<(GgmlDType, Vec<u8>)> {
    let t = candle_core::Tensor::from_vec(w.to_vec(), (rows, cols), &Device::Cpu).unwrap();
    let types = [
        GgmlDType::Q8_0,
        GgmlDType::Q5_0,
        GgmlDType::Q4_0,
        GgmlDType::Q4_1,
        GgmlDType::Q5_1,
        GgmlDType::Q4K,
        GgmlDType::BF16,
    ];
    types
        .into_iter()
        .map(|dtype| {
            let bytes: Vec<u8> = if dtype == GgmlDType::BF16 {
                w.iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect()
            } else {
                QTensor::quantize(&t, dtype)
                    .unwrap()
                    .data()
                    .unwrap()
                    .to_vec()
            };
            (dtype, bytes)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pairs are [`decode_scaled`]'s integers in bf16, two at a time (weight 2r low), with
    /// its scales and offsets, for every type the tiles take (Q8_0, Q5_0 and Q4_0 read straight
    /// from the blocks, the others through the f32 integers); a length that is not whole
    /// blocks is refused.
    #[test]
    fn the_pairs_are_the_scaled_integers_bf16_bits_two_at_a_time() {
        let mut rng = crate::reference::Rng::new(21);
        let (rows, cols) = (2, 512);
        let mut w = rng.normals(rows * cols, 1.0);
        w[32..64].iter_mut().for_each(|x| *x = 0.0);
        w[600..632].iter_mut().for_each(|x| *x *= 300.0);
        for (dtype, bytes) in scaled_types_of(&w, rows, cols) {
            let rb = bytes.len() / rows;
            for r in 0..rows {
                let row = &bytes[r * rb..(r + 1) * rb];
                let g = cols / 32;
                let (mut q, mut s, mut o) = (vec![0f32; cols], vec![0f32; g], vec![0f32; g]);
                assert!(
                    decode_scaled(dtype, row, &mut q, &mut s, &mut o),
                    "{dtype:?}"
                );
                let (mut p, mut ps, mut po) = (vec![0u32; cols / 2], vec![0f32; g], vec![0f32; g]);
                assert!(
                    decode_pairs(dtype, row, &mut p, &mut ps, &mut po),
                    "{dtype:?}"
                );
                for (i, pair) in p.iter().enumerate() {
                    let (lo, hi) = (pair & 0xffff, pair >> 16);
                    assert_eq!(
                        lo << 16,
                        q[2 * i].to_bits(),
                        "{dtype:?} row {r} weight {}",
                        2 * i
                    );
                    assert_eq!(
                        hi << 16,
                        q[2 * i + 1].to_bits(),
                        "{dtype:?} row {r} weight {}",
                        2 * i + 1
                    );
                }
                let bits =
                    |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(
                    bits(&s, &ps) && bits(&o, &po),
                    "{dtype:?} row {r}: scales and offsets"
                );
                assert!(
                    !decode_pairs(dtype, &row[..row.len() - 1], &mut p, &mut ps, &mut po),
                    "{dtype:?}: a cut block"
                );
            }
        }
    }
}
