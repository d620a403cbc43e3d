//! Captured tensors as files Python reads directly: `.safetensors` (with string metadata, read by
//! `safetensors.numpy.load_file` / `safe_open(...).metadata()`) and `.npz` (`numpy.load`).

use std::collections::BTreeMap;
use std::io::{Seek, Write};

/// A named f32 tensor.
pub struct NamedTensor<'a> {
    /// the tensor's name
    pub name: &'a str,
    /// its shape
    pub shape: &'a [usize],
    /// its values, row-major
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
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(data))
    } else {
        std::borrow::Cow::Owned(data.iter().flat_map(|v| v.to_le_bytes()).collect())
    }
}

use super::direct::BLOCK;

/// Where a large heap allocation starts within a page with glibc's allocator (after its 16-byte
/// chunk header): the phase at which [`TensorWriter::with_data_phase`] puts tensor data.
pub const HEAP_PHASE: usize = 16;

/// Where the tensors go.
enum Sink<W: Write + Seek> {
    /// header already written; data appended in declared order
    Safetensors(W),
    Npz(Box<zip::ZipWriter<W>>),
}

/// A safetensors header as the `safetensors` crate writes it (`__metadata__`, then the tensors in
/// the order of their data), but with the metadata in key order: the crate keeps it in a
/// `HashMap`, whose order changes from run to run, so two captures of one run differed byte for
/// byte.
struct Header<'a> {
    metadata: &'a BTreeMap<String, String>,
    tensors: &'a [(String, safetensors::tensor::TensorInfo)],
}

impl serde::Serialize for Header<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let with_metadata = !self.metadata.is_empty();
        let mut map =
            serializer.serialize_map(Some(self.tensors.len() + usize::from(with_metadata)))?;
        if with_metadata {
            map.serialize_entry("__metadata__", self.metadata)?;
        }
        for (name, info) in self.tensors {
            map.serialize_entry(name, info)?;
        }
        map.end()
    }
}

/// Writes tensors one after another into `W` while they are produced, so a capture never holds
/// more than the tensor being written: every name and shape is declared up front (the
/// safetensors header comes first), then [`TensorWriter::write`] takes them in that order.
///
/// The safetensors header is the `safetensors` crate's own `Metadata` (its serialization and
/// offset validation); the data then follows in declared order. (The crate's `serialize`
/// would sort the tensors by name, `blocks.10` before `blocks.2`, so it could only write a
/// capture held whole in memory.) npz members are written by the `zip` crate (stored,
/// ZIP64 where a member or the archive needs it).
pub struct TensorWriter<W: Write + Seek> {
    sink: Sink<W>,
    order: Vec<(String, Vec<usize>)>,
    next: usize,
}

fn invalid(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidInput, msg)
}

impl<W: Write + Seek> TensorWriter<W> {
    /// Starts a file of the tensors `order` (name, shape), in that order (`metadata` goes into
    /// a safetensors header; npz has no place for it).
    pub fn new(
        out: W,
        format: TensorFormat,
        order: Vec<(String, Vec<usize>)>,
        metadata: &BTreeMap<String, String>,
    ) -> std::io::Result<Self> {
        Self::with_data_phase(out, format, order, metadata, 0)
    }

    /// As [`TensorWriter::new`], with a safetensors header padded (with spaces, which the format
    /// allows) so the tensor data starts at a file offset of `phase` modulo [`BLOCK`]
    /// (`phase` a multiple of 8). A file written past the page cache ([`super::direct`]) then
    /// takes large tensors straight from memory whose address has that same phase: on Linux a
    /// large `Vec` starts 16 bytes into a page, so [`HEAP_PHASE`] saves copying every byte.
    pub fn with_data_phase(
        mut out: W,
        format: TensorFormat,
        order: Vec<(String, Vec<usize>)>,
        metadata: &BTreeMap<String, String>,
        phase: usize,
    ) -> std::io::Result<Self> {
        let sink = match format {
            TensorFormat::Safetensors => {
                let mut infos = Vec::with_capacity(order.len());
                let mut at = 0usize;
                for (name, shape) in &order {
                    let len = shape
                        .iter()
                        .try_fold(4usize, |a, &d| a.checked_mul(d))
                        .ok_or_else(|| {
                            invalid(format!("tensor `{name}` {shape:?} is too large"))
                        })?;
                    infos.push((
                        name.clone(),
                        safetensors::tensor::TensorInfo {
                            dtype: safetensors::Dtype::F32,
                            shape: shape.clone(),
                            data_offsets: (at, at + len),
                        },
                    ));
                    at += len;
                }
                // the crate checks the offsets; the header is written by `Header`, in a fixed order
                safetensors::tensor::Metadata::new(None, infos.clone())
                    .map_err(|e| invalid(format!("safetensors header: {e}")))?;
                let header = Header {
                    metadata,
                    tensors: &infos,
                };
                let mut h = serde_json::to_string(&header)
                    .map_err(|e| invalid(format!("safetensors header: {e}")))?
                    .into_bytes();
                // the data starts 8-byte aligned, as the crate pads it, and at the phase asked for
                h.resize(h.len().next_multiple_of(8), b' ');
                if phase > 0 {
                    let at = (8 + h.len()) % BLOCK;
                    h.resize(h.len() + (BLOCK + phase - at) % BLOCK, b' ');
                }
                out.write_all(&(h.len() as u64).to_le_bytes())?;
                out.write_all(&h)?;
                Sink::Safetensors(out)
            }
            TensorFormat::Npz => Sink::Npz(Box::new(zip::ZipWriter::new(out))),
        };
        Ok(TensorWriter {
            sink,
            order,
            next: 0,
        })
    }

