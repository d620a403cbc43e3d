//! `attnscope capture`: a forward whose captured hook tensors stream into a `.safetensors` or
//! `.npz` file as each layer finishes ([`capture`]), so memory holds about one layer's capture;
//! the file is written under a temporary name and renamed into place when complete.

use crate::analysis::request::{parse_index_list, usage};
use crate::model::capture::{hook_name, AttnCache, CaptureSpec, Captured, Hook, Observer, Queries};
use crate::model::forward::RunOptions;
use crate::model::{Error, Model};
use crate::render::direct::DirectFile;
use crate::render::tensorfile::{TensorFormat, TensorWriter, HEAP_PHASE};
use crate::render::{timings_opening, Output};
use anyhow::Context;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What to capture and where: the CLI's flags, Python's `model.capture` arguments.
#[derive(Clone, Debug)]
pub struct CaptureRequest {
    /// The file to write (`.safetensors` or `.npz`).
    pub out: PathBuf,
    /// Hooks: pattern, scores, q, k, v, rot_q, rot_k, z, attn_out, resid (pre and post),
    /// resid_pre, resid_post, all (comma-separated).
    pub hooks: String,
    /// Layers: all, 0-3, 0,12,23.
    pub layers: String,
    /// Query heads (for pattern, scores, q, rot_q, z): all, 0-3, 1,5.
    pub heads: String,
    /// Query positions kept: all, last, or a list such as 0,5,17.
    pub queries: String,
    /// The file format; `None`: from `out`'s extension (`.npz`, else safetensors).
    pub format: Option<TensorFormat>,
    /// Replace `out` if it exists.
    pub force: bool,
    /// Let a layer's writing run on while the next layer computes (two layers' capture in
    /// memory instead of one).
    pub two_layers: bool,
    /// The command's input files (its `--file`, the model's file): `out` is never one of them.
    pub inputs: Vec<PathBuf>,
}

impl CaptureRequest {
    /// `out` with every hook's default: patterns of every layer, head and query.
    pub fn new(out: impl Into<PathBuf>) -> Self {
        CaptureRequest {
            out: out.into(),
            hooks: "pattern".into(),
            layers: "all".into(),
            heads: "all".into(),
            queries: "all".into(),
            format: None,
            force: false,
            two_layers: false,
            inputs: Vec::new(),
        }
    }

    /// Checks what needs no model: `out` can be written ([`Output::check`]: not there unless
    /// `force`, in a folder that takes it, not an input) and the hooks are known. Returns the
    /// hooks.
    pub fn check(&self) -> anyhow::Result<Vec<Hook>> {
        self.output()?;
        Hook::parse_list(&self.hooks).map_err(usage)
    }

    /// `out`, checked ([`Output::check`]).
    fn output(&self) -> anyhow::Result<Output> {
        let inputs: Vec<&Path> = self.inputs.iter().map(PathBuf::as_path).collect();
        Output::check(&self.out, self.force, &inputs)
    }

    /// The request resolved against `model` and a text of `n` tokens: every tensor's name and
    /// shape, in file order, before the forward.
    pub fn plan(&self, model: &Model, n: usize) -> anyhow::Result<CapturePlan> {
        let hooks = self.check()?;
        let d = &model.dims;
        self.check_family(model, &hooks)?;
        if n > d.context_len {
            return Err(anyhow::Error::new(Error::TooLong {
                n_tokens: n,
                limit: d.context_len,
                model: model.info.name.clone(),
            }));
        }
        let layers = parse_index_list(&self.layers, d.n_layers, "layer")?;
        let heads = parse_index_list(&self.heads, d.n_heads, "head")?;
        let queries = match self.queries.as_str() {
            "all" => Queries::All,
            "last" => Queries::Last,
            s => Queries::List(parse_index_list(s, n, "query position")?),
        };
        let spec = CaptureSpec {
            hooks,
            layers: Some(layers),
            heads: Some(heads),
            queries,
        };
        let format = self
            .format
            .unwrap_or(if self.out.extension().is_some_and(|e| e == "npz") {
                TensorFormat::Npz
            } else {
                TensorFormat::Safetensors
            });
        self.check_layers_reach(model, &spec)?;
        let mut order = spec.tensors(d, n);
        if format == TensorFormat::Npz {
            order.push(("token_ids".into(), vec![n]));
        }
        Ok(CapturePlan {
            spec,
            format,
            order,
            n,
        })
    }
}

