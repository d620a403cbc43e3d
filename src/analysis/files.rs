//! The files attnscope reads and writes for its user, under one rule each.
//!
//! A text is read with a bound ([`ReadLimit`], [`read_text_file`], [`read_lines_file`]): one
//! text at most what its model may take ([`crate::model::Model::max_text_bytes`]: 64 bytes a
//! token for the whole context, plus 64 KiB), each line of a file of texts as much, the file at
//! most [`MAX_LINES_BYTES`]. The readers stop at the bound (exit 2, naming it and the context):
//! `--file /dev/zero` grew to 5.8 GB in 12 s, and a 10 MB text took 2.7 GB to be told it was
//! too long, before there was one.
//!
//! Every file written goes through [`Output`] (`corpus --out`, which appends to its own record
//! file, checks its path here too; renderers reach it as `crate::render::Output`):
//!
//! - An existing file is never replaced unless asked (`--force`, Python's `force=` /
//!   `overwrite=`): exit 2, naming the path and `--force` ([`Error::Exists`]).
//! - An input of the command (its `--file`, the model's file) is never written over, even with
//!   `--force` (the same file by device and inode, whatever path reaches it).
//! - The path is checked before the work: a folder that is missing or not writable is refused
//!   (exit 2) before the model is loaded, not after a run.
//! - The bytes go to a temporary file in the same folder, renamed over the path only when
//!   complete (never over a file that appeared meanwhile, unless forced), so a reader never sees
//!   half a file. The temporary file is removed on every error path (its guard's drop), and, in
//!   the executable, on Ctrl-C and SIGTERM ([`remove_temp_files_on_signal`]); its name carries
//!   the writer's process id (`.attnscope-capture-<pid>-XXXXXX`), so a later run removes the
//!   ones a process that is gone left ([`remove_stale_temp_files`]: a `kill -9`, a power cut).

use super::request::usage;
use crate::model::{text_bytes_bound, Error, Model, TEXT_BYTES_PER_TOKEN};
use anyhow::Context;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// The longest context a text may be read for before a model is loaded (`corpus --file`,
/// `compare --file`, Python's `corpus_texts`): the longest of the families attnscope runs
/// (Llama 3's and Qwen2.5's 131,072 tokens). The model then checks each text against its own.
pub const ANY_MODEL_CONTEXT: usize = 131_072;
/// The most bytes of a file of texts, one a line (256 MiB: more texts than a corpus run gets
/// through in days).
pub const MAX_LINES_BYTES: usize = 256 << 20;
/// The most lines of a file of texts (a million: a `yes`-like file of one-byte lines would
/// otherwise hold 40 bytes of bookkeeping a byte).
pub const MAX_LINES: usize = 1_000_000;

/// How much a reader may read, and why, for the refusal.
#[derive(Clone, Debug)]
pub struct ReadLimit {
    pub bytes: usize,
    /// "64 bytes a token for qwen2.5-coder-0.5b's context of 32768 tokens, plus 64 KiB"
    pub why: String,
}

impl ReadLimit {
    /// One text for `model`: [`Model::max_text_bytes`].
    pub fn text_of(model: &Model) -> ReadLimit {
        ReadLimit::for_context(model.dims.context_len, &format!("{}'s", model.info.name))
    }

    /// One text for a context of `context` tokens (`whose`: "qwen2.5-coder-0.5b's", "a").
    pub fn for_context(context: usize, whose: &str) -> ReadLimit {
        ReadLimit {
            bytes: text_bytes_bound(context),
            why: format!(
                "{TEXT_BYTES_PER_TOKEN} bytes a token for {whose} context of {context} tokens, plus 64 KiB"
            ),
        }
    }

    /// One text before the model is known: [`ANY_MODEL_CONTEXT`].
    pub fn any_model() -> ReadLimit {
        ReadLimit::for_context(ANY_MODEL_CONTEXT, "the longest")
    }

    fn refuse(&self, what: &str) -> anyhow::Error {
        usage(format!(
            "{what} is longer than {} bytes, the most a text may take ({}); attnscope stopped reading there: give a shorter text",
            self.bytes, self.why
        ))
    }
}

/// All of `r` (named `what` in messages) up to `limit`: reading stops one byte past it, and
/// then the text is refused (exit 2), so an endless input costs `limit` bytes and no more.
pub fn read_bounded(r: impl Read, what: &str, limit: &ReadLimit) -> anyhow::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(limit.bytes as u64 + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading {what}"))?;
    if buf.len() > limit.bytes {
        return Err(limit.refuse(what));
    }
    Ok(buf)
}

