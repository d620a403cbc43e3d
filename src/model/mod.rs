//! Real models: load a GGUF file, a Hugging Face folder or hub id, or a named alias; tokenize;
//! run the forward with capture. The only module that uses candle.
//!
//! ```no_run
//! use attnscope::model::{Model, Precision, capture::{AttnCache, CaptureSpec}, forward::RunOptions};
//! let model = Model::load("qwen2.5-coder-0.5b", Precision::Exact, false)?;
//! let tokens = model.tokenizer.encode("Hà Nội là thủ đô của Việt Nam.", false)?;
//! let mut cache = AttnCache::new(&CaptureSpec::patterns(), tokens.len());
//! let out = model.forward(&tokens, &RunOptions::last_logits(tokens.len()), &mut cache)?;
//! let p = cache.pattern(23).unwrap();        // [head, query_pos, key_pos]
//! println!("{:?}", p.row_at(1, tokens.len() - 1));
//! # Ok::<(), attnscope::model::error::Error>(())
//! ```

pub mod attention;
mod backing;
pub mod backward;
pub mod block;
pub mod capture;
pub mod config;
pub mod error;
pub mod family;
pub mod fetch;
pub mod forward;
pub mod generate;
pub mod gguf;
pub mod guard;
pub mod hf;
mod hf_config;
mod logical;
pub mod lrp;
pub mod memory;
pub mod ops;
pub mod panels;
pub mod processing;
pub mod segments;
#[cfg(any(test, feature = "test-fixtures"))]
pub mod tiny;
pub mod tl_weights;
pub mod tokenize;
pub mod weights;

pub use config::{Arch, ModelDims, RopeStyle};
pub use error::{Error, Result};
pub use weights::{Memory, Precision};

use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tokenize::Tokenizer;

/// Where a model came from and how it is held.
#[derive(Clone, Debug, Serialize)]
pub struct ModelInfo {
    /// The alias, hub id, or file/folder name.
    pub name: String,
    /// What the file is (for aliases), else the name in the file's metadata.
    pub description: Option<String>,
    /// the file or folder loaded
    pub path: PathBuf,
    /// the file format (`gguf` or `safetensors`)
    pub format: &'static str,
    /// the precision it runs at
    pub precision: Precision,
    /// How the projections are held (`--memory`), and why that setting.
    pub memory: Memory,
    /// why that memory setting
    pub memory_reason: String,
    /// What the weights take at each setting (GGUF files), for `info`'s memory model.
    #[serde(skip)]
    pub footprint: Option<memory::Footprint>,
    /// the file's (or folder's weights') size in bytes
    pub file_size: u64,
    /// the number of tensors of each type
    pub tensor_types: BTreeMap<String, usize>,
    /// what the tokenizer is
    pub tokenizer: String,
    /// Things the loader had to assume, said out loud.
    pub warnings: Vec<String>,
}

/// A loaded model: its dimensions, tokenizer and packed weights, and the forward and backward
/// that run on them with every hook point handed to an [`Observer`](crate::Observer).
pub struct Model {
    /// the model's shape
    pub dims: ModelDims,
    /// what was loaded, from where, and how
    pub info: ModelInfo,
    /// the model's tokenizer
    pub tokenizer: Tokenizer,
    weights: weights::Weights,
    /// The packed-weight cache file the projections were mapped from, or written to, at load.
    panel_file: Option<PathBuf>,
    /// The projections' transposes packed for the backward (`dX = dY · W`), made on the first
    /// gradient and kept with the model.
    transposed: std::sync::OnceLock<Vec<backward::LayerT>>,
    /// TransformerLens's weight processing applied after load ([`processing`]); none by default.
    processing: processing::Processing,
    /// [`Model::sha256`], computed on first use.
    sha256: std::sync::OnceLock<String>,
}

/// Bytes a token may take in a text, generously: text averages 3-5 bytes a token, and the
/// longest tokens of the aliases' vocabularies are 48 (Gemma 3) to ~190 bytes (runs of spaces or
/// `=` in Qwen2.5's); only a text made of such runs averages more than 64.
pub const TEXT_BYTES_PER_TOKEN: usize = 64;

/// The most bytes of a text for a context of `context` tokens ([`Model::max_text_bytes`]).
pub fn text_bytes_bound(context: usize) -> usize {
    TEXT_BYTES_PER_TOKEN
        .saturating_mul(context)
        .saturating_add(64 << 10)
}