impl CaptureRequest {
    /// Refuses hooks named on their own that `model`'s family does not hand out (an encoder's
    /// `rot_q`, `mlp_pre_linear` without a gate, `hook_pos_embed` of a rotary model): `all`,
    /// and `embed`'s positions, keep what the family has.
    fn check_family(&self, model: &Model, hooks: &[Hook]) -> anyhow::Result<()> {
        if self.hooks.split(',').any(|p| p.trim() == "all") {
            return Ok(());
        }
        let has = Hook::in_forward_order(model.dims.arch);
        let absent: Vec<&str> = hooks
            .iter()
            // `embed` of a rotary model: its token embeddings alone
            .filter(|h| !has.contains(h))
            .filter(|h| !(**h == Hook::PosEmbed && hooks.contains(&Hook::Embed)))
            .map(|h| h.suffix())
            .collect();
        if absent.is_empty() {
            return Ok(());
        }
        Err(usage(format!(
            "{} ({}) has no {}: its forward hands none out; leave it out of --hooks, or ask for `all` (every hook this model has)",
            model.info.name,
            model.dims.arch.name(),
            absent.join(", ")
        )))
    }
}

impl CaptureRequest {
    /// Refuses a global hook named in `--hooks` whose one layer `--layers` leaves out
    /// (`ln_final` with `--layers 0`: the file came without it, and the run said it was written).
    fn check_layers_reach(&self, model: &Model, spec: &CaptureSpec) -> anyhow::Result<()> {
        if self.hooks.split(',').any(|p| p.trim() == "all") {
            return Ok(());
        }
        let keys = spec.keys(&model.dims);
        let has = Hook::in_forward_order(model.dims.arch);
        let left_out = spec
            .hooks
            .iter()
            .find(|h| has.contains(h) && !keys.iter().any(|k| k.1 == **h));
        match left_out {
            None => Ok(()),
            Some(&h) => {
                let at = h.layer_of(0, model.dims.n_layers);
                Err(usage(format!(
                    "{} is handed out at layer {at}, which --layers {} leaves out; add {at} to --layers",
                    hook_name(at, h),
                    self.layers
                )))
            }
        }
    }
}

/// A [`CaptureRequest`] resolved for one model and length.
pub struct CapturePlan {
    spec: CaptureSpec,
    format: TensorFormat,
    /// every tensor's name and shape, in file order
    order: Vec<(String, Vec<usize>)>,
    n: usize,
}

impl CapturePlan {
    /// How many tensors the file will hold.
    pub fn n_tensors(&self) -> usize {
        self.order.len()
    }

    /// The tensors' bytes (f32), the file's size less its headers.
    pub fn total_bytes(&self) -> f64 {
        self.order
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as f64 * 4.0)
            .sum()
    }
}

/// What a capture wrote.
#[derive(Clone, Debug, Serialize)]
pub struct CaptureReport {
    /// the file written
    pub path: PathBuf,
    /// the number of tensors in it
    pub tensors: usize,
    /// the file's size
    pub bytes: u64,
    /// the number of tokens run
    pub n_tokens: usize,
    /// the model's name
    pub model: String,
    /// the precision it ran at (`exact` or `fast`)
    pub precision: String,
    /// the forward and the writing, from the forward's start to the rename
    pub seconds: f64,
    /// how long the forward stood waiting for the disk
    pub waited_s: f64,
}

impl CaptureReport {
    /// The line `attnscope capture` prints: what was written, with the load's seconds and those
    /// of the forward and writing (`run_s`).
    pub fn message(&self, load_s: f64, run_s: f64) -> String {
        format!(
            "wrote {} tensors ({:.1} MB) for {} tokens of {} ({} precision) to {} {}, of which {:.3} s waiting for the disk)\n",
            self.tensors,
            self.bytes as f64 / 1e6,
            self.n_tokens,
            self.model,
            self.precision,
            self.path.display(),
            timings_opening(load_s, "forward and writing", run_s),
            self.waited_s
        )
    }
}

