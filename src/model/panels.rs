//! The packed-weight cache: the projections of a model, dequantized and packed once into the
//! layout their kernel reads (`exact`'s f32 panels; `fast`'s bf16 AMX tiles or 8-bit blocks
//! for VNNI and AVX2), kept in a file next to the model cache and mapped read-only on the next load
//! instead of being packed again.
//!
//! Loading the default model spends most of its time dequantizing 1.4 GB of f32 weights into
//! fresh pages (on a 2-core Xeon: ~0.55 s of a ~0.8 s load, half of it the kernel handing out
//! zeroed pages); mapping a file that sits in the page cache costs a few milliseconds, and
//! checking its checksums ~0.1 s on two cores.
//!
//! A cache file is trusted only when everything it was made from is the same: the model files
//! (size, modification and change times to the nanosecond, device and inode: the file itself,
//! not the path it was reached by, so a model reached by two paths, a hard link or a symbolic
//! one, is cached once; the change time is set by the kernel on every write and cannot be set
//! back, so a file changed in place with its modification time restored is still seen), this
//! program's version, the file format's version and the kernel's layout
//! ([`PanelLayout::name`]). Each matrix carries a CRC-32 checked before use, so a file cut short
//! or damaged on disk (a crash before the kernel wrote it all) is rebuilt, never read. Files are
//! written under a temporary name and renamed into place, so a reader never sees half of one.
//! An alias's file (`qwen2.5-coder-0.5b`: its sha256 is known) is hashed before its panels are
//! written, so a cache entry is never made from an alias file that is not the one it names
//! (~0.3 s for the default model's 491 MB, once per cache entry).
//!
//! The cache is capped ([`Settings::max_bytes`]: `ATTNSCOPE_PANEL_CACHE_MAX_GB`, default
//! [`DEFAULT_MAX_BYTES`]): writing a file removes the files of models that are gone or changed,
//! then the least recently used files (a file's modification time is its last use: set when it
//! is written or mapped) until the rest fits; a model whose packed weights alone exceed the cap
//! is not kept. `attnscope cache list|clear` shows and removes the files ([`list`], [`clear`]).
//! `ATTNSCOPE_PANEL_CACHE=off` turns the cache off; deleting `<cache>/panels` at any time is safe.

use super::weights::{Matrix, PanelLayout, Weights};
use crate::kernels::amx::scaled::PackedScaled;
use crate::kernels::amx::PackedBf16;
use crate::kernels::gemm::PackedB;
use crate::kernels::int8::{self, PackedQ8};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The first bytes of a cache file.
const MAGIC: &[u8; 8] = b"ATNSPNL1";
/// Bumped whenever the file's layout or the meaning of its panels changes (2: entries have a
/// kind; kind 3, 8-bit blocks, came with a layout of its own name, so no older file holds it).
/// 3: the model files are identified by size, time, device and inode, without their path.
/// 4: and by their change time (ctime), which a write sets and no one can set back.
const FORMAT: u32 = 4;
/// Every matrix starts on a page.
const ALIGN: usize = 4096;
/// Models whose packed projections are smaller than this load fast anyway: no file is written
/// (the tests' tiny models would otherwise leave one per temporary file).
pub const MIN_BYTES: usize = 64 << 20;
/// The cache's default cap: 4 GiB (the default model's f32 panels take ~1.4 GB, its `fast` ones
/// less); `ATTNSCOPE_PANEL_CACHE_MAX_GB` sets another.
pub const DEFAULT_MAX_BYTES: u64 = 4 << 30;

/// What a cache file must have been made from to be used.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Identity {
    format: u32,
    attnscope: String,
    /// [`PanelLayout::name`]: the kernel's panel width, or the AMX tiles' parts
    layout: String,
    /// Each model file: length, modification and change times (ns), device and inode (not its
    /// path: one file reached by two paths is one model).
    sources: Vec<SourceId>,
}

/// A model file as the cache knows it: length, modification time (ns), change time (ns),
/// device, inode.
type SourceId = (u64, i128, i128, u64, u64);

/// One matrix in the file: the projection's place (`layer · 4 + slot`), its shape, where its
/// panels start and their CRC-32.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Entry {
    n: usize,
    k: usize,
    offset: usize,
    crc: u32,
    /// 0: the layout's own panels; 1: integers and scales on the AMX tiles; 2: with offsets
    #[serde(default)]
    kind: u8,
}

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    identity: Identity,
    matrices: Vec<Entry>,
    /// The file's whole length: a shorter file was cut off.
    file_len: usize,
    /// The model's name for `attnscope cache list` (the GGUF file's, or the folder's).
    #[serde(default)]
    model: String,
    /// The model files' canonical paths when the file was written (each is checked for being
    /// gone or changed; the identity does not hold them).
    #[serde(default)]
    paths: Vec<String>,
}

/// What [`identify`] finds about a model's files.
#[derive(Debug)]
struct Identified {
    identity: Identity,
    model: String,
    paths: Vec<String>,
    /// The hash of the model files' identities and the kind: the cache file's name (with the
    /// kind), the same whatever path the model was reached by.
    tag: String,
}

