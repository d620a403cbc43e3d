//! Captured tensors as files Python reads directly: `.safetensors` (with string metadata, read by
//! `safetensors.numpy.load_file` / `safe_open(...).metadata()`) and `.npz` (`numpy.load`).

use std::collections::BTreeMap;
use std::io::Write;

/// A named f32 tensor.
pub struct NamedTensor<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

/// The file formats a capture is written in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorFormat {
    /// u64 header length, JSON header (names → dtype, shape, byte offsets, plus `__metadata__`),
    /// padded with spaces to 8 bytes, then the raw little-endian data in header order.
    Safetensors,
    /// A zip archive (stored, ZIP64 where needed) of one `NAME.npy` per tensor.
    Npz,
}

/// The little-endian bytes of `data` (a view on little-endian machines, a copy elsewhere).
fn le_bytes(data: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding and any byte pattern is a valid u8; the length is exact.
        std::borrow::Cow::Borrowed(unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data)) })
    } else {
        std::borrow::Cow::Owned(data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

/// Writes tensors one after another into `W` while they are produced, so a capture never holds
/// more than the tensor being written: every name and shape is declared up front (the
/// safetensors header comes first), then [`TensorWriter::write`] takes them in that order.
pub struct TensorWriter<W: Write> {
    out: W,
    format: TensorFormat,
    order: Vec<(String, Vec<usize>)>,
    next: usize,
    /// bytes written so far (npz entry offsets)
    offset: u64,
    central: Vec<u8>,
}

impl<W: Write> TensorWriter<W> {
    /// Starts a file of the tensors `order` (name, shape), in that order (`metadata` goes into
    /// a safetensors header; npz has no place for it).
    pub fn new(mut out: W, format: TensorFormat, order: Vec<(String, Vec<usize>)>, metadata: &BTreeMap<String, String>) -> std::io::Result<Self> {
        let mut offset = 0u64;
        if format == TensorFormat::Safetensors {
            let mut header = serde_json::Map::new();
            if !metadata.is_empty() {
                header.insert("__metadata__".into(), serde_json::to_value(metadata).expect("strings serialize"));
            }
            let mut at = 0usize;
            for (name, shape) in &order {
                let len = shape.iter().product::<usize>() * 4;
                header.insert(name.clone(), serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [at, at + len]}));
                at += len;
            }
            let mut h = serde_json::Value::Object(header).to_string().into_bytes();
            while h.len() % 8 != 0 {
                h.push(b' ');
            }
            out.write_all(&(h.len() as u64).to_le_bytes())?;
            out.write_all(&h)?;
            offset = 8 + h.len() as u64;
        }
        Ok(TensorWriter { out, format, order, next: 0, offset, central: Vec::new() })
    }

    /// The name of the tensor expected next, if any.
    pub fn expects(&self) -> Option<&str> {
        self.order.get(self.next).map(|(n, _)| n.as_str())
    }

    /// Writes the next tensor; its name and size must be the ones declared.
    pub fn write(&mut self, name: &str, data: &[f32]) -> std::io::Result<()> {
        let bad = |msg: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, msg);
        let (want, shape) = self.order.get(self.next).ok_or_else(|| bad(format!("tensor `{name}` was not declared (all {} are written)", self.order.len())))?;
        if want != name || shape.iter().product::<usize>() != data.len() {
            return Err(bad(format!("tensor `{name}` ({} values) came where `{want}` {shape:?} was declared: you likely have a bug", data.len())));
        }
        let shape = shape.clone();
        self.next += 1;
        let bytes = le_bytes(data);
        match self.format {
            TensorFormat::Safetensors => {
                self.out.write_all(&bytes)?;
                self.offset += bytes.len() as u64;
            }
            TensorFormat::Npz => {
                let header = super::npy::npy_header(&shape);
                let mut crc = crc32fast::Hasher::new();
                crc.update(&header);
                crc.update(&bytes);
                let entry = format!("{name}.npy");
                let size = (header.len() + bytes.len()) as u64;
                let (local, central) = zip_headers(&entry, crc.finalize(), size, self.offset);
                self.out.write_all(&local)?;
                self.out.write_all(&header)?;
                self.out.write_all(&bytes)?;
                self.offset += local.len() as u64 + size;
                self.central.extend_from_slice(&central);
            }
        }
        Ok(())
    }

    /// Ends the file (the npz central directory) once every declared tensor is written.
    pub fn finish(mut self) -> std::io::Result<W> {
        if let Some(name) = self.expects() {
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("tensor `{name}` was declared but never written")));
        }
        if self.format == TensorFormat::Npz {
            let end = zip_end(self.offset, self.central.len() as u64, self.order.len() as u64);
            self.out.write_all(&self.central)?;
            self.out.write_all(&end)?;
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

/// The whole file of `tensors` in memory (for small captures and tests).
fn to_bytes(tensors: &[NamedTensor<'_>], format: TensorFormat, metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let order = tensors.iter().map(|t| (t.name.to_string(), t.shape.to_vec())).collect();
    let mut w = TensorWriter::new(Vec::new(), format, order, metadata).expect("writing to memory");
    for t in tensors {
        w.write(t.name, t.data).expect("declared in order");
    }
    w.finish().expect("writing to memory")
}

/// A safetensors file of `tensors` with string `metadata`, in memory.
pub fn to_safetensors(tensors: &[NamedTensor<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    to_bytes(tensors, TensorFormat::Safetensors, metadata)
}

/// An `.npz` of `tensors`, in memory.
pub fn to_npz(tensors: &[NamedTensor<'_>]) -> Vec<u8> {
    to_bytes(tensors, TensorFormat::Npz, &BTreeMap::new())
}

/// CRC-32 (IEEE), as zip and PNG use it.
pub(crate) fn crc32(data: &[u8]) -> u32 {
    crc32fast::hash(data)
}

/// The local file header and the central directory entry of one stored zip member of `size`
/// bytes at `offset` (ZIP64 extra fields where a size or offset needs them).
fn zip_headers(name: &str, crc: u32, size: u64, offset: u64) -> (Vec<u8>, Vec<u8>) {
    let zip64 = size >= 0xFFFF_FFFF || offset >= 0xFFFF_FFFF;
    let mut out = Vec::new();
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
    let mut central = Vec::new();
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
    (out, central)
}

/// The end of a zip: (ZIP64 end record and locator where needed,) end of central directory.
/// `cd_offset` is where the central directory of `cd_size` bytes and `n` entries starts.
fn zip_end(cd_offset: u64, cd_size: u64, n: u64) -> Vec<u8> {
    let mut out = Vec::new();
    if cd_offset >= 0xFFFF_FFFF || n >= 0xFFFF {
        // ZIP64 end of central directory record and locator
        let eocd64 = cd_offset + cd_size;
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