/// The forward's observer for `capture`: an [`AttnCache`] that hands a layer's tensors to a
/// writer thread as soon as they are final, and lets them go: the patterns (and every hook up to
/// `z`) when the layer's attention is done, so they are written while its MLP runs, the rest when
/// the layer is done. Then the layer waits until its tensors are written (`wait`), so memory
/// holds one layer's capture (measured at 2,048 tokens of the default model: the writing of each
/// 235 MB layer past the page cache was always done before the MLP, so the waiting cost nothing;
/// 1.81 GB peak against 2.04 GB for two layers, 1.75 GB once the recycled patterns' zeros above
/// the diagonal were no longer written again). Without `wait` (`--two-layers`) the writing may
/// run on into the next layer. Written buffers come back for the next layer.
struct StreamToFile<'a> {
    /// wait for each layer's writing before going on
    wait: bool,
    cache: AttnCache,
    /// every tensor of the file, in its order ([`CaptureSpec::keys`])
    order: Vec<(usize, Hook)>,
    /// how many of them were handed to the writer
    handed: usize,
    to_writer: std::sync::mpsc::SyncSender<Captured>,
    written: std::sync::mpsc::Receiver<Captured>,
    failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// called with each layer when it is done (a progress bar)
    on_layer: &'a mut dyn FnMut(usize),
    /// buffers with the writer, not yet back
    in_flight: usize,
    /// how long the forward stood waiting for the writer (to take a tensor, or to finish a
    /// layer): what the disk cost beyond the computing
    waited: std::time::Duration,
}

impl Observer for StreamToFile<'_> {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        !self.failed.load(std::sync::atomic::Ordering::Relaxed) && self.cache.wants(layer, hook)
    }
    crate::delegate_observer!(cache: tensor, attention_block);
    fn pattern_rows(
        &mut self,
        layer: usize,
        q_start: usize,
        rows: usize,
        n_heads: usize,
        k_len: usize,
    ) -> Option<crate::model::capture::PatternRows<'_>> {
        if self.failed.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        self.cache
            .pattern_rows(layer, q_start, rows, n_heads, k_len)
    }
    fn attention_done(&mut self, _layer: usize) {
        // the patterns are final: they are written while the MLP runs
        self.hand_over();
    }
    fn layer_done(&mut self, layer: usize) {
        self.hand_over();
        if self.wait {
            let t = std::time::Instant::now();
            while self.in_flight > 0 {
                match self.written.recv() {
                    Ok(buf) => self.came_back(buf),
                    // the writer thread is gone (its error is reported at the end)
                    Err(_) => break,
                }
            }
            self.waited += t.elapsed();
        }
        (self.on_layer)(layer);
    }
}