/// What `--model` named, resolved.
enum Source {
    Gguf(PathBuf),
    Folder(PathBuf),
}

fn looks_like_hub_id(s: &str) -> bool {
    let parts: Vec<&str> = s.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
        && !s.starts_with('.')
        && !s.ends_with(".gguf")
        && !s.ends_with(".safetensors")
}

/// What a path that is neither a file nor a folder is, in words.
#[cfg(unix)]
fn special_file_kind(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_fifo() {
        "a named pipe (FIFO)"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_socket() {
        "a socket"
    } else {
        "neither a file nor a folder"
    }
}

#[cfg(not(unix))]
fn special_file_kind(_: &std::fs::FileType) -> &'static str {
    "neither a file nor a folder"
}

fn resolve(spec: &str, progress: bool) -> Result<(Source, String, Option<String>)> {
    if let Some(a) = fetch::alias(spec) {
        let path = fetch::ensure(a, progress)?;
        return Ok((
            if a.folder.is_some() {
                Source::Folder(path)
            } else {
                Source::Gguf(path)
            },
            a.name.to_string(),
            Some(a.description.to_string()),
        ));
    }
    let path = Path::new(spec);
    let name = path
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| spec.to_string());
    if path.is_dir() {
        return Ok((Source::Folder(path.into()), name, None));
    }
    if path.is_file() {
        if path.extension().is_some_and(|e| e == "safetensors") {
            // a lone weights file: use its folder, which must hold config.json
            let dir = path
                .parent()
                .filter(|p| !p.as_os_str().is_empty())
                .unwrap_or(Path::new("."));
            return Ok((Source::Folder(dir.into()), name, None));
        }
        return Ok((Source::Gguf(path.into()), name, None));
    }
    if let Ok(meta) = std::fs::metadata(path) {
        // it exists, but is neither a file nor a folder (a FIFO, /dev/null): never opened,
        // since reading a FIFO would wait for a writer
        return Err(Error::NotAModelFile {
            path: path.into(),
            kind: special_file_kind(&meta.file_type()),
        });
    }
    if looks_like_hub_id(spec) {
        let dir = hf::fetch_hub(spec)?;
        return Ok((Source::Folder(dir), spec.to_string(), None));
    }
    Err(Error::MissingModel {
        path: path.into(),
        aliases: fetch::alias_names(),
    })
}

/// Hands the heap's free pages back to the system (glibc keeps what a program frees, to reuse
/// it; elsewhere this does nothing). Called where a phase has freed tens of megabytes the next
/// one will not reuse: the end of a load (the metadata, the tokenizer's build: 28 MB on the
/// default model) and a long forward's buffers before its logits touch the output head.
pub(crate) fn return_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of glibc's own heaps; it takes no pointers.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// The packed-weight cache of the model in `files` for `precision`'s layout, where `settings`
/// keep one.
fn panel_cache(
    settings: Option<&panels::Settings>,
    precision: Precision,
    files: &[PathBuf],
) -> Option<panels::PanelCache> {
    // each layout has its own file: one precision never maps (and checks) another's, which
    // would bring its pages in for nothing (measured: `fast`'s peak 1.08 → 2.48 GB)
    let layout = weights::PanelLayout::of(precision);
    let s = settings?;
    panels::PanelCache::new(files, &s.dir, layout, s.min_bytes).map(|c| c.with_cap(s.max_bytes))
}

/// The cache's panels when its file is valid; a damaged file is named on standard error.
fn open_cache(cache: Option<&panels::PanelCache>) -> Option<panels::Cached> {
    match cache?.open() {
        panels::Opened::Hit(c) => Some(c),
        panels::Opened::Miss => None,
        panels::Opened::Damaged(why) => {
            eprintln!("attnscope: note: {why}");
            None
        }
    }
}

/// Keeps freshly packed weights in the cache for the next load (a failure only costs that).
/// The cache file the weights now have: mapped from (`hit`) or just written.
fn save_cache(
    cache: Option<&panels::PanelCache>,
    hit: bool,
    weights: &weights::Weights,
) -> Option<PathBuf> {
    let cache = cache?;
    if hit {
        return Some(cache.path.clone());
    }
    match cache.save(weights) {
        Ok(Some(_)) => Some(cache.path.clone()),
        Ok(None) => None,
        Err(e) => {
            eprintln!(
                "attnscope: note: could not keep the packed weights in {} ({e}); the next load packs them again; ATTNSCOPE_PANEL_CACHE=off stops trying",
                cache.path.display()
            );
            None
        }
    }
}