    /// The name of the tensor expected next, if any.
    pub fn expects(&self) -> Option<&str> {
        self.order.get(self.next).map(|(n, _)| n.as_str())
    }

    /// Writes the next tensor; its name and size must be the ones declared.
    pub fn write(&mut self, name: &str, data: &[f32]) -> std::io::Result<()> {
        let (want, shape) = self.order.get(self.next).ok_or_else(|| {
            invalid(format!(
                "tensor `{name}` was not declared (all {} are written)",
                self.order.len()
            ))
        })?;
        if want != name || shape.iter().product::<usize>() != data.len() {
            return Err(invalid(format!("tensor `{name}` ({} values) came where `{want}` {shape:?} was declared: you likely have a bug", data.len())));
        }
        let shape = shape.clone();
        self.next += 1;
        let bytes = le_bytes(data);
        match &mut self.sink {
            Sink::Safetensors(out) => out.write_all(&bytes)?,
            Sink::Npz(z) => {
                let header = super::npy::npy_header(&shape);
                let large = (header.len() + bytes.len()) as u64 >= 0xFFFF_FFFF;
                let opts = zip::write::SimpleFileOptions::default()
                    .compression_method(zip::CompressionMethod::Stored)
                    .large_file(large);
                z.start_file(format!("{name}.npy"), opts)
                    .map_err(std::io::Error::other)?;
                z.write_all(&header)?;
                z.write_all(&bytes)?;
            }
        }
        Ok(())
    }

    /// Ends the file (the npz central directory) once every declared tensor is written.
    pub fn finish(self) -> std::io::Result<W> {
        if let Some(name) = self.expects() {
            return Err(invalid(format!(
                "tensor `{name}` was declared but never written"
            )));
        }
        let mut out = match self.sink {
            Sink::Safetensors(out) => out,
            Sink::Npz(z) => z.finish().map_err(std::io::Error::other)?,
        };
        out.flush()?;
        Ok(out)
    }
}