/// The writer thread's ends of a [`StreamToFile`]'s channels: the tensors to write, the way
/// back for written buffers, and the flag that tells the forward the writing failed.
struct WriterEnds {
    from: std::sync::mpsc::Receiver<Captured>,
    back: std::sync::mpsc::Sender<Captured>,
    failed: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl<'a> StreamToFile<'a> {
    /// The observer filling `cache` (waiting for each layer's writing when `wait`), and the
    /// writer thread's ends of its channels.
    fn new(
        cache: AttnCache,
        order: Vec<(usize, Hook)>,
        wait: bool,
        on_layer: &'a mut dyn FnMut(usize),
    ) -> (Self, WriterEnds) {
        let failed = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (tx, rx) = std::sync::mpsc::sync_channel::<Captured>(0);
        let (back_tx, back_rx) = std::sync::mpsc::channel();
        let obs = StreamToFile {
            wait,
            cache,
            order,
            handed: 0,
            to_writer: tx,
            written: back_rx,
            failed: failed.clone(),
            on_layer,
            in_flight: 0,
            waited: std::time::Duration::ZERO,
        };
        let ends = WriterEnds {
            from: rx,
            back: back_tx,
            failed,
        };
        (obs, ends)
    }

    /// Hands the writer thread the file's next tensors, in the file's order, as long as the
    /// next one is in the cache. Called where what the cache holds is final (a layer's attention
    /// or the layer done, the forward done): the file's order is the writer's by construction;
    /// a tensor that came early waits in the cache for those declared before it.
    fn hand_over(&mut self) {
        while let Some(&key) = self.order.get(self.handed) {
            let Some(c) = self.cache.take(key.0, key.1) else {
                break;
            };
            self.handed += 1;
            while let Ok(buf) = self.written.try_recv() {
                self.came_back(buf);
            }
            // a closed channel means the writer stopped on an error, reported at the end; the
            // send waits until the writer takes the tensor
            let t = std::time::Instant::now();
            if self.to_writer.send(c).is_ok() {
                self.in_flight += 1;
            }
            self.waited += t.elapsed();
        }
    }

    fn came_back(&mut self, c: Captured) {
        self.in_flight -= 1;
        self.cache.recycle_entry(c);
    }
}

/// Where a capture's bytes go: see [`DirectFile`].
enum Out {
    Direct(DirectFile),
    Buffered(std::io::BufWriter<std::fs::File>),
}

impl Out {
    /// `tmp`'s file opened for `format`: safetensors is written front to back, so past the page
    /// cache where the file system lets it; npz through a buffer (the zip writer goes back to
    /// fill in sizes).
    fn open(tmp: &std::fs::File, format: TensorFormat) -> std::io::Result<Out> {
        Ok(match format {
            TensorFormat::Safetensors => Out::Direct(DirectFile::new(tmp.try_clone()?)),
            TensorFormat::Npz => {
                Out::Buffered(std::io::BufWriter::with_capacity(4 << 20, tmp.try_clone()?))
            }
        })
    }

    fn finish(self) -> std::io::Result<()> {
        match self {
            Out::Direct(d) => d.finish().map(drop),
            Out::Buffered(b) => b.into_inner().map(drop).map_err(|e| e.into_error()),
        }
    }
}

impl std::io::Write for Out {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        match self {
            Out::Direct(d) => d.write(data),
            Out::Buffered(b) => b.write(data),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Out::Direct(d) => d.flush(),
            Out::Buffered(b) => b.flush(),
        }
    }
}

impl std::io::Seek for Out {
    fn seek(&mut self, to: std::io::SeekFrom) -> std::io::Result<u64> {
        match self {
            Out::Direct(d) => d.seek(to),
            Out::Buffered(b) => b.seek(to),
        }
    }
}

/// The writer thread's loop: writes what arrives in order, sends each buffer back; after the
/// first error it only drains (and `failed` tells the forward to stop capturing).
fn write_layers<W: std::io::Write + std::io::Seek>(
    w: &mut TensorWriter<W>,
    from: std::sync::mpsc::Receiver<Captured>,
    back: std::sync::mpsc::Sender<Captured>,
    failed: &std::sync::atomic::AtomicBool,
) -> Option<std::io::Error> {
    let mut error = None;
    for c in from {
        if error.is_none() {
            if let Err(e) = w.write(&c.name, &c.data) {
                failed.store(true, std::sync::atomic::Ordering::Relaxed);
                error = Some(e);
            }
        }
        let _ = back.send(c);
    }
    error
}

/// The file's metadata: the tokens (ids and texts), the model, its precision, the queries and
/// heads kept, the producer, and an encoder's token types (all 0 for one text).
fn metadata(
    model: &Model,
    tokens: &[u32],
    token_types: Option<&[u32]>,
    spec: &CaptureSpec,
) -> anyhow::Result<BTreeMap<String, String>> {
    let n = tokens.len();
    let texts = model.token_texts(tokens);
    let mut md = BTreeMap::from([
        ("token_ids".to_string(), serde_json::to_string(&tokens)?),
        ("token_strings".to_string(), serde_json::to_string(&texts)?),
        ("model".to_string(), model.info.name.clone()),
        (
            "model_description".to_string(),
            model.info.description.clone().unwrap_or_default(),
        ),
        (
            "precision".to_string(),
            model.info.precision.name().to_string(),
        ),
        (
            "queries".to_string(),
            serde_json::to_string(&spec.queries.resolve(n))?,
        ),
        ("heads".to_string(), serde_json::to_string(&spec.heads)?),
        (
            "producer".to_string(),
            format!("attnscope {}", env!("CARGO_PKG_VERSION")),
        ),
    ]);
    if model.is_encoder() {
        // an encoder's token types, as the forward ran them (a pair's 0/1; one text: all 0)
        let types = token_types.map_or_else(|| vec![0; n], <[u32]>::to_vec);
        md.insert("token_types".into(), serde_json::to_string(&types)?);
    }
    Ok(md)
}

