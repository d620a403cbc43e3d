//! The one error type of the library. Each message names the thing that is wrong and, where
//! there is one, what to do about it.

use std::path::PathBuf;

/// The library's error: what went wrong loading or running a model, each variant naming the cause
/// and what to do (the CLI prints it and exits 2).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The model named is neither a file nor an alias.
    #[error("model file {path} does not exist; pass a .gguf file, a Hugging Face folder, a hub id (org/name) or one of the aliases: {aliases}")]
    MissingModel { path: PathBuf, aliases: String },
    /// The path is not a model file (a folder without a model, a device, ...).
    #[error("{path} is {kind}, not a model file; pass a .gguf file, a Hugging Face folder, a hub id (org/name) or one of the aliases")]
    NotAModelFile { path: PathBuf, kind: &'static str },
    /// A folder without `config.json`.
    #[error("{path} is a folder but has no config.json; a Hugging Face model folder needs config.json, *.safetensors and tokenizer.json")]
    NoConfig { path: PathBuf },
    /// A file that is neither GGUF nor safetensors.
    #[error("{path} is not a GGUF or safetensors model (first bytes {magic:02x?}); pass a .gguf file or a Hugging Face folder")]
    WrongMagic { path: PathBuf, magic: Vec<u8> },
    /// A GGUF file that cannot be read.
    #[error(
        "cannot read GGUF file {path}: {reason}; the file is corrupt or truncated, fetch it again"
    )]
    BadGguf { path: PathBuf, reason: String },
    /// A GGUF version attnscope does not read.
    #[error("unsupported GGUF version {version} in {path}; attnscope reads GGUF versions 2 and 3")]
    GgufVersion { path: PathBuf, version: u32 },
    /// A safetensors file that cannot be read.
    #[error("cannot read safetensors {path}: {reason}; the file is corrupt or truncated, fetch it again")]
    BadSafetensors { path: PathBuf, reason: String },
    /// An architecture attnscope does not run.
    #[error("unsupported architecture `{arch}` in {path}; attnscope supports: {supported}")]
    UnknownArch {
        arch: String,
        path: PathBuf,
        /// The families attnscope runs, as `family::supported_sentence` names them (made by
        /// `Error::unknown_arch`).
        supported: String,
    },
    /// A metadata key the architecture needs is missing.
    #[error("metadata key `{key}` missing in {path}; expected a {arch} checkpoint")]
    MissingKey {
        key: String,
        path: PathBuf,
        arch: String,
    },
    /// A setting that changes the numbers and that attnscope does not implement.
    #[error("{path} sets `{key}` = {value}, which changes the numbers and which attnscope does not implement{reason}; it refuses the model rather than print attention that ignores it")]
    Unsupported {
        key: String,
        value: String,
        path: PathBuf,
        /// What attnscope does implement, starting with "; " (or empty).
        reason: String,
    },
    /// A tensor the forward would not use (running without it would be wrong).
    #[error("{path} holds tensor `{name}`{more}, which attnscope's {arch} forward does not use; running without it would give silently wrong numbers, so the model is refused")]
    UnusedTensor {
        name: String,
        more: String,
        path: PathBuf,
        arch: String,
    },
    /// A metadata value attnscope cannot use.
    #[error("bad value for `{key}` in {path}: {reason}")]
    BadValue {
        key: String,
        path: PathBuf,
        reason: String,
    },
    /// A tensor the architecture needs is missing.
    #[error("tensor `{name}` not found in {path}; expected a {arch} checkpoint ({found} tensors present)")]
    MissingTensor {
        name: String,
        path: PathBuf,
        arch: String,
        found: usize,
    },
    /// A tensor's shape does not match the config.
    #[error("tensor `{name}` in {path} has shape {got:?}, but the config implies {want:?}; the file does not match its config")]
    ShapeMismatch {
        name: String,
        path: PathBuf,
        got: Vec<usize>,
        want: Vec<usize>,
    },
    /// A pre-tokenizer attnscope does not know.
    #[error("unknown pre-tokenizer `{pre}` in {path}; attnscope knows: {known}")]
    UnknownPreTokenizer {
        pre: String,
        path: PathBuf,
        known: String,
    },
    /// The tokenizer failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The text is empty.
    #[error("the text is empty (or only whitespace); give some text with --text, --file or standard input")]
    EmptyText,
    /// The text has more tokens than the model's context.
    #[error("the text is {n_tokens} tokens long, but {model} has a context of {limit} tokens; shorten the text")]
    TooLong {
        n_tokens: usize,
        limit: usize,
        model: String,
    },
    /// The text has more bytes than the model's context could take.
    #[error("the text is {bytes} bytes, more than the {limit} a text for {model} may take ({per_token} bytes a token, generously, for its context of {context} tokens, plus 64 KiB); shorten the text")]
    TextTooLarge {
        bytes: usize,
        limit: usize,
        per_token: usize,
        context: usize,
        model: String,
    },
    /// A value out of its range (a layer, a head, a position, ...).
    #[error("{what} {value} is out of range; valid: {range}")]
    OutOfRange {
        what: String,
        value: String,
        range: String,
    },
    /// Fetching a model failed.
    #[error("{0}")]
    Fetch(String),
    /// The output file exists (and `--force` was not given).
    #[error("{path} already exists; pass --force to overwrite it")]
    Exists { path: PathBuf },
    /// An I/O error on a path.
    #[error("I/O error on {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A third-party file reader panicked on the file.
    #[error("cannot read model {path}: the file reader failed ({msg}); the file is corrupt or truncated, fetch it again")]
    LoaderPanic { path: PathBuf, msg: String },
    /// A NaN or an infinity the model's own numbers made (corrupt weights, or an f32 overflow):
    /// the model is the bad input (exit 2), not attnscope.
    #[error("a non-finite value (NaN or infinity) turned up in {what}{}: the model's weights hold a NaN or an infinity, or its numbers overflow f32, so nothing is printed; fetch the model again or use another", layer.map(|l| format!(" at layer {l}")).unwrap_or_default())]
    NonFinite { what: String, layer: Option<usize> },
    /// An analysis that does not apply to this model (why, and what to use instead).
    #[error("{0}")]
    NotApplicable(String),
    /// An observer's hook refused what it was handed.
    #[error("the hook at {name} {msg}")]
    Hook { name: String, msg: String },
    /// The run was interrupted (Python's Ctrl-C).
    #[error("interrupted")]
    Interrupted,
    /// candle's error, said without the backtrace candle appends under `RUST_BACKTRACE` (not a
    /// `source` either, so the printed cause chain does not show it a second time)
    #[error("tensor computation failed: {}", candle_message(.0))]
    Candle(candle_core::Error),
    /// `ATTNSCOPE_ISA` / `ATTNSCOPE_AMX` ask for a kernel this CPU cannot run (or name none).
    #[error("{0}")]
    Kernels(String),
    /// A caller broke one of the engine's invariants (shapes that do not fit, a prefix of
    /// another model, weights the plan needs and the model lacks): attnscope's bug, never the
    /// input's.
    #[error("tensor computation failed: {0}")]
    Bug(String),
    /// Quantized blocks whose bytes do not make the values their shape asks for.
    #[error("tensor computation failed: {what}: {bytes} bytes do not make {values} values")]
    BlockBytes {
        /// The block type (and size) read.
        what: String,
        bytes: usize,
        values: usize,
    },
    /// A block type candle has no tensor type for (attnscope reads it itself).
    #[error("tensor computation failed: {0} has no candle tensor type")]
    NoCandleType(String),
    /// An output head whose matrix does not fit the rows it multiplies.
    #[error("tensor computation failed: {0}")]
    HeadShape(String),
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Error::Candle(e)
    }
}

/// A candle error's message without the backtrace candle appends to it when `RUST_BACKTRACE` is
/// set (its `WithBacktrace` wrapper, at any depth of its context and path wrappers): a message
/// for the user, not a trace of candle's frames.
pub fn candle_message(e: &candle_core::Error) -> String {
    use candle_core::Error as C;
    match e {
        C::WithBacktrace { inner, .. } => candle_message(inner),
        C::Context { inner, context } => format!("{context}: {}", candle_message(inner)),
        C::WithPath { inner, path } => format!("{}: {}", path.display(), candle_message(inner)),
        e => e.to_string(),
    }
}

impl Error {
    /// Whether the error is the user's input (exit code 2) rather than the program's (exit code 1).
    pub fn is_bad_input(&self) -> bool {
        !matches!(
            self,
            Error::Candle(_)
                | Error::Io { .. }
                | Error::Bug(_)
                | Error::BlockBytes { .. }
                | Error::NoCandleType(_)
                | Error::HeadShape(_)
        )
    }
    /// An I/O error on `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}

/// The library's result: `Ok(T)` or an [`Error`].
pub type Result<T> = std::result::Result<T, Error>;