/// Opens `path` (`-`: standard input) for reading, with its name for messages.
fn open_input(path: &Path) -> anyhow::Result<(Box<dyn Read>, String)> {
    if path.as_os_str() == "-" {
        return Ok((Box::new(std::io::stdin().lock()), "standard input".into()));
    }
    let f = std::fs::File::open(path)
        .map_err(|e| usage(format!("cannot read --file {}: {e}", path.display())))?;
    Ok((Box::new(f), format!("--file {}", path.display())))
}

/// `bytes` as UTF-8, or a refusal (exit 2) naming `what` and the first bad byte.
fn utf8(bytes: Vec<u8>, what: &str) -> anyhow::Result<String> {
    String::from_utf8(bytes).map_err(|e| {
        usage(format!(
            "{what} is not valid UTF-8 (first bad byte at offset {}); convert it to UTF-8",
            e.utf8_error().valid_up_to()
        ))
    })
}

/// The text of the file `path` (`-`: standard input), read up to `limit` ([`read_bounded`])
/// and refused (exit 2) when it cannot be read or is not UTF-8.
pub fn read_text_file(path: &Path, limit: &ReadLimit) -> anyhow::Result<String> {
    let (r, what) = open_input(path)?;
    utf8(read_bounded(r, &what, limit)?, &what)
}

/// Standard input's text, read up to `limit` ([`read_bounded`]).
pub fn read_stdin(limit: &ReadLimit) -> anyhow::Result<String> {
    let what = "standard input";
    utf8(read_bounded(std::io::stdin().lock(), what, limit)?, what)
}

/// The first `limit` bytes of the file `path` (`-`: standard input) and one more when there are
/// more (a character cut there dropped), for a reader that keeps a prefix (`sinks`: the first
/// `--max-tokens` tokens of a long text).
pub fn read_text_prefix(path: &Path, limit: usize) -> anyhow::Result<String> {
    let (r, what) = open_input(path)?;
    let mut buf = Vec::new();
    r.take(limit as u64 + 1)
        .read_to_end(&mut buf)
        .with_context(|| format!("reading {what}"))?;
    if let Err(e) = std::str::from_utf8(&buf) {
        if e.error_len().is_none() && buf.len() > limit {
            // a character cut by the bound: not the file's fault
            buf.truncate(e.valid_up_to());
        }
    }
    utf8(buf, &what)
}

/// A file of texts, one a line (`corpus --file`, `embed --file`, `heads --each-line`; `-`:
/// standard input): each line at most `line`'s bound, the file at most [`MAX_LINES_BYTES`] and
/// [`MAX_LINES`] lines. Reading stops at the first line past its bound (exit 2, naming its
/// number).
pub fn read_lines_file(path: &Path, line: &ReadLimit) -> anyhow::Result<String> {
    let (mut r, what) = open_input(path)?;
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    let (mut line_len, mut lines) = (0usize, 1usize);
    loop {
        let n = match r.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("reading {what}")),
        };
        for &b in &chunk[..n] {
            if b == b'\n' {
                (line_len, lines) = (0, lines + 1);
            } else {
                line_len += 1;
            }
            if line_len > line.bytes {
                return Err(line.refuse(&format!("line {lines} of {what}")));
            }
        }
        if lines > MAX_LINES || buf.len() + n > MAX_LINES_BYTES {
            return Err(usage(format!(
                "{what} holds more than {MAX_LINES} lines or {} MiB, the most a file of texts may; split it (corpus --shard runs a part at a time)",
                MAX_LINES_BYTES >> 20
            )));
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    utf8(buf, &what)
}

/// A file a command will write, checked ([`Output::check`]) before the command's work.
#[derive(Clone, Debug)]
pub struct Output {
    pub path: PathBuf,
    force: bool,
    /// The inputs it must never replace, with their (device, inode).
    inputs: Vec<(PathBuf, (u64, u64))>,
}

/// The (device, inode) of the file at `path` (following links), if there is one.
fn file_id(path: &Path) -> Option<(u64, u64)> {
    let md = std::fs::metadata(path).ok()?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        Some((md.dev(), md.ino()))
    }
    #[cfg(not(unix))]
    {
        let _ = md;
        None
    }
}