/// Runs `model` on `tokens` (an encoder's `token_types`, or `None`) and streams the tensors of
/// `plan` (from `req`) into `req.out`: written under a temporary name beside it and renamed
/// into place when complete (never over a file that appeared meanwhile, unless `force`).
/// `on_layer(layer)` after each layer.
pub fn capture(
    model: &Model,
    tokens: &[u32],
    token_types: Option<Vec<u32>>,
    req: &CaptureRequest,
    plan: CapturePlan,
    on_layer: &mut dyn FnMut(usize),
) -> anyhow::Result<CaptureReport> {
    let start = std::time::Instant::now();
    let CapturePlan {
        spec,
        format,
        order,
        n,
    } = plan;
    assert_eq!(n, tokens.len(), "the plan is for these tokens");
    let out = &req.out;
    let md = metadata(model, tokens, token_types.as_deref(), &spec)?;
    let output = req.output()?;
    let needed = file_bytes_bound(&order, &md);
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    check_room(out, needed, free_bytes(dir))?;
    let tmp = output.temp("capture")?;
    let file = Out::open(tmp.as_file(), format)?;
    let n_tensors = order.len();
    let mut writer = TensorWriter::with_data_phase(file, format, order, &md, HEAP_PHASE)
        .with_context(|| format!("writing {}", out.display()))?;
    let on_layer = &mut |layer: usize| {
        on_layer(layer);
        stall_for_tests(layer);
    };
    let cache = AttnCache::new(&spec, n);
    let (obs, ends) = StreamToFile::new(cache, spec.keys(&model.dims), !req.two_layers, on_layer);
    let (forward, write_error) = stream_forward(model, tokens, token_types, obs, &mut writer, ends);
    let waited = forward?;
    if let Some(e) = write_error {
        return Err(anyhow::Error::new(e).context(format!("writing {}", out.display())));
    }
    finish_file(writer, format, tokens, out)?;
    let size = tmp.as_file().metadata()?.len();
    output.persist(tmp)?;
    Ok(CaptureReport {
        path: out.clone(),
        tensors: n_tensors,
        bytes: size,
        n_tokens: n,
        model: model.info.name.clone(),
        precision: model.info.precision.name().into(),
        seconds: start.elapsed().as_secs_f64(),
        waited_s: waited.as_secs_f64(),
    })
}

/// The most bytes the file of `order`'s tensors (f32) and `md` takes, headers included:
/// each tensor's data, its entry (a safetensors header's line; an npz's local and central zip
/// records with their zip64 fields, and its `.npy` header: under 512 bytes with the name twice),
/// the metadata, and 64 KiB for the rest.
fn file_bytes_bound(order: &[(String, Vec<usize>)], md: &BTreeMap<String, String>) -> u64 {
    let data: u64 = order
        .iter()
        .map(|(name, s)| 4 * s.iter().product::<usize>() as u64 + 512 + 2 * name.len() as u64)
        .sum();
    let md: u64 = md
        .iter()
        .map(|(k, v)| 16 + k.len() as u64 + 2 * v.len() as u64)
        .sum();
    data + md + (64 << 10)
}

/// The free bytes of the file system holding `dir` ([`crate::model::panels::free_bytes`]);
/// tests set them with `ATTNSCOPE_FAULT=capture-free=N` (a full disk is not made without root).
fn free_bytes(dir: &Path) -> Option<u64> {
    let fault = std::env::var("ATTNSCOPE_FAULT").ok();
    match fault
        .as_deref()
        .and_then(|f| f.strip_prefix("capture-free="))
    {
        Some(n) => n.parse().ok(),
        None => crate::model::panels::free_bytes(dir),
    }
}