/// The memory model of a GGUF decoder: its projections' parts as the file's tensor table gives
/// them (rows, bytes, type), and its output head's bytes.
fn gguf_footprint(g: &gguf::GgufFile, dims: &ModelDims) -> memory::Footprint {
    use weights::Logical as L;
    let info = |l: &L| {
        let name = gguf::gguf_name_for(dims.arch, l);
        g.content.tensor_infos.get(&name).zip(g.block_type(&name))
    };
    let part = |l: L| -> (usize, u64, Option<weights::BlockType>) {
        match info(&l) {
            Some((t, dt)) => {
                let dims = t.shape.dims();
                let elems: usize = dims.iter().product();
                (
                    dims.first().copied().unwrap_or(0),
                    (elems / dt.block_size() * dt.type_size()) as u64,
                    Some(dt),
                )
            }
            None => (0, 0, None),
        }
    };
    let gpt2 = dims.arch.learned_positions();
    let head = info(&L::LmHead)
        .or_else(|| info(&L::Embed))
        .map(|(t, dt)| (t.shape.elem_count() / dt.block_size() * dt.type_size()) as u64)
        .unwrap_or(0);
    memory::footprint(
        dims,
        |l| {
            [
                vec![part(L::Q(l)), part(L::K(l)), part(L::V(l))],
                vec![part(L::O(l))],
                if gpt2 {
                    vec![part(L::Up(l))]
                } else {
                    vec![part(L::Gate(l)), part(L::Up(l))]
                },
                vec![part(L::Down(l))],
            ]
        },
        head,
    )
}