/// The folder `path` is written in (`.` for a bare name).
fn folder_of(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

impl Output {
    /// Checks that `path` can be written now, before any work: not a folder, in a folder that
    /// exists and takes a new file, not one of `inputs` (never, even with `force`), and not an
    /// existing file unless `force` ([`Error::Exists`]). Every refusal is a bad request (exit 2).
    /// Stale temporary files of dead writers in the folder are removed on the way.
    pub fn check(path: &Path, force: bool, inputs: &[&Path]) -> anyhow::Result<Output> {
        let out = Output::check_append(path, inputs)?;
        if path.exists() && !force {
            return Err(anyhow::Error::new(Error::Exists { path: path.into() }));
        }
        Ok(Output { force, ..out })
    }

    /// Checks a file a run appends to (`corpus --out`, which resumes from the records it
    /// holds): it may exist, but it is not a folder, never one of `inputs`, and its folder
    /// exists and takes new files. (As an [`Output`], it replaces an existing file.)
    pub fn check_append(path: &Path, inputs: &[&Path]) -> anyhow::Result<Output> {
        let out = Output {
            path: path.to_path_buf(),
            force: true,
            inputs: inputs
                .iter()
                .filter_map(|p| Some((p.to_path_buf(), file_id(p)?)))
                .collect(),
        };
        if path.is_dir() {
            return Err(usage(format!(
                "{} is a folder; give the path of a file to write",
                path.display()
            )));
        }
        out.check_not_an_input()?;
        let dir = folder_of(path);
        if !dir.is_dir() {
            return Err(usage(format!(
                "cannot write {}: the folder {} does not exist",
                path.display(),
                dir.display()
            )));
        }
        remove_stale_temp_files(dir);
        // the one sure test that the folder takes a new file: make one (removed at once)
        tempfile::Builder::new()
            .prefix(".attnscope-check-")
            .tempfile_in(dir)
            .map_err(|e| usage(format!("cannot write {}: {e}", path.display())))?;
        Ok(out)
    }

    /// Refuses a path that is one of the inputs (by device and inode: any path to it).
    fn check_not_an_input(&self) -> anyhow::Result<()> {
        let Some(id) = file_id(&self.path) else {
            return Ok(());
        };
        if let Some((input, _)) = self.inputs.iter().find(|(_, i)| *i == id) {
            let same = if *input == self.path {
                String::new()
            } else {
                format!(" (the same file as {})", input.display())
            };
            return Err(usage(format!(
                "{}{same} is an input of this command; write the output to another path (--force never replaces an input)",
                self.path.display(),
            )));
        }
        Ok(())
    }

    /// Writes `bytes` through a temporary file beside the path, renamed into place.
    pub fn write(&self, bytes: &[u8]) -> anyhow::Result<()> {
        let mut tmp = self.temp("write")?;
        let written = tmp
            .file()
            .write_all(bytes)
            .and_then(|()| tmp.file().sync_all());
        written.with_context(|| format!("writing {}", self.path.display()))?;
        self.persist(tmp)
    }

    /// A temporary file beside the path (`.attnscope-<what>-<pid>-XXXXXX`, mode 0666 less the
    /// umask on unix), for a writer that streams; [`Output::persist`] puts it in place, and
    /// dropping it removes it.
    pub fn temp(&self, what: &str) -> anyhow::Result<TempOut> {
        let dir = folder_of(&self.path);
        let mut builder = tempfile::Builder::new();
        let prefix = format!(".attnscope-{what}-{}-", std::process::id());
        builder.prefix(&prefix);
        #[cfg(unix)]
        {
            // the mode of an ordinary new file (0666 less the umask), not a temporary file's 0600
            use std::os::unix::fs::PermissionsExt;
            builder.permissions(std::fs::Permissions::from_mode(0o666));
        }
        let file = builder
            .tempfile_in(dir)
            .with_context(|| format!("creating a temporary file in {}", dir.display()))?;
        let slot = signals::register(file.path());
        Ok(TempOut {
            file: Some(file),
            slot,
        })
    }

    /// Renames the complete `tmp` to the path: over an existing file only when forced (and
    /// never over an input), else never over a file that appeared meanwhile.
    pub fn persist(&self, mut tmp: TempOut) -> anyhow::Result<()> {
        self.check_not_an_input()?;
        let file = tmp.file.take().expect("a temporary file not yet persisted");
        let renamed = if self.force {
            file.persist(&self.path).map(drop)
        } else {
            file.persist_noclobber(&self.path).map(drop)
        };
        // the rename came first: a signal now finds the temporary name gone, never the output
        drop(tmp);
        renamed.map_err(|e| {
            if e.error.kind() == std::io::ErrorKind::AlreadyExists {
                anyhow::Error::new(Error::Exists {
                    path: self.path.clone(),
                })
            } else {
                anyhow::Error::new(e.error)
                    .context(format!("renaming into {}", self.path.display()))
            }
        })
    }
}

/// A temporary file being written ([`Output::temp`]): removed when dropped unless persisted,
/// and named to the executable's signal handler meanwhile.
pub struct TempOut {
    file: Option<tempfile::NamedTempFile>,
    slot: Option<usize>,
}

impl TempOut {
    /// The open file.
    pub fn file(&mut self) -> &mut std::fs::File {
        self.file.as_mut().expect("not persisted").as_file_mut()
    }

    /// The temporary file's own handle (to clone for a writer thread).
    pub fn as_file(&self) -> &std::fs::File {
        self.file.as_ref().expect("not persisted").as_file()
    }

    /// Its (temporary) path.
    pub fn path(&self) -> &Path {
        self.file.as_ref().expect("not persisted").path()
    }
}

impl Drop for TempOut {
    fn drop(&mut self) {
        if let Some(slot) = self.slot.take() {
            signals::unregister(slot);
        }
        // `file`, if still here, removes itself as it drops
    }
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so a
/// reader never sees half a file; refuses to replace an existing file unless `force`
/// ([`Output::check`] with no inputs, then [`Output::write`]).
pub fn write_new_file(path: &Path, bytes: &[u8], force: bool) -> anyhow::Result<()> {
    Output::check(path, force, &[])?.write(bytes)
}

/// The process id in a temporary file's name of ours (`.attnscope-<what>-<pid>-XXXXXX`).
fn temp_owner(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(".attnscope-")?;
    let (what, rest) = rest.split_once('-')?;
    if !["capture", "write"].contains(&what) {
        return None;
    }
    let (pid, tail) = rest.split_once('-')?;
    (tail.len() == 6 && tail.chars().all(|c| c.is_ascii_alphanumeric()))
        .then(|| pid.parse().ok())
        .flatten()
}

/// Removes the temporary files of ours in `dir` whose writer process is gone (no `/proc/<pid>`):
/// what a killed run left. A live process's files, and any other file, are left alone. The
/// files removed.
pub fn remove_stale_temp_files(dir: &Path) -> Vec<PathBuf> {
    let mut removed = Vec::new();
    if !Path::new("/proc/self").exists() {
        // no way to tell a live writer from a dead one here
        return removed;
    }
    for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = temp_owner(&name) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() && std::fs::remove_file(e.path()).is_ok() {
            removed.push(e.path());
        }
    }
    removed
}

/// Removes the temporary files being written when the process gets SIGINT (Ctrl-C), SIGTERM or
/// SIGHUP, then dies of the signal as it would have. For the executable only: a library user
/// (Python) keeps its own handlers, and its interrupted run drops the file, which removes it.
pub fn remove_temp_files_on_signal() {
    signals::install();
}

/// The temporary files a signal handler must remove: a few slots of paths as C strings, taken
/// by whoever swaps them out first (the handler, or the file's guard when it drops), so the
/// handler never reads a freed string.
#[cfg(unix)]
mod signals {
    use std::ffi::{c_char, CString};
    use std::path::Path;
    use std::ptr::null_mut;
    use std::sync::atomic::{AtomicPtr, Ordering};

    const SLOTS: usize = 16;
    #[allow(clippy::declare_interior_mutable_const)]
    const EMPTY: AtomicPtr<c_char> = AtomicPtr::new(null_mut());
    static PATHS: [AtomicPtr<c_char>; SLOTS] = [EMPTY; SLOTS];

    /// Names `path` to the handler; its slot (`None` when every slot is taken: the file is then
    /// left to [`super::remove_stale_temp_files`]).
    pub fn register(path: &Path) -> Option<usize> {
        use std::os::unix::ffi::OsStrExt;
        let c = CString::new(path.as_os_str().as_bytes()).ok()?.into_raw();
        for (i, slot) in PATHS.iter().enumerate() {
            if slot
                .compare_exchange(null_mut(), c, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                return Some(i);
            }
        }
        // SAFETY: `c` came from `CString::into_raw` above and was never shared
        drop(unsafe { CString::from_raw(c) });
        None
    }

    /// Takes the path out of `slot` again (the handler may have taken it already).
    pub fn unregister(slot: usize) {
        let c = PATHS[slot].swap(null_mut(), Ordering::AcqRel);
        if !c.is_null() {
            // SAFETY: only `register` puts pointers from `CString::into_raw` in the slots, and
            // the swap made this the only owner
            drop(unsafe { CString::from_raw(c) });
        }
    }

    extern "C" fn on_signal(sig: libc::c_int) {
        for slot in &PATHS {
            let c = slot.swap(null_mut(), Ordering::AcqRel);
            if !c.is_null() {
                // SAFETY: a NUL-terminated path no one else frees now (the swap took it);
                // unlink is async-signal-safe. The string is leaked: the process is ending.
                unsafe { libc::unlink(c) };
            }
        }
        // SAFETY: back to the default action and the same signal again: the process ends as
        // the signal would have ended it (a shell sees 130 for Ctrl-C)
        unsafe {
            libc::signal(sig, libc::SIG_DFL);
            libc::raise(sig);
        }
    }

    pub fn install() {
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: a handler that only unlinks, resets and raises (async-signal-safe calls)
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
                libc::sigemptyset(&mut action.sa_mask);
                libc::sigaction(sig, &action, std::ptr::null_mut());
            }
        }
    }
}