/// The whole file of `tensors` in memory (for small captures and tests).
fn to_bytes(
    tensors: &[NamedTensor<'_>],
    format: TensorFormat,
    metadata: &BTreeMap<String, String>,
) -> Vec<u8> {
    let order = tensors
        .iter()
        .map(|t| (t.name.to_string(), t.shape.to_vec()))
        .collect();
    let mut w = TensorWriter::new(std::io::Cursor::new(Vec::new()), format, order, metadata)
        .expect("writing to memory");
    for t in tensors {
        w.write(t.name, t.data).expect("declared in order");
    }
    w.finish().expect("writing to memory").into_inner()
}

/// A safetensors file of `tensors` with string `metadata`, in memory.
pub fn to_safetensors(tensors: &[NamedTensor<'_>], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    to_bytes(tensors, TensorFormat::Safetensors, metadata)
}

/// An `.npz` of `tensors`, in memory.
pub fn to_npz(tensors: &[NamedTensor<'_>]) -> Vec<u8> {
    to_bytes(tensors, TensorFormat::Npz, &BTreeMap::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A header padded to a phase: the data starts there, and readers take the file as before.
    #[test]
    fn a_header_padded_to_a_phase_starts_the_data_there() {
        let order = vec![("a".to_string(), vec![2, 3]), ("b".to_string(), vec![5])];
        let md = BTreeMap::from([("k".to_string(), "v".to_string())]);
        for phase in [0, 8, HEAP_PHASE, 4000] {
            let mut w = TensorWriter::with_data_phase(
                std::io::Cursor::new(Vec::new()),
                TensorFormat::Safetensors,
                order.clone(),
                &md,
                phase,
            )
            .unwrap();
            w.write("a", &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
            w.write("b", &[7.0; 5]).unwrap();
            let bytes = w.finish().unwrap().into_inner();
            let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
            if phase > 0 {
                assert_eq!((8 + header) % BLOCK, phase);
            }
            let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
            let b = st.tensor("b").unwrap();
            assert_eq!(b.shape(), &[5]);
            assert_eq!(&b.data()[..4], &7f32.to_le_bytes());
            assert_eq!(st.tensor("a").unwrap().data().len(), 24);
        }
    }

    #[test]
    fn safetensors_reads_back_with_the_safetensors_crate() {
        let a = [1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0];
        let b = [0.5f32];
        let md = BTreeMap::from([("model".to_string(), "tiny".to_string())]);
        let bytes = to_safetensors(
            &[
                NamedTensor {
                    name: "blocks.0.attn.hook_pattern",
                    shape: &[1, 2, 3],
                    data: &a,
                },
                NamedTensor {
                    name: "x",
                    shape: &[1],
                    data: &b,
                },
            ],
            &md,
        );
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        assert_eq!(meta.metadata().as_ref().unwrap()["model"], "tiny");
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor("blocks.0.attn.hook_pattern").unwrap();
        assert_eq!(t.shape(), &[1, 2, 3]);
        assert_eq!(t.data().len(), 24);
        assert_eq!(&t.data()[4..8], &2.0f32.to_le_bytes());
    }

    /// The header is the crate's own JSON with the metadata in key order and the tensors in the
    /// order of their data, so the same tensors and metadata give the same bytes every time.
    #[test]
    fn the_header_is_the_crates_with_the_metadata_in_key_order() {
        let a = [1.0f32; 6];
        let md: BTreeMap<String, String> = (0..20)
            .map(|i| (format!("key{i:02}"), i.to_string()))
            .collect();
        let tensors = [
            NamedTensor {
                name: "b",
                shape: &[2, 3],
                data: &a,
            },
            NamedTensor {
                name: "a",
                shape: &[6],
                data: &a,
            },
        ];
        let first = to_safetensors(&tensors, &md);
        for _ in 0..4 {
            assert!(
                to_safetensors(&tensors, &md) == first,
                "a second write differs"
            );
        }
        let len = u64::from_le_bytes(first[..8].try_into().unwrap()) as usize;
        let ours = std::str::from_utf8(&first[8..8 + len]).unwrap().trim_end();
        let at = |key: &str| ours.find(&format!("\"{key}\"")).unwrap();
        let keys: Vec<usize> = md.keys().map(|k| at(k)).collect();
        assert!(
            keys.windows(2).all(|w| w[0] < w[1]),
            "metadata out of key order: {ours}"
        );
        assert!(at("__metadata__") < at("b") && at("b") < at("a"), "{ours}");
        let (_, meta) = safetensors::SafeTensors::read_metadata(&first).unwrap();
        let crates = serde_json::to_value(&meta).unwrap();
        let parsed: serde_json::Value = serde_json::from_str(ours).unwrap();
        assert_eq!(parsed, crates, "not the crate's header");
    }

    #[test]
    fn npz_is_a_valid_zip_of_npy_files() {
        let (a, b) = ([1.0f32, 2.0], [3.0f32; 6]);
        let bytes = to_npz(&[
            NamedTensor {
                name: "a",
                shape: &[2],
                data: &a,
            },
            NamedTensor {
                name: "blocks.10.b",
                shape: &[2, 3],
                data: &b,
            },
        ]);
        let mut z = zip::ZipArchive::new(std::io::Cursor::new(bytes)).unwrap();
        assert_eq!(z.len(), 2);
        let mut read = |name: &str| {
            let mut f = z.by_name(name).unwrap();
            assert_eq!(f.compression(), zip::CompressionMethod::Stored);
            let mut v = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut v).unwrap();
            crate::render::npy::from_npy(&v).unwrap()
        };
        assert_eq!(read("a.npy"), (vec![2], vec![1.0, 2.0]));
        assert_eq!(read("blocks.10.b.npy"), (vec![2, 3], vec![3.0; 6]));
    }

    #[test]
    fn declared_order_is_enforced() {
        let order = vec![("a".to_string(), vec![2]), ("b".to_string(), vec![1])];
        for format in [TensorFormat::Safetensors, TensorFormat::Npz] {
            let mut w = TensorWriter::new(
                std::io::Cursor::new(Vec::new()),
                format,
                order.clone(),
                &BTreeMap::new(),
            )
            .unwrap();
            assert!(w.write("b", &[1.0]).is_err(), "out of order");
            assert!(w.write("a", &[1.0]).is_err(), "wrong size");
            w.write("a", &[1.0, 2.0]).unwrap();
            assert_eq!(w.expects(), Some("b"));
            assert!(w.finish().is_err(), "b was never written");
        }
    }
}