impl Model {
    /// The sha256 (hex) of the model's files, what `corpus` records name the model by: a GGUF
    /// file's own; a folder's `*.safetensors` and `*.json` files in name order, each as its
    /// name, a NUL and its own sha256, hashed together. Computed on the first call (the default
    /// model's 491 MB: ~0.3 s on a CPU with SHA extensions) and kept.
    pub fn sha256(&self) -> Result<String> {
        if let Some(h) = self.sha256.get() {
            return Ok(h.clone());
        }
        let path = &self.info.path;
        let h = if path.is_dir() {
            use sha2::Digest;
            let mut files: Vec<PathBuf> = std::fs::read_dir(path)
                .map_err(|e| Error::io(path, e))?
                .flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.is_file()
                        && p.extension()
                            .is_some_and(|e| e == "safetensors" || e == "json")
                })
                .collect();
            files.sort();
            let mut all = sha2::Sha256::new();
            for f in &files {
                all.update(f.file_name().unwrap_or_default().as_encoded_bytes());
                all.update([0]);
                all.update(fetch::sha256_file(f)?.as_bytes());
            }
            format!("{:x}", all.finalize())
        } else {
            fetch::sha256_file(path)?
        };
        Ok(self.sha256.get_or_init(|| h).clone())
    }

    /// The packed-weight cache file of this model ([`panels`]): the one its projections were
    /// mapped from, or the one this load wrote for the next.
    pub fn panel_file(&self) -> Option<&Path> {
        self.panel_file.as_deref()
    }

    /// Projections read from a packed-weight cache file (f32 panels, bf16 tiles or 8-bit blocks), of all of
    /// them.
    pub fn mapped_projections(&self) -> (usize, usize) {
        self.count_projections(weights::Linear::is_mapped)
    }

    /// Projections for which `which` holds, of all of them (q|k|v, o, gate|up, down per layer).
    fn count_projections(&self, which: fn(&weights::Linear) -> bool) -> (usize, usize) {
        let all = self
            .weights
            .layers
            .iter()
            .flat_map(|l| [&l.qkv, &l.o, &l.gate_up, &l.down]);
        (all.clone().filter(|p| which(p)).count(), all.count())
    }

    /// Projections multiplied straight from the file's blocks (`--memory low`), of all of them.
    pub fn low_projections(&self) -> (usize, usize) {
        self.count_projections(weights::Linear::is_low)
    }

    /// Projections that run on the AMX tiles as the file's integers and scales (`exact` on a
    /// CPU with AMX, [`crate::kernels::amx::scaled`]), of all of them.
    pub fn scaled_projections(&self) -> (usize, usize) {
        self.count_projections(weights::Linear::is_scaled)
    }

    /// `z_h · W_Oʰᵀ` of `layer` for `m` rows of head `h`'s output alone (`[m, head_dim]`): what
    /// [`Model::output_projection`] gives for rows that are zero outside head `h` (the same bits
    /// on the default model, f32 panels or integers and scales on the AMX tiles), at `1/n_heads`
    /// of its cost. `None` where the projection is held otherwise (bf16 or 8-bit for `fast`).
    pub fn head_output_projection(
        &self,
        layer: usize,
        h: usize,
        z_h: &[f32],
        m: usize,
    ) -> Option<Vec<f32>> {
        let hd = self.dims.head_dim;
        self.weights.layers[layer]
            .o
            .forward_unbiased_cols(z_h, m, h * hd..(h + 1) * hd)
    }

    /// `z · W_Oᵀ` of `layer` without the output bias, for `m` rows of `z` (`[m, n_heads·head_dim]`,
    /// laid out like `hook_z`): what those rows would add to the residual stream.
    pub fn output_projection(&self, layer: usize, z: &[f32], m: usize) -> Vec<f32> {
        self.weights.layers[layer].o.forward_unbiased(z, m)
    }

    /// Loads `spec`: an alias (fetched on first use), a `.gguf` file, a Hugging Face folder, or
    /// a hub id `org/name`. `progress` shows progress bars on standard error.
    pub fn load(spec: &str, precision: Precision, progress: bool) -> Result<Model> {
        Self::load_memory(spec, precision, None, progress)
    }

    /// [`Model::load`] with the projections held as `memory` says (`None`: chosen from the
    /// model's size and the machine's free memory, [`memory::choose`]).
    pub fn load_memory(
        spec: &str,
        precision: Precision,
        memory: Option<Memory>,
        progress: bool,
    ) -> Result<Model> {
        Self::load_full(
            spec,
            precision,
            memory,
            progress,
            panels::Settings::from_env().as_ref(),
        )
    }

    /// [`Model::load`] with the packed-weight cache kept as `panels` says (`None`: none).
    pub fn load_with(
        spec: &str,
        precision: Precision,
        progress: bool,
        panels: Option<&panels::Settings>,
    ) -> Result<Model> {
        Self::load_full(spec, precision, None, progress, panels)
    }

    /// [`Model::load_memory`] with the packed-weight cache kept as `panels` says (`None`: none).
    /// A `memory` of `None` takes `ATTNSCOPE_MEMORY` (`low` or `fast`) for `exact` where it is
    /// set, else the setting [`memory::choose`] picks.
    pub fn load_full(
        spec: &str,
        precision: Precision,
        memory: Option<Memory>,
        progress: bool,
        panels: Option<&panels::Settings>,
    ) -> Result<Model> {
        crate::kernels::select::check().map_err(Error::Kernels)?;
        let memory = match memory {
            None if precision == Precision::Exact => memory::from_env()?,
            m => m,
        };
        if memory == Some(Memory::Low) && precision == Precision::Fast {
            return Err(Error::NotApplicable(
                "--memory low multiplies the file's blocks exactly; it goes with --precision exact (fast holds its own bf16 or 8-bit packing)".into(),
            ));
        }
        let (source, name, description) = resolve(spec, progress)?;
        let bar = load_bar(&name, progress);
        let tick = |i: usize, n: usize| {
            bar.set_length(n as u64);
            bar.set_position(i as u64);
        };
        // the loader boundary lies around the third-party readers themselves (candle's GGUF and
        // safetensors parsing, tokenizers: `guard::quietly`); a panic in attnscope's own
        // loading and packing is a bug, reported as one by the command line
        let model = (move || -> Result<Model> {
            Ok(match source {
                Source::Gguf(path) => Self::from_gguf(
                    || gguf::GgufFile::open(&path),
                    name,
                    description,
                    precision,
                    memory,
                    panel_cache(panels, precision, std::slice::from_ref(&path)),
                    merges_cache(panels, &path),
                    tick,
                )?,
                Source::Folder(dir) => {
                    Self::from_folder(&dir, name, description, precision, memory, panels, tick)?
                }
            })
        })()?;
        bar.finish_and_clear();
        return_free_memory();
        let mut model = model;
        if precision == Precision::Fast && weights::fast_kernel().is_none() {
            let why = crate::kernels::select::kernels().why_no_fast_kernel();
            model.info.warnings.push(format!(
                "{why}, so --precision fast runs the exact f32 kernels (the same numbers as exact)"
            ));
        }
        for w in &model.info.warnings {
            eprintln!("attnscope: warning: {w}");
        }
        Ok(model)
    }

    /// The model of a Hugging Face folder `dir`: its config, tokenizer.json (an encoder's
    /// `[CLS] … [SEP]` checked), and the weights packed at load (or from the panel cache,
    /// keyed by the files and config.json). `memory` is reported only: a folder's floats have
    /// no quantized blocks to keep.
    fn from_folder(
        dir: &Path,
        name: String,
        description: Option<String>,
        precision: Precision,
        memory: Option<Memory>,
        panels: Option<&panels::Settings>,
        tick: impl FnMut(usize, usize),
    ) -> Result<Model> {
        let mut f = hf::HfFolder::open(dir)?;
        let dims = f.dims()?;
        // sized from the files' headers, refused before any tensor is read
        let fp = f.footprint(&dims);
        let avail = memory::available()?;
        let (memory, memory_reason) = folder_memory(memory, &fp, precision, avail);
        memory::check_fits(&fp, memory, precision, avail)?;
        let tokenizer = folder_tokenizer(&f, dir, &dims)?;
        let file_size = f
            .files
            .iter()
            .filter_map(|p| std::fs::metadata(p).ok())
            .map(|m| m.len())
            .sum();
        let info = ModelInfo {
            name,
            description,
            path: dir.to_path_buf(),
            format: "safetensors",
            precision,
            memory,
            memory_reason,
            footprint: Some(fp),
            file_size,
            tensor_types: f.tensor_types(),
            tokenizer: tokenizer.kind.clone(),
            warnings: f.defaulted.clone(),
        };
        // the config says how the files' tensors are cut and fused: part of what
        // the panels are
        let mut files = f.files.clone();
        files.push(dir.join("config.json"));
        let cache = match memory {
            Memory::Low => None,
            Memory::Fast => panel_cache(panels, precision, &files),
        };
        let cached = open_cache(cache.as_ref());
        let weights = weights::load_weights(
            &mut f,
            &dims,
            precision,
            memory,
            dims.rope_style,
            &|l: &weights::Logical| hf::hf_name_for(Some(dims.arch), l),
            cached
                .as_ref()
                .map(|c| c as &dyn weights::PackedProjections),
            tick,
        )?;
        let panel_file = save_cache(cache.as_ref(), cached.is_some(), &weights);
        Ok(Model::assembled(dims, info, tokenizer, weights, panel_file))
    }

    /// A loaded model from its parts, with no transposed weights made yet.
    fn assembled(
        dims: ModelDims,
        info: ModelInfo,
        tokenizer: Tokenizer,
        weights: weights::Weights,
        panel_file: Option<PathBuf>,
    ) -> Model {
        Model {
            dims,
            info,
            tokenizer,
            weights,
            panel_file,
            transposed: Default::default(),
            processing: Default::default(),
            sha256: Default::default(),
        }
    }

    /// Loads a model from GGUF bytes in memory (fuzzing, tests); `name` is used in messages.
    pub fn from_gguf_bytes(name: &str, bytes: Vec<u8>, precision: Precision) -> Result<Model> {
        crate::kernels::select::check().map_err(Error::Kernels)?;
        Self::from_gguf(
            || gguf::GgufFile::from_bytes(Path::new(name), bytes),
            name.to_string(),
            None,
            precision,
            Some(Memory::Fast),
            None,
            None,
            |_, _| {},
        )
    }

    /// The model of the GGUF file `open` reads.
    #[allow(clippy::too_many_arguments)]
    fn from_gguf(
        open: impl FnOnce() -> Result<gguf::GgufFile> + Send,
        name: String,
        description: Option<String>,
        precision: Precision,
        memory: Option<Memory>,
        cache: Option<panels::PanelCache>,
        merges: Option<panels::BlobCache>,
        tick: impl FnMut(usize, usize),
    ) -> Result<Model> {
        // the packed-weight cache is opened beside the reading of the file unless `low` may be
        // chosen: its pages would count in the peak for nothing (a file of 8× a 4-bit model's
        // size, more than half of what is free, may make the default `low`)
        let avail = memory::available()?;
        let maybe_low = may_be_low(memory, precision, cache.as_ref(), avail);
        let early = if maybe_low { None } else { cache.as_ref() };
        // the cache file's checksums are checked on the other core while the file's metadata is
        // read and the tokenizer built (the path to the first token: ~0.06 s and ~0.2 s for the
        // default model, against ~0.1 s of checksums); that core then helps the tokenizer
        let (opened, cached) = rayon::join(
            || -> Result<_> {
                let g = open()?;
                let dims = g.dims()?;
                let tokenizer = Tokenizer::from_gguf_with(g.metadata(), &g.path, merges.as_ref())?;
                Ok((g, dims, tokenizer))
            },
            || open_cache(early),
        );
        let (mut g, (dims, warnings), tokenizer) = opened?;
        let fp = gguf_footprint(&g, &dims);
        let (memory, memory_reason) = match memory {
            Some(m) => (m, format!("asked for (--memory {m})")),
            None => memory::choose(&fp, precision, avail),
        };
        memory::check_fits(&fp, memory, precision, avail)?;
        let (cache, cached) = match memory {
            Memory::Low => (None, None),
            Memory::Fast if maybe_low => {
                let c = open_cache(cache.as_ref());
                (cache, c)
            }
            Memory::Fast => (cache, cached),
        };
        let info = ModelInfo {
            name,
            description: description.or_else(|| g.name()),
            path: g.path.clone(),
            format: "gguf",
            precision,
            memory,
            memory_reason,
            footprint: Some(fp),
            file_size: g.file_size,
            tensor_types: g.tensor_types(),
            tokenizer: tokenizer.kind.clone(),
            warnings,
        };
        let weights = weights::load_weights(
            &mut g,
            &dims,
            precision,
            memory,
            dims.rope_style,
            &|l: &weights::Logical| gguf::gguf_name_for(dims.arch, l),
            cached
                .as_ref()
                .map(|c| c as &dyn weights::PackedProjections),
            tick,
        )?;
        g.release_pages();
        let panel_file = save_cache(cache.as_ref(), cached.is_some(), &weights);
        Ok(Model::assembled(dims, info, tokenizer, weights, panel_file))
    }

    /// Tokenizes `text` (BOS only if the model asks for it or `force_bos`), refusing empty text
    /// and text longer than the model's context.
    pub fn encode(&self, text: &str, force_bos: bool) -> Result<Vec<u32>> {
        self.encode_with(text, force_bos.then_some(true))
    }

    /// The most bytes a text for this model may take: [`TEXT_BYTES_PER_TOKEN`] a token for its
    /// whole context, plus 64 KiB. A longer text is refused before it is tokenized (a 10 MB
    /// text took 2.7 GB to be told it was too long), and the readers of `--file` and standard
    /// input stop at it ([`crate::analysis::files`]).
    pub fn max_text_bytes(&self) -> usize {
        text_bytes_bound(self.dims.context_len)
    }

    /// Refuses a text of `bytes` bytes past [`Model::max_text_bytes`] ([`Error::TextTooLarge`]).
    pub fn check_text_bytes(&self, bytes: usize) -> Result<()> {
        if bytes > self.max_text_bytes() {
            return Err(Error::TextTooLarge {
                bytes,
                limit: self.max_text_bytes(),
                per_token: TEXT_BYTES_PER_TOKEN,
                context: self.dims.context_len,
                model: self.info.name.clone(),
            });
        }
        Ok(())
    }

    /// As [`Model::encode`], with a BOS first as `bos` says: `Some(true)` always, `Some(false)`
    /// never, `None` when the model asks for one.
    pub fn encode_with(&self, text: &str, bos: Option<bool>) -> Result<Vec<u32>> {
        self.check_text_bytes(text.len())?;
        let text = without_bom(text);
        if text.trim().is_empty() {
            return Err(Error::EmptyText);
        }
        let ids = self.tokenizer.encode_with(text, bos)?;
        if ids.len() > self.dims.context_len {
            return Err(Error::TooLong {
                n_tokens: ids.len(),
                limit: self.dims.context_len,
                model: self.info.name.clone(),
            });
        }
        Ok(ids)
    }

    /// Readable text of each token.
    pub fn token_texts(&self, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&i| self.tokenizer.token_text(i)).collect()
    }
}