/// Elsewhere no handler: an interrupted run leaves its temporary file to the next run.
#[cfg(not(unix))]
mod signals {
    pub fn register(_: &std::path::Path) -> Option<usize> {
        None
    }
    pub fn unregister(_: usize) {}
    pub fn install() {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn write_new_file_refuses_to_overwrite() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("a.bin");
        write_new_file(&p, b"one", false).unwrap();
        let e = write_new_file(&p, b"two", false).unwrap_err();
        assert!(format!("{e:#}").contains("--force"));
        assert!(crate::analysis::request::is_bad_input(&e));
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        write_new_file(&p, b"two", true).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary file left behind"
        );
    }

    #[test]
    fn an_input_is_never_written_over_and_a_missing_folder_is_refused_first() {
        let d = tempfile::tempdir().unwrap();
        let input = d.path().join("in.txt");
        std::fs::write(&input, "a text").unwrap();
        let link = d.path().join("link.txt");
        std::fs::hard_link(&input, &link).unwrap();
        for force in [false, true] {
            let e = Output::check(&link, force, &[&input]).unwrap_err();
            assert!(crate::analysis::request::is_bad_input(&e));
            assert!(format!("{e:#}").contains("an input"), "{e:#}");
        }
        assert_eq!(std::fs::read_to_string(&input).unwrap(), "a text");
        let e = Output::check(&d.path().join("no/such/out.html"), false, &[]).unwrap_err();
        assert!(crate::analysis::request::is_bad_input(&e));
        assert!(format!("{e:#}").contains("does not exist"), "{e:#}");
        let e = Output::check(d.path(), true, &[]).unwrap_err();
        assert!(format!("{e:#}").contains("is a folder"), "{e:#}");
    }

    #[test]
    fn stale_temporary_files_of_dead_writers_go_and_live_ones_stay() {
        let d = tempfile::tempdir().unwrap();
        // a pid no process has (past the kernel's pid_max)
        let dead = d.path().join(".attnscope-capture-999999999-abcDEF");
        let live = d
            .path()
            .join(format!(".attnscope-capture-{}-abcDEF", std::process::id()));
        let other = d.path().join(".attnscope-capture-notours");
        for p in [&dead, &live, &other] {
            std::fs::write(p, "x").unwrap();
        }
        assert_eq!(remove_stale_temp_files(d.path()), vec![dead.clone()]);
        assert!(!dead.exists() && live.exists() && other.exists());
    }

    #[test]
    fn a_dropped_temporary_file_is_removed_and_its_slot_freed() {
        let d = tempfile::tempdir().unwrap();
        let out = Output::check(&d.path().join("x.bin"), false, &[]).unwrap();
        for _ in 0..40 {
            // more than the slots: each drop gives its slot back
            let t = out.temp("write").unwrap();
            assert!(t.slot.is_some());
            let p = t.path().to_path_buf();
            assert!(p.exists());
            drop(t);
            assert!(!p.exists());
        }
    }
}