/// Refuses a capture of `needed` bytes into `out` whose file system has `free` bytes left
/// (`None`: unknown, let the writing find out), before anything is written: a full disk
/// stopped it part way after the forward's time (its temporary file removed).
fn check_room(out: &Path, needed: u64, free: Option<u64>) -> anyhow::Result<()> {
    match free {
        Some(free) if free < needed => Err(usage(format!(
            "capture writes up to {} to {}, but its file system has {} free; free some space, write elsewhere (--out), or capture less (--hooks, --layers, --heads, --queries)",
            size_words(needed),
            out.display(),
            size_words(free)
        ))),
        _ => Ok(()),
    }
}

/// `b` bytes as "12.3 MB (12,345,678 bytes)".
fn size_words(b: u64) -> String {
    let digits = b.to_string();
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(c);
    }
    format!("{:.1} MB ({grouped} bytes)", b as f64 / 1e6)
}

/// Tests only: with `ATTNSCOPE_FAULT=capture-stall`, a capture waits a minute once its first
/// layer is handed to the writer (its temporary file exists and holds data), so a test can
/// interrupt it there deterministically (`tests/cli_files.rs`).
fn stall_for_tests(layer: usize) {
    if layer == 0 && std::env::var("ATTNSCOPE_FAULT").as_deref() == Ok("capture-stall") {
        std::thread::sleep(std::time::Duration::from_secs(60));
    }
}

/// The forward of `model` on `tokens` into `obs`, whose tensors a writer thread (on `ends`)
/// writes to `writer` as they come: how long the forward waited for the disk (or its error),
/// and the writer's first error.
fn stream_forward(
    model: &Model,
    tokens: &[u32],
    token_types: Option<Vec<u32>>,
    mut obs: StreamToFile<'_>,
    writer: &mut TensorWriter<Out>,
    ends: WriterEnds,
) -> (
    crate::model::Result<std::time::Duration>,
    Option<std::io::Error>,
) {
    std::thread::scope(|s| {
        let writing = s.spawn(move || write_layers(writer, ends.from, ends.back, &ends.failed));
        let opts = RunOptions {
            token_types,
            ..Default::default()
        };
        let forward = model.forward(tokens, &opts, &mut obs);
        // the final norm's hooks come after the last layer
        obs.hand_over();
        let waited = obs.waited;
        // closing the channel ends the writer's loop
        drop(obs);
        (
            forward.map(|_| waited),
            writing.join().expect("the writer thread does not panic"),
        )
    })
}