/// `text` without a UTF-8 byte-order mark (U+FEFF) at its start, said once per process on
/// standard error. A file saved with one (Windows Notepad's UTF-8) would otherwise begin with
/// three byte tokens on a byte-level BPE (transformers keeps them there: a string's BOM is left
/// to whoever read the file, as Python's `utf-8-sig` drops it; BERT's normalizer drops it).
fn without_bom(text: &str) -> &str {
    match text.strip_prefix('\u{feff}') {
        Some(rest) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!("attnscope: note: the text starts with a UTF-8 byte-order mark (U+FEFF), a file's encoding marker rather than text; it is left out")
            });
            rest
        }
        None => text,
    }
}

/// Whether a GGUF model may load with `--memory low` (asked for, or `exact` with a cache whose
/// file is large against what is free: a file of 8× a 4-bit model's size, more than half of what
/// is free, may make the default `low`).
fn may_be_low(
    memory: Option<Memory>,
    precision: Precision,
    cache: Option<&panels::PanelCache>,
    avail: Option<u64>,
) -> bool {
    match memory {
        Some(m) => m == Memory::Low,
        None => {
            precision == Precision::Exact
                && cache.is_some()
                && avail.is_none_or(|a| {
                    cache
                        .and_then(|c| c.model_bytes())
                        .is_none_or(|f| 8 * f + memory::FIXED_BYTES > a / 2)
                })
        }
    }
}