/// The cache file of one model (at one kernel layout).
#[derive(Clone, Debug)]
pub struct PanelCache {
    pub path: PathBuf,
    id: Arc<Identified>,
    layout: PanelLayout,
    min_bytes: usize,
    /// The cap of the directory's files ([`Settings::max_bytes`]).
    pub max_bytes: u64,
}

/// A valid cache file, mapped.
pub struct Cached {
    map: Arc<memmap2::Mmap>,
    matrices: Vec<Entry>,
    layout: PanelLayout,
}

/// Bytes a `[k, n]` matrix of entry kind `kind` takes in `layout` (`None`: no such entry).
fn packed_bytes(layout: PanelLayout, kind: u8, n: usize, k: usize) -> Option<usize> {
    match (layout, kind) {
        (PanelLayout::F32(isa) | PanelLayout::Scaled(isa) | PanelLayout::Int8(isa), 0) => {
            PackedB::packed_len(n, k, isa).checked_mul(4)
        }
        (PanelLayout::Int8(_), 3) if k.is_multiple_of(int8::BLOCK) && k > 0 && n > 0 => {
            Some(PackedQ8::packed_len(n, k))
        }
        (PanelLayout::Bf16 { splits }, 0) => PackedBf16::packed_len(n, k, splits).checked_mul(2),
        (PanelLayout::Scaled(_), 1 | 2) if k.is_multiple_of(32) && k > 0 && n > 0 => {
            PackedScaled::packed_len(n, k, kind == 2).checked_mul(2)
        }
        _ => None,
    }
}

/// What [`PanelCache::open`] found.
pub enum Opened {
    Hit(Cached),
    /// No file, or one made from something else (it will be replaced).
    Miss,
    /// A file whose checksums or length are wrong: removed, to be rebuilt. The text says what.
    Damaged(String),
}

/// Where cache files go and from what size a model gets one.
#[derive(Clone, Debug)]
pub struct Settings {
    pub dir: PathBuf,
    pub min_bytes: usize,
    /// The most the directory's files may take together ([`DEFAULT_MAX_BYTES`]); the least
    /// recently used go first.
    pub max_bytes: u64,
}

/// Blobs ([`BlobCache`]) smaller than this are not kept: ~20k SentencePiece merges, where
/// recovering them starts to cost more than reading them.
pub const MIN_BLOB_BYTES: usize = 160_000;

impl Settings {
    /// The floor for blobs: [`MIN_BLOB_BYTES`], or none when the panels have none (tests).
    pub fn min_blob_bytes(&self) -> usize {
        if self.min_bytes == 0 {
            0
        } else {
            MIN_BLOB_BYTES
        }
    }

    /// `<cache>/panels` for models of [`MIN_BYTES`] and more, capped at
    /// `ATTNSCOPE_PANEL_CACHE_MAX_GB` ([`max_bytes_from_env`]), unless `ATTNSCOPE_PANEL_CACHE`
    /// is `off` (or `0`, `false`, `no`).
    pub fn from_env() -> Option<Settings> {
        enabled(std::env::var("ATTNSCOPE_PANEL_CACHE").ok().as_deref()).then(|| Settings {
            dir: dir_from_env(),
            min_bytes: MIN_BYTES,
            max_bytes: max_bytes_from_env(),
        })
    }
}

/// `<cache>/panels`: where the cache files are (`ATTNSCOPE_CACHE` moves `<cache>`).
pub fn dir_from_env() -> PathBuf {
    super::fetch::cache_dir().join("panels")
}

/// The cap `ATTNSCOPE_PANEL_CACHE_MAX_GB` sets (GiB, fractions allowed; 0 keeps nothing), or
/// [`DEFAULT_MAX_BYTES`] when it is unset; a value that is not a number is said and ignored.
pub fn max_bytes_from_env() -> u64 {
    let var = std::env::var("ATTNSCOPE_PANEL_CACHE_MAX_GB").ok();
    parse_max_gb(var.as_deref()).unwrap_or_else(|bad| {
        eprintln!("attnscope: warning: ATTNSCOPE_PANEL_CACHE_MAX_GB={bad} is not a number of GiB (such as 4 or 0.5); the cache keeps its default cap of {} GiB", DEFAULT_MAX_BYTES >> 30);
        DEFAULT_MAX_BYTES
    })
}

/// The cap a value of `ATTNSCOPE_PANEL_CACHE_MAX_GB` says, or the value when it is not one.
fn parse_max_gb(var: Option<&str>) -> Result<u64, String> {
    let Some(v) = var.map(str::trim).filter(|v| !v.is_empty()) else {
        return Ok(DEFAULT_MAX_BYTES);
    };
    match v.parse::<f64>() {
        Ok(gb) if gb.is_finite() && gb >= 0.0 => {
            Ok((gb * (1u64 << 30) as f64).min(u64::MAX as f64) as u64)
        }
        _ => Err(v.to_string()),
    }
}

/// Whether `ATTNSCOPE_PANEL_CACHE`'s value leaves the cache on.
fn enabled(var: Option<&str>) -> bool {
    !matches!(
        var.map(|v| v.trim().to_ascii_lowercase()).as_deref(),
        Some("off" | "0" | "false" | "no")
    )
}

