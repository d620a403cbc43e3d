//! Captured tensors as files Python reads directly: `.safetensors` (with string metadata, read by
//! `safetensors.numpy.load_file` / `safe_open(...).metadata()`) and `.npz` (`numpy.load`).

use std::collections::BTreeMap;

/// A named f32 tensor.
pub struct NamedTensor<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

/// safetensors: u64 header length, JSON header (names → dtype, shape, byte offsets, plus
/// `__metadata__`), padded with spaces to 8 bytes, then the raw little-endian data.
pub fn to_safetensors(tensors: &[NamedTensor<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata).expect("strings serialize"));
    }
    let mut offset = 0usize;
    for t in tensors {
        let len = t.data.len() * 4;
        header.insert(t.name.into(), serde_json::json!({"dtype": "F32", "shape": t.shape, "data_offsets": [offset, offset + len]}));
        offset += len;
    }
    let mut h = serde_json::Value::Object(header).to_string().into_bytes();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for t in tensors {
        for v in t.data {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
}

/// CRC-32 (IEEE), as zip and PNG use it.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    let mut table = [0u32; 256];
    for (i, e) in table.iter_mut().enumerate() {
        let mut c = i as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
        *e = c;
    }
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c = table[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8);
    }
    c ^ 0xFFFF_FFFF
}

/// `.npz`: a zip archive (stored, ZIP64 where needed) of one `NAME.npy` per tensor.
pub fn to_npz(tensors: &[NamedTensor<'_>]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for t in tensors {
        let name = format!("{}.npy", t.name);
        let body = super::npy::to_npy(t.shape, t.data);
        let crc = crc32(&body);
        let size = body.len() as u64;
        let offset = out.len() as u64;
        let zip64 = size >= 0xFFFF_FFFF || offset >= 0xFFFF_FFFF;
        // local file header
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&(if zip64 { 45u16 } else { 20 }).to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // flags, method (stored), time
        out.extend_from_slice(&0x0021u16.to_le_bytes()); // date 1980-01-01
        out.extend_from_slice(&crc.to_le_bytes());
        let small = if zip64 { 0xFFFF_FFFFu32 } else { size as u32 };
        out.extend_from_slice(&small.to_le_bytes());
        out.extend_from_slice(&small.to_le_bytes());
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&(if zip64 { 20u16 } else { 0 }).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        if zip64 {
            out.extend_from_slice(&1u16.to_le_bytes());
            out.extend_from_slice(&16u16.to_le_bytes());
            out.extend_from_slice(&size.to_le_bytes());
            out.extend_from_slice(&size.to_le_bytes());
        }
        out.extend_from_slice(&body);
        // central directory entry
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&(if zip64 { 45u16 } else { 20 }).to_le_bytes());
        central.extend_from_slice(&(if zip64 { 45u16 } else { 20 }).to_le_bytes());
        central.extend_from_slice(&[0, 0, 0, 0, 0, 0]);
        central.extend_from_slice(&0x0021u16.to_le_bytes());
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&small.to_le_bytes());
        central.extend_from_slice(&small.to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&(if zip64 { 28u16 } else { 0 }).to_le_bytes());
        central.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0, 0]); // comment length, disk, internal and external attributes
        central.extend_from_slice(&(if zip64 { 0xFFFF_FFFFu32 } else { offset as u32 }).to_le_bytes());
        central.extend_from_slice(name.as_bytes());
        if zip64 {
            central.extend_from_slice(&1u16.to_le_bytes());
            central.extend_from_slice(&24u16.to_le_bytes());
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&size.to_le_bytes());
            central.extend_from_slice(&offset.to_le_bytes());
        }
    }
    let cd_offset = out.len() as u64;
    let cd_size = central.len() as u64;
    out.extend_from_slice(&central);
    let n = tensors.len() as u64;
    if cd_offset >= 0xFFFF_FFFF || n >= 0xFFFF {
        // ZIP64 end of central directory record and locator
        let eocd64 = out.len() as u64;
        out.extend_from_slice(&0x0606_4b50u32.to_le_bytes());
        out.extend_from_slice(&44u64.to_le_bytes());
        out.extend_from_slice(&45u16.to_le_bytes());
        out.extend_from_slice(&45u16.to_le_bytes());
        out.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0]);
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&n.to_le_bytes());
        out.extend_from_slice(&cd_size.to_le_bytes());
        out.extend_from_slice(&cd_offset.to_le_bytes());
        out.extend_from_slice(&0x0706_4b50u32.to_le_bytes());
        out.extend_from_slice(&0u32.to_le_bytes());
        out.extend_from_slice(&eocd64.to_le_bytes());
        out.extend_from_slice(&1u32.to_le_bytes());
    }
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0, 0, 0, 0]);
    let n16 = n.min(0xFFFF) as u16;
    out.extend_from_slice(&n16.to_le_bytes());
    out.extend_from_slice(&n16.to_le_bytes());
    out.extend_from_slice(&(cd_size.min(0xFFFF_FFFF) as u32).to_le_bytes());
    out.extend_from_slice(&(cd_offset.min(0xFFFF_FFFF) as u32).to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32_known_value() {
        assert_eq!(crc32(b"123456789"), 0xCBF4_3926);
    }

    #[test]
    fn safetensors_reads_back_with_the_safetensors_crate() {
        let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [0.5f32];
        let md = BTreeMap::from([("model".to_string(), "tiny".to_string())]);
        let bytes = to_safetensors(&[NamedTensor { name: "blocks.0.attn.hook_pattern", shape: &[1, 2, 3], data: &a }, NamedTensor { name: "x", shape: &[1], data: &b }], &md);
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["model"], "tiny");
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("blocks.0.attn.hook_pattern").unwrap();
        assert_eq!(t.shape(), &[1, 2, 3]);
        assert_eq!(t.data().len(), 24);
        assert_eq!(&t.data()[4..8], &2.0f32.to_le_bytes());
    }

    #[test]
    fn npz_is_a_valid_zip_of_npy_files() {
        let a = [1.0f32, 2.0];
        let bytes = to_npz(&[NamedTensor { name: "a", shape: &[2], data: &a }]);
        assert_eq!(&bytes[..4], b"PK\x03\x04");
        assert_eq!(&bytes[30..35], b"a.npy");
        let npy = &bytes[35..35 + 128 + 8];
        assert_eq!(crate::render::npy::from_npy(npy).unwrap(), (vec![2], vec![1.0, 2.0]));
        assert_eq!(&bytes[bytes.len() - 22..bytes.len() - 18], b"PK\x05\x06");
    }
}