/// The memory setting of a Hugging Face folder and why: `memory` as asked (but `low` packs f32
/// panels as `fast` does when no projection has F16/BF16 bytes to read), else what
/// [`memory::choose`] picks for the `avail` bytes free.
fn folder_memory(
    memory: Option<Memory>,
    fp: &memory::Footprint,
    precision: Precision,
    avail: Option<u64>,
) -> (Memory, String) {
    match memory {
        // F32 tensors have no blocks to read: `low` would pack them as `fast`
        Some(Memory::Low) if !fp.projections.iter().any(|p| p.low) => (
            Memory::Fast,
            "a Hugging Face folder's F32 floats have no quantized blocks to read: --memory low packs f32 panels as fast does (F16/BF16 folders are read from their bytes)".into(),
        ),
        Some(m) => (m, format!("asked for (--memory {m})")),
        None => memory::choose(fp, precision, avail),
    }
}

/// The tokenizer of the folder `dir`: its tokenizer.json (required) with the config's BOS, pad
/// token, chat template and EOS, and an encoder's `[CLS] … [SEP]` checked.
fn folder_tokenizer(f: &hf::HfFolder, dir: &Path, dims: &ModelDims) -> Result<Tokenizer> {
    let (add_bos, bos_id) = f.bos();
    let tok_path = dir.join("tokenizer.json");
    if !tok_path.is_file() {
        return Err(Error::Tokenizer(format!(
            "{} has no tokenizer.json; a Hugging Face model folder needs one",
            dir.display()
        )));
    }
    let mut tokenizer = Tokenizer::from_file(&tok_path, add_bos, bos_id)?;
    tokenizer.pad_id = f.pad_token().and_then(|t| tokenizer.id_of(&t));
    (tokenizer.chat_template, tokenizer.eos_id) = f.chat_template();
    // an encoder's texts are `[CLS] … [SEP]`, as its tokenizer.json builds them
    tokenizer.specials = dims.arch.is_encoder();
    if tokenizer.specials {
        tokenizer.check_encoder_specials(&tok_path)?;
    }
    Ok(tokenizer)
}

/// The loading progress bar (hidden without `progress`): `loading NAME [...] layer i/n`.
fn load_bar(name: &str, progress: bool) -> indicatif::ProgressBar {
    let bar = if progress {
        indicatif::ProgressBar::new(0)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template("loading {msg} [{bar:30}] layer {pos}/{len}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message(name.to_string());
    bar
}

/// The cache of a GGUF file's SentencePiece merges beside the packed weights (`None` without
/// a panel cache).
fn merges_cache(panels: Option<&panels::Settings>, path: &Path) -> Option<panels::BlobCache> {
    panels.and_then(|s| {
        panels::BlobCache::new(
            std::slice::from_ref(&path.to_path_buf()),
            &s.dir,
            "sp-merges",
            s.min_blob_bytes(),
        )
        .map(|b| b.with_cap(s.max_bytes))
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn hub_ids_are_told_apart_from_paths() {
        assert!(super::looks_like_hub_id("Qwen/Qwen2.5-0.5B"));
        assert!(!super::looks_like_hub_id("./model.gguf"));
        assert!(!super::looks_like_hub_id("dir/model.gguf"));
        assert!(!super::looks_like_hub_id("/abs/path"));
        assert!(!super::looks_like_hub_id("a/b/c"));
    }
}