impl PanelCache {
    /// The cache of the model read from `files` (a GGUF file, or a folder's safetensors and
    /// config), in `dir`, for projections packed in `layout`. `None` when a file's metadata
    /// cannot be read.
    pub fn new(
        files: &[PathBuf],
        dir: &Path,
        layout: PanelLayout,
        min_bytes: usize,
    ) -> Option<PanelCache> {
        let id = identify(files, &layout.name())?;
        Some(PanelCache {
            path: dir.join(format!("{}-{}.panels", layout.name(), id.tag)),
            id: Arc::new(id),
            layout,
            min_bytes,
            max_bytes: u64::MAX,
        })
    }

    /// Bytes of the model files the cache is keyed by (their sizes as identified).
    pub fn model_bytes(&self) -> Option<u64> {
        self.id
            .paths
            .iter()
            .map(|p| std::fs::metadata(p).ok().map(|m| m.len()))
            .sum()
    }

    /// The cache with the cap `max_bytes` on its directory.
    pub fn with_cap(mut self, max_bytes: u64) -> PanelCache {
        self.max_bytes = max_bytes;
        self
    }

    /// Maps the cache file and checks it: the identity, the length and every matrix's CRC.
    pub fn open(&self) -> Opened {
        let Ok(file) = std::fs::File::open(&self.path) else {
            return Opened::Miss;
        };
        // SAFETY: the file is only ever replaced by a rename, never written in place, so the
        // mapped bytes do not change under us (a user editing it by hand is caught by the CRCs,
        // checked below before any of it is used).
        let Ok(map) = (unsafe { memmap2::Mmap::map(&file) }) else {
            return Opened::Miss;
        };
        let Some(header) = read_header(&map) else {
            return self.damaged("its header cannot be read");
        };
        if header.identity != self.id.identity {
            return Opened::Miss;
        }
        if header.file_len != map.len() {
            return self.damaged(&format!(
                "it holds {} bytes where its header says {}",
                map.len(),
                header.file_len
            ));
        }
        let layout = self.layout;
        let bad = header.matrices.par_iter().position_any(|e| {
            let end =
                packed_bytes(layout, e.kind, e.n, e.k).and_then(|len| e.offset.checked_add(len));
            match end {
                Some(end) if end <= map.len() && e.offset.is_multiple_of(ALIGN) => {
                    crc(&map[e.offset..end]) != e.crc
                }
                _ => true,
            }
        });
        if let Some(i) = bad {
            return self.damaged(&format!("matrix {i} fails its checksum"));
        }
        // used now: the last to be removed for the cap
        touch(&file, &self.path);
        Opened::Hit(Cached {
            map: Arc::new(map),
            matrices: header.matrices,
            layout,
        })
    }

    fn damaged(&self, what: &str) -> Opened {
        let _ = std::fs::remove_file(&self.path);
        Opened::Damaged(format!(
            "the packed-weight cache {} was damaged ({what}); it is rebuilt",
            self.path.display()
        ))
    }

    /// Writes `weights`' packed projections to the cache file (under a temporary name, renamed
    /// into place). `Ok(None)` when there is nothing to keep: a projection not packed in the
    /// cache's layout, or read from a cache already, a model under [`MIN_BYTES`]. An error,
    /// saying why, when the file is past the cap or the disk has too little free (the file's
    /// size plus [`SPARE_BYTES`]).
    pub fn save(&self, weights: &Weights) -> std::io::Result<Option<u64>> {
        // (n, k, bytes) of each projection in order
        // (n, k, bytes, kind) of each projection in order
        let mut mats: Vec<(usize, usize, &[u8], u8)> = Vec::new();
        for l in &weights.layers {
            for lin in [&l.qkv, &l.o, &l.gate_up, &l.down] {
                match lin.packed_bytes(self.layout) {
                    Some((kind, b)) => mats.push((lin.n, lin.k, b, kind)),
                    None => return Ok(None),
                }
            }
        }
        let total: usize = mats.iter().map(|m| m.2.len()).sum();
        if total < self.min_bytes || mats.is_empty() {
            return Ok(None);
        }
        if total as u64 > self.max_bytes {
            return Err(std::io::Error::other(format!(
                "they take {}, more than the cache's cap of {}; ATTNSCOPE_PANEL_CACHE_MAX_GB raises it",
                size_text(total as u64),
                size_text(self.max_bytes)
            )));
        }
        check_alias_file(&self.id.paths)?;
        let dir = self.path.parent().unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir)?;
        if let Some(free) = free_bytes(dir).filter(|&f| f < total as u64 + SPARE_BYTES) {
            return Err(std::io::Error::other(format!(
                "they take {} and the disk holding {} has {} free; the cache leaves {} to spare",
                size_text(total as u64),
                dir.display(),
                size_text(free),
                size_text(SPARE_BYTES)
            )));
        }
        let file_len = write_file(&self.path, &self.id, &mats)?;
        tidy(dir, &self.path, self.max_bytes);
        Ok(Some(file_len as u64))
    }
}