/// Completes the file `out` once every captured tensor is written: an npz's `token_ids`
/// (`tokens`), then the format's closing bytes, and the buffered rest on the disk.
fn finish_file(
    mut w: TensorWriter<Out>,
    format: TensorFormat,
    tokens: &[u32],
    out: &Path,
) -> anyhow::Result<()> {
    if format == TensorFormat::Npz {
        let ids: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        w.write("token_ids", &ids)?;
    }
    w.finish()
        .and_then(Out::finish)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::capture::{hook_name, PatternRows};

    /// The room check with the free space given: refused below the bytes needed, naming both;
    /// let through at or above them, or where the free space cannot be read.
    #[test]
    fn a_capture_past_the_free_space_is_refused_naming_both_sizes() {
        let out = Path::new("/some/dir/run.npz");
        let e = check_room(out, 2_345_678, Some(1_000_000)).unwrap_err();
        let e = format!("{e:#}");
        assert!(
            e.contains("2.3 MB (2,345,678 bytes)")
                && e.contains("1.0 MB (1,000,000 bytes) free")
                && e.contains("run.npz"),
            "{e}"
        );
        assert!(crate::analysis::request::is_bad_input(
            &check_room(out, 10, Some(9)).unwrap_err()
        ));
        check_room(out, 10, Some(10)).unwrap();
        check_room(out, u64::MAX, None).unwrap();
        assert_eq!(size_words(999), "0.0 MB (999 bytes)");
    }
    use crate::model::config::Arch;
    use crate::model::tiny::{tiny_model, write_gguf};
    use crate::model::{Model, Precision};

    /// The capture observer, watched from outside: what it holds when a layer's attention
    /// begins, and whether its patterns are gone before the layer's MLP.
    struct Watch<'a> {
        inner: StreamToFile<'a>,
        /// per layer, the tensors still with the writer when its attention asked for rows
        in_flight_at_attention: Vec<usize>,
        /// per layer, whether its pattern was handed over before `layer_done`
        pattern_gone_before_mlp_end: Vec<bool>,
    }

    impl Observer for Watch<'_> {
        crate::delegate_observer!(inner: wants, tensor, attention_block, attention_done);
        fn pattern_rows(
            &mut self,
            layer: usize,
            q_start: usize,
            rows: usize,
            n_heads: usize,
            k_len: usize,
        ) -> Option<PatternRows<'_>> {
            if q_start == 0 {
                self.in_flight_at_attention.push(self.inner.in_flight);
                assert_eq!(self.in_flight_at_attention.len(), layer + 1);
            }
            self.inner
                .pattern_rows(layer, q_start, rows, n_heads, k_len)
        }
        fn layer_done(&mut self, layer: usize) {
            self.pattern_gone_before_mlp_end.push(
                !self
                    .inner
                    .cache
                    .entries
                    .contains_key(&(layer, Hook::Pattern)),
            );
            self.inner.layer_done(layer)
        }
    }

    /// Runs a capture of patterns and `resid_post` on a tiny model through a writer that takes
    /// 30 ms a tensor (a slow disk): what the observer held at each layer's attention, the
    /// tensors in the order they were written, and how long the forward waited for the writer.
    fn watch(wait: bool) -> (Vec<usize>, Vec<bool>, Vec<String>, std::time::Duration) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.gguf");
        write_gguf(
            &tiny_model(Arch::Qwen2, 3),
            Arch::Qwen2,
            candle_core::quantized::GgmlDType::F32,
            &path,
        )
        .unwrap();
        let model = Model::load(path.to_str().unwrap(), Precision::Exact, false).unwrap();
        let tokens = model.encode("the hat sat on the mat", false).unwrap();
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::ResidPost],
            layers: None,
            heads: None,
            queries: Queries::All,
        };
        let mut tick = |_: usize| {};
        let cache = AttnCache::new(&spec, tokens.len());
        let (inner, ends) = StreamToFile::new(cache, spec.keys(&model.dims), wait, &mut tick);
        let WriterEnds {
            from: rx,
            back: back_tx,
            ..
        } = ends;
        std::thread::scope(|s| {
            let writer = s.spawn(move || {
                let mut names = Vec::new();
                for c in rx {
                    std::thread::sleep(std::time::Duration::from_millis(30));
                    names.push(c.name.clone());
                    let _ = back_tx.send(c);
                }
                names
            });
            let mut obs = Watch {
                inner,
                in_flight_at_attention: Vec::new(),
                pattern_gone_before_mlp_end: Vec::new(),
            };
            model
                .forward(&tokens, &RunOptions::default(), &mut obs)
                .unwrap();
            let (held, gone) = (obs.in_flight_at_attention, obs.pattern_gone_before_mlp_end);
            let waited = obs.inner.waited;
            drop(obs.inner);
            (held, gone, writer.join().unwrap(), waited)
        })
    }

    #[test]
    fn each_layer_waits_for_its_writing_and_its_patterns_leave_before_its_mlp() {
        let (held, gone, names, waited) = watch(true);
        let layers = held.len();
        // every layer waited for its last tensor's 30 ms at least (the tiny model computes a
        // layer in far less), and the capture says so
        assert!(
            waited >= std::time::Duration::from_millis(30 * layers as u64),
            "waited {waited:?} over {layers} layers"
        );
        assert!(layers >= 2, "the tiny model has {layers} layers");
        // nothing of an earlier layer is in memory when a layer's attention starts
        assert_eq!(held, vec![0; layers]);
        assert_eq!(gone, vec![true; layers]);
        // in file order: each layer's pattern, then its residual stream
        let want: Vec<String> = (0..layers)
            .flat_map(|l| [hook_name(l, Hook::Pattern), hook_name(l, Hook::ResidPost)])
            .collect();
        assert_eq!(names, want);
        // `--two-layers`: the slow writer is still on a layer when the next one's attention starts
        let (held, gone, names, _) = watch(false);
        assert!(held[1..].iter().any(|&h| h > 0), "{held:?}");
        assert_eq!(gone, vec![true; layers]);
        assert_eq!(names, want);
    }
}