/// Refuses (an error saying why) to make a cache entry from an alias's file whose sha256 is not
/// the alias's: the file changed after it was fetched (the fetch checked it), so its panels
/// would be kept under the alias's name. Files that are no alias's pass unhashed.
fn check_alias_file(paths: &[String]) -> std::io::Result<()> {
    let aliases: Vec<(PathBuf, &str, &str)> = super::fetch::ALIASES
        .iter()
        .filter_map(|a| {
            let file = match a.folder {
                Some(f) => super::fetch::alias_path(a).join(f.checked),
                None => super::fetch::alias_path(a),
            };
            Some((std::fs::canonicalize(file).ok()?, a.name, a.sha256))
        })
        .collect();
    check_sha256(paths, &aliases)
}

/// [`check_alias_file`] against `known` files: (canonical path, alias name, sha256).
fn check_sha256(paths: &[String], known: &[(PathBuf, &str, &str)]) -> std::io::Result<()> {
    for (file, name, sha256) in known {
        if !paths.iter().any(|p| Path::new(p) == file) {
            continue;
        }
        let got = super::fetch::sha256_file(file).map_err(std::io::Error::other)?;
        if got != *sha256 {
            return Err(std::io::Error::other(format!(
                "{} is the file of `{name}`, but its sha256 is {got}, not {sha256}: it changed after it was fetched, so these are not that model's weights; delete it and attnscope fetches it again",
                file.display(),
            )));
        }
    }
    Ok(())
}

/// Writes a cache file at `path`: the header (`identity`, each piece's shape, offset and CRC-32)
/// then the pieces, each on a page, under a temporary name renamed into place. Its length.
fn write_file(
    path: &Path,
    id: &Identified,
    mats: &[(usize, usize, &[u8], u8)],
) -> std::io::Result<usize> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let (header, data_start, file_len) = header_bytes(id, mats)?;
    let tmp = dir.join(format!(
        ".{}.{}.{:?}.tmp",
        path.file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id(),
        std::thread::current().id()
    ));
    match write_pieces(&tmp, path, &header, data_start, mats) {
        Ok(()) => Ok(file_len),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// The header of a cache file of `mats` (each piece's shape, offset and CRC-32), where its data
/// starts, and the file's length.
fn header_bytes(
    id: &Identified,
    mats: &[(usize, usize, &[u8], u8)],
) -> std::io::Result<(Vec<u8>, usize, usize)> {
    let crcs: Vec<u32> = mats.par_iter().map(|m| crc(m.2)).collect();
    // the header's length depends on the offsets, which depend on its length: the header is
    // given room for offsets of up to 20 digits, then padded to the page
    let layout = |start: usize| -> (Vec<Entry>, usize) {
        let mut at = start;
        let entries = mats
            .iter()
            .zip(&crcs)
            .map(|(&(n, k, bytes, kind), &crc)| {
                let e = Entry {
                    n,
                    k,
                    offset: at,
                    crc,
                    kind,
                };
                at += bytes.len().div_ceil(ALIGN) * ALIGN;
                e
            })
            .collect();
        (entries, at)
    };
    let json = |matrices: Vec<Entry>, file_len: usize| {
        serde_json::to_vec(&Header {
            identity: id.identity.clone(),
            matrices,
            file_len,
            model: id.model.clone(),
            paths: id.paths.clone(),
        })
        .map_err(std::io::Error::other)
    };
    let (probe, _) = layout(usize::MAX / 2);
    let probe_len = json(probe, usize::MAX)?.len();
    let data_start = (16 + probe_len).div_ceil(ALIGN) * ALIGN;
    let (matrices, file_len) = layout(data_start);
    let header = json(matrices, file_len)?;
    debug_assert!(16 + header.len() <= data_start);
    Ok((header, data_start, file_len))
}

/// Writes the header and the pieces (each on a page from `data_start`) to `tmp`, then renames it
/// to `path`.
fn write_pieces(
    tmp: &Path,
    path: &Path,
    header: &[u8],
    data_start: usize,
    mats: &[(usize, usize, &[u8], u8)],
) -> std::io::Result<()> {
    let mut f = std::io::BufWriter::with_capacity(1 << 20, std::fs::File::create(tmp)?);
    f.write_all(MAGIC)?;
    f.write_all(&(header.len() as u64).to_le_bytes())?;
    f.write_all(header)?;
    // the data starts where the offsets say: the page after the probe's longer header,
    // which can be a page past the one after this header (SmolLM2's 120 matrices: every
    // offset one page off, the file a page short, so every load found it damaged and
    // packed the weights again)
    f.write_all(&vec![0u8; data_start - (16 + header.len())])?;
    let mut at = data_start;
    let zeros = vec![0u8; ALIGN];
    for (_, _, bytes, _) in mats {
        let pad = at.div_ceil(ALIGN) * ALIGN - at;
        f.write_all(&zeros[..pad])?;
        f.write_all(bytes)?;
        at += pad + bytes.len();
    }
    let pad = at.div_ceil(ALIGN) * ALIGN - at;
    f.write_all(&zeros[..pad])?;
    // no fsync (it cost 2.4 s for the default model): a file cut short by a crash
    // fails its length or checksums on the next open and is rebuilt
    let f = f.into_inner().map_err(|e| e.into_error())?;
    // written now: the most recently used file
    touch(&f, path);
    std::fs::rename(tmp, path)
}

/// A small derived artifact of a model kept next to its packed weights (Gemma's SentencePiece
/// merges, recovered from a 262k vocabulary in ~0.5 s): one piece of bytes, under the same
/// identity rules and CRC as the panels.
#[derive(Clone, Debug)]
pub struct BlobCache {
    pub path: PathBuf,
    id: Arc<Identified>,
    /// Smaller payloads are not kept (the tests' tiny vocabularies).
    pub min_bytes: usize,
    /// The cap of the directory's files ([`Settings::max_bytes`]).
    pub max_bytes: u64,
}

impl BlobCache {
    /// The `kind` blob of the model read from `files`, in `dir`.
    pub fn new(files: &[PathBuf], dir: &Path, kind: &str, min_bytes: usize) -> Option<BlobCache> {
        let id = identify(files, kind)?;
        Some(BlobCache {
            path: dir.join(format!("{kind}-{}.bin", id.tag)),
            id: Arc::new(id),
            min_bytes,
            max_bytes: u64::MAX,
        })
    }

    /// The payload, if the file is there, made from these very files, whole and unchanged.
    pub fn load(&self) -> Option<Vec<u8>> {
        let bytes = std::fs::read(&self.path).ok()?;
        let h = read_header(&bytes)?;
        if h.identity != self.id.identity || h.file_len != bytes.len() || h.matrices.len() != 1 {
            return None;
        }
        let e = &h.matrices[0];
        let payload = bytes.get(e.offset..e.offset.checked_add(e.n)?)?;
        let ok = e.k == 1 && crc(payload) == e.crc;
        if ok {
            if let Ok(f) = std::fs::File::open(&self.path) {
                touch(&f, &self.path);
            }
        }
        ok.then(|| payload.to_vec())
    }

    /// The blob with the cap `max_bytes` on its directory.
    pub fn with_cap(mut self, max_bytes: u64) -> BlobCache {
        self.max_bytes = max_bytes;
        self
    }

    /// Keeps `payload` (if it is at least `min_bytes`); a failure only costs the next load time.
    pub fn store(&self, payload: &[u8]) {
        if payload.len() < self.min_bytes || payload.len() as u64 > self.max_bytes {
            return;
        }
        let dir = self.path.parent().unwrap_or(Path::new("."));
        if std::fs::create_dir_all(dir).is_ok()
            && write_file(&self.path, &self.id, &[(payload.len(), 1, payload, 0)]).is_ok()
        {
            tidy(dir, &self.path, self.max_bytes);
        }
    }
}

/// Whether `name` is one of the cache's files (not a temporary one).
fn is_cache_file(name: &str) -> bool {
    !name.starts_with('.') && (name.ends_with(".panels") || name.ends_with(".bin"))
}

/// Tidies `dir` after `keep` was written: removes the cache files whose model files are gone or
/// changed (a deleted or edited model does not leave gigabytes behind), temporary files a
/// killed writer left more than a day ago, then the least recently used files until all of
/// them take at most `max_bytes` (`keep` stays). Reads only the headers.
fn tidy(dir: &Path, keep: &Path, max_bytes: u64) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    // (last use, name, path, bytes) of the files that stay
    let mut files: Vec<(std::time::SystemTime, String, PathBuf, u64)> = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let Ok(md) = e.metadata() else { continue };
        if name.starts_with('.') && name.ends_with(".tmp") {
            let old = md
                .modified()
                .ok()
                .and_then(|t| t.elapsed().ok())
                .is_some_and(|age| age.as_secs() > 24 * 3600);
            if old {
                let _ = std::fs::remove_file(&path);
            }
            continue;
        }
        if !is_cache_file(&name) {
            continue;
        }
        if path != keep && header_of_file(&path).is_some_and(|h| is_stale(&h)) {
            let _ = std::fs::remove_file(&path);
            continue;
        }
        let used = md.modified().unwrap_or(std::time::UNIX_EPOCH);
        files.push((used, name, path, md.len()));
    }
    let mut total: u64 = files.iter().map(|f| f.3).sum();
    files.sort();
    for (_, _, path, bytes) in files {
        if total <= max_bytes {
            break;
        }
        if path != keep && std::fs::remove_file(&path).is_ok() {
            total -= bytes;
        }
    }
}

/// Whether the model files a cache file was made from are gone or changed since (its panels
/// can never be used again).
fn is_stale(h: &Header) -> bool {
    h.paths.len() != h.identity.sources.len()
        || h.paths
            .iter()
            .zip(&h.identity.sources)
            .any(|(p, s)| source_id(Path::new(p)).as_ref() != Some(s))
}

/// Marks the cache file `f` (at `path`) as used now, for the cap's least-recently-used order:
/// its modification time becomes now, or just after the newest other file's when the clock
/// has not moved past it (two uses within one tick of a coarse clock keep their order).
fn touch(f: &std::fs::File, path: &Path) {
    let now = std::time::SystemTime::now();
    let newest = path
        .parent()
        .and_then(|d| std::fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path() != path && is_cache_file(&e.file_name().to_string_lossy()))
        .filter_map(|e| e.metadata().ok()?.modified().ok())
        .max();
    let t = match newest {
        Some(n) if n >= now => n + std::time::Duration::from_millis(1),
        _ => now,
    };
    let _ = f.set_modified(t);
}

/// One file of the cache, as `attnscope cache list` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct CacheFile {
    pub path: PathBuf,
    /// The model's name (its GGUF file's, or its folder's); empty for a file of another version.
    pub model: String,
    /// What the file holds: a kernel layout's panels (`f32x16`, `bf16`, ...), or a blob's kind
    /// (`sp-merges`).
    pub layout: String,
    pub bytes: u64,
    /// Seconds since the Unix epoch of its last use (written or mapped).
    pub last_used: u64,
    /// The model files it was made from.
    pub sources: Vec<String>,
    /// Whether this attnscope can use it: made by this version from model files that are
    /// still there, unchanged (a stale file is removed the next time a file is written).
    pub usable: bool,
    /// (device, inode) of each model file it was made from.
    #[serde(skip)]
    files: Vec<(u64, u64)>,
    /// The last use, to the clock's precision (the order of [`list`]).
    #[serde(skip)]
    used: std::time::SystemTime,
}

/// `bytes` for a message: GiB from 1 GiB, else MB.
fn size_text(bytes: u64) -> String {
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MB", bytes as f64 / 1e6)
    }
}

/// The cache files in `dir`, most recently used first.
pub fn list(dir: &Path) -> Vec<CacheFile> {
    let mut out: Vec<CacheFile> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| is_cache_file(&e.file_name().to_string_lossy()))
        .filter_map(|e| {
            let md = e.metadata().ok()?;
            if !md.is_file() {
                return None;
            }
            let path = e.path();
            let h = header_of_file(&path);
            let used = md.modified().unwrap_or(std::time::UNIX_EPOCH);
            let last_used = used
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            Some(match h {
                Some(h) => CacheFile {
                    usable: h.identity.format == FORMAT
                        && h.identity.attnscope == env!("CARGO_PKG_VERSION")
                        && !is_stale(&h),
                    model: h.model.clone(),
                    layout: h.identity.layout.clone(),
                    files: h.identity.sources.iter().map(|s| (s.3, s.4)).collect(),
                    sources: h.paths,
                    path,
                    bytes: md.len(),
                    last_used,
                    used,
                },
                None => CacheFile {
                    path,
                    model: String::new(),
                    layout: String::new(),
                    bytes: md.len(),
                    last_used,
                    sources: Vec::new(),
                    usable: false,
                    files: Vec::new(),
                    used,
                },
            })
        })
        .collect();
    out.sort_by(|a, b| b.used.cmp(&a.used).then(a.path.cmp(&b.path)));
    out
}

impl CacheFile {
    /// Whether this file belongs to `model`: its name as [`list`] shows it, an alias, or a
    /// path to the model's file or folder (the file itself, by device and inode, so any path
    /// to it does).
    pub fn is_of(&self, model: &str) -> bool {
        let stem = Path::new(&self.model).file_stem();
        if !self.model.is_empty() && (self.model == model || stem == Some(model.as_ref())) {
            return true;
        }
        let path = match super::fetch::alias(model) {
            Some(a) => super::fetch::alias_path(a),
            None => PathBuf::from(model),
        };
        let files: Vec<PathBuf> = if path.is_dir() {
            std::fs::read_dir(&path)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .collect()
        } else {
            vec![path]
        };
        files
            .iter()
            .filter_map(|f| source_id(f))
            .any(|s| self.files.contains(&(s.3, s.4)))
    }
}

/// Removes the cache files in `dir` (only `model`'s, [`CacheFile::is_of`], when given) and
/// the temporary files writers left; the files removed.
pub fn clear(dir: &Path, model: Option<&str>) -> std::io::Result<Vec<CacheFile>> {
    let mut removed = Vec::new();
    for f in list(dir) {
        if model.is_none_or(|m| f.is_of(m)) {
            match std::fs::remove_file(&f.path) {
                Ok(()) => removed.push(f),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
    }
    if model.is_none() {
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = std::fs::remove_file(e.path());
            }
        }
    }
    Ok(removed)
}

/// The header of the cache file at `path`, read without mapping the file.
fn header_of_file(path: &Path) -> Option<Header> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let mut head = [0u8; 16];
    f.read_exact(&mut head).ok()?;
    let len = u64::from_le_bytes(head[8..16].try_into().ok()?);
    if &head[..8] != MAGIC || len > 64 << 20 {
        return None;
    }
    let mut body = vec![0u8; len as usize];
    f.read_exact(&mut body).ok()?;
    serde_json::from_slice(&body).ok()
}

impl Cached {
    /// Projection `i` (`layer · 4 + slot`: q|k|v, o, gate|up, down) if the file holds it at
    /// shape `[k, n]`.
    pub fn get(&self, i: usize, n: usize, k: usize) -> Option<Matrix> {
        let e = self.matrices.get(i)?;
        if e.n != n || e.k != k {
            return None;
        }
        let map = self.map.clone();
        match (self.layout, e.kind) {
            (PanelLayout::F32(isa) | PanelLayout::Scaled(isa) | PanelLayout::Int8(isa), 0) => {
                PackedB::from_mapped(map, e.offset, n, k, isa).map(Matrix::Packed)
            }
            (PanelLayout::Int8(_), 3) => {
                PackedQ8::from_mapped(map, e.offset, n, k).map(Matrix::Int8)
            }
            (PanelLayout::Bf16 { splits }, 0) => {
                PackedBf16::from_mapped(map, e.offset, n, k, splits).map(Matrix::Amx)
            }
            (PanelLayout::Scaled(_), 1 | 2) => {
                PackedScaled::from_mapped(map, e.offset, n, k, e.kind == 2).map(Matrix::Scaled)
            }
            _ => None,
        }
    }
}

impl super::weights::PackedProjections for Cached {
    fn get(&self, i: usize, n: usize, k: usize) -> Option<Matrix> {
        Cached::get(self, i, n, k)
    }
}

/// The identity of the model file at `path`: length, modification time, change time, device,
/// inode. The change time matters: a file written in place and given its old modification
/// time back (`touch -d`, `cp -p` over it, a tool's restore) has a new one, which only the
/// kernel sets.
fn source_id(path: &Path) -> Option<SourceId> {
    let md = std::fs::metadata(path).ok()?;
    let mtime = md
        .modified()
        .ok()?
        .duration_since(std::time::UNIX_EPOCH)
        .ok()?
        .as_nanos() as i128;
    #[cfg(unix)]
    let (ctime, dev, ino) = {
        use std::os::unix::fs::MetadataExt;
        let ctime = md.ctime() as i128 * 1_000_000_000 + md.ctime_nsec() as i128;
        (ctime, md.dev(), md.ino())
    };
    #[cfg(not(unix))]
    let (ctime, dev, ino) = (0, 0, 0);
    Some((md.len(), mtime, ctime, dev, ino))
}

/// What a cache file of `kind` made from `files` must say it was made from, the model's name,
/// and the hash its name carries. The hash is of the files themselves (size, time,
/// device, inode), not of their paths: a model reached by another path finds the same file,
/// and a changed model gets a new one (the old one is removed as stale by [`tidy`]).
fn identify(files: &[PathBuf], kind: &str) -> Option<Identified> {
    let mut sources = Vec::new();
    let mut paths = Vec::new();
    for f in files {
        let path = std::fs::canonicalize(f).ok()?;
        sources.push(source_id(&path)?);
        paths.push(path.to_string_lossy().into_owned());
    }
    let first = Path::new(paths.first()?);
    // a GGUF file by its name, a folder's files (safetensors, config.json) by the folder's
    let model = if files.len() == 1 {
        first.file_name()
    } else {
        first.parent().and_then(|p| p.file_name())
    }
    .map(|s| s.to_string_lossy().into_owned())
    .unwrap_or_else(|| "model".into());
    let tag = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        for (len, mtime, ctime, dev, ino) in &sources {
            h.update(len.to_le_bytes());
            h.update(mtime.to_le_bytes());
            h.update(ctime.to_le_bytes());
            h.update(dev.to_le_bytes());
            h.update(ino.to_le_bytes());
        }
        h.update(kind.as_bytes());
        let d = h.finalize();
        d[..8]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    };
    Some(Identified {
        identity: Identity {
            format: FORMAT,
            attnscope: env!("CARGO_PKG_VERSION").into(),
            layout: kind.into(),
            sources,
        },
        model,
        paths,
        tag,
    })
}

fn read_header(map: &[u8]) -> Option<Header> {
    if map.len() < 16 || &map[..8] != MAGIC {
        return None;
    }
    let len = u64::from_le_bytes(map[8..16].try_into().ok()?) as usize;
    let body = map.get(16..16usize.checked_add(len)?)?;
    serde_json::from_slice(body).ok()
}

/// CRC-32 of `bytes`, in 16 MiB pieces folded together so both cores share a large matrix.
fn crc(bytes: &[u8]) -> u32 {
    const PIECE: usize = 16 << 20;
    let pieces: Vec<(u32, usize)> = bytes
        .par_chunks(PIECE)
        .map(|c| {
            let mut h = crc32fast::Hasher::new();
            h.update(c);
            (h.finalize(), c.len())
        })
        .collect();
    // crc(a || b) from crc(a), crc(b) and len(b)
    let mut acc = crc32fast::Hasher::new();
    for (c, len) in pieces {
        acc.combine(&crc32fast::Hasher::new_with_initial_len(c, len as u64));
    }
    acc.finalize()
}

/// What a cache file leaves free on its disk: [`PanelCache::save`] writes none that would leave
/// less.
pub const SPARE_BYTES: u64 = 1 << 30;

/// Free bytes for an unprivileged user on the file system holding `dir` (`None` where that
/// cannot be read).
pub fn free_bytes(dir: &Path) -> Option<u64> {
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs is plain old data, all-zero bytes are a valid value.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: a valid NUL-terminated path and a statvfs struct to fill.
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return None;
        }
        Some(s.f_bavail as u64 * s.f_frsize as u64)
    }
    #[cfg(not(unix))]
    {
        let _ = dir;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_is_turned_off_by_its_variable_only() {
        for off in ["off", "0", "false", "no", " OFF "] {
            assert!(!enabled(Some(off)), "{off}");
        }
        for on in [None, Some(""), Some("on"), Some("1"), Some("yes")] {
            assert!(enabled(on), "{on:?}");
        }
    }

    #[test]
    fn the_cap_is_read_in_gib() {
        assert_eq!(parse_max_gb(None), Ok(DEFAULT_MAX_BYTES));
        assert_eq!(parse_max_gb(Some(" ")), Ok(DEFAULT_MAX_BYTES));
        assert_eq!(parse_max_gb(Some("2")), Ok(2 << 30));
        assert_eq!(parse_max_gb(Some("0.5")), Ok(1 << 29));
        assert_eq!(parse_max_gb(Some("0")), Ok(0));
        for bad in ["-1", "four", "NaN", "inf"] {
            assert_eq!(parse_max_gb(Some(bad)), Err(bad.to_string()), "{bad}");
        }
    }

    #[test]
    fn a_checksum_in_pieces_is_the_checksum_of_the_whole() {
        let bytes: Vec<u8> = (0..(40usize << 20) + 12345)
            .map(|i| ((i * 2654435761) >> 13) as u8)
            .collect();
        for len in [0, 1, 16 << 20, (16 << 20) + 1, bytes.len()] {
            assert_eq!(crc(&bytes[..len]), crc32fast::hash(&bytes[..len]), "{len}");
        }
    }

    /// Every matrix lies where the header says and the file is as long as it says, whatever
    /// the header's length: the probe header (20-digit offsets) can end a page after the real
    /// one, and the data goes where the probe put it.
    #[test]
    fn the_pieces_lie_at_their_offsets_for_any_header_length() {
        let dir = tempfile::tempdir().unwrap();
        let identity = Identified {
            identity: Identity {
                format: FORMAT,
                attnscope: "test".into(),
                layout: "test".into(),
                sources: vec![],
            },
            model: "test".into(),
            paths: vec![],
            tag: "0".into(),
        };
        let pieces: Vec<Vec<u8>> = (0..160u32)
            .map(|i| {
                (0..(i as usize % 7) * 700 + 1)
                    .map(|j| (i as usize * 31 + j) as u8)
                    .collect()
            })
            .collect();
        let mut crossed = 0;
        for count in 1..=pieces.len() {
            let mats: Vec<(usize, usize, &[u8], u8)> = pieces[..count]
                .iter()
                .map(|p| (1, p.len(), &p[..], 0))
                .collect();
            let path = dir.path().join(format!("c{count}.panels"));
            let len = write_file(&path, &identity, &mats).unwrap();
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(bytes.len(), len, "{count} pieces: the file's length");
            let header = read_header(&bytes).unwrap();
            assert_eq!(header.file_len, len);
            let header_end = 16 + u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
            if header.matrices[0].offset > header_end.div_ceil(ALIGN) * ALIGN {
                crossed += 1;
            }
            for (e, p) in header.matrices.iter().zip(&pieces[..count]) {
                assert!(e.offset.is_multiple_of(ALIGN));
                assert_eq!(
                    &bytes[e.offset..e.offset + p.len()],
                    &p[..],
                    "{count} pieces"
                );
                assert_eq!(crc(p), e.crc);
            }
        }
        // the case that was wrong: the data a page past the one after the header
        assert!(
            crossed > 0,
            "no header length crossed a page; make the pieces more"
        );
    }

    /// An alias's file is hashed before a cache entry is made from it: one that is not the file
    /// the alias names (sha256) gets no entry, and says why; other files are not hashed.
    #[test]
    fn an_alias_file_that_changed_gets_no_cache_entry() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("m.gguf");
        std::fs::write(&f, b"abc").unwrap();
        let f = std::fs::canonicalize(&f).unwrap();
        let paths = vec![f.to_string_lossy().into_owned()];
        // sha256("abc")
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(check_sha256(&paths, &[(f.clone(), "m", abc)]).is_ok());
        std::fs::write(&f, b"abd").unwrap();
        let e = check_sha256(&paths, &[(f.clone(), "m", abc)]).unwrap_err();
        assert!(
            e.to_string().contains("changed after it was fetched"),
            "{e}"
        );
        let other = d.path().join("other.gguf");
        assert!(
            check_sha256(&paths, &[(other, "o", abc)]).is_ok(),
            "not an alias's"
        );
    }

    #[test]
    fn a_header_that_is_not_ours_is_not_read() {
        assert!(read_header(b"").is_none());
        assert!(read_header(b"GGUF\x03\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00").is_none());
        let mut lying = MAGIC.to_vec();
        lying.extend_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_header(&lying).is_none());
        let mut junk = MAGIC.to_vec();
        junk.extend_from_slice(&3u64.to_le_bytes());
        junk.extend_from_slice(b"{x}");
        assert!(read_header(&junk).is_none());
    }
}
