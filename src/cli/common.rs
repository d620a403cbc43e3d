//! Arguments and helpers shared by the subcommands.

pub use attnscope::analysis::files::{
    read_lines_file, read_stdin, read_text_file, ReadLimit, MAX_LINES_BYTES,
};
use attnscope::commands::load::ModelSpec;
use attnscope::model::{fetch::DEFAULT_MODEL, Memory, Model, Precision};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;

pub use attnscope::analysis::request::{parse_index_list, usage};
pub use attnscope::analysis::LESSON_SENTENCE;
pub use attnscope::render::progress::{on_bar, progress_bar};
pub use attnscope::render::{timings_opening, Output};

#[derive(clap::Args, Debug, Clone)]
pub struct ModelArgs {
    /// Model: an alias (qwen2.5-coder-0.5b, smollm2-135m, gemma3-270m, qwen2.5-coder-1.5b;
    /// fetched on first use), a .gguf file,
    /// a Hugging Face folder (config.json, *.safetensors, tokenizer.json), or a hub id org/name.
    #[arg(long, short = 'm', default_value = DEFAULT_MODEL)]
    pub model: String,
    /// exact: the reference's numbers (to ~1e-5): every product of a weight and an activation
    /// exact, summed in f32 (on CPUs with Intel AMX, a quantized file's projections run on the
    /// tiles as its integers and scales; elsewhere weights dequantized to f32). fast: the
    /// projections in bf16 on Intel AMX tiles (a forward 1.6-3.5x faster than exact, measured
    /// on a Sapphire Rapids-class Xeon: `bench --precision fast --against-exact`; attention
    /// weights move by <2e-2), else in 8-bit blocks on AVX-512 VNNI (1.7-2.2x measured on a
    /// Xeon and an AMD EPYC without AMX; weights move by <0.04), else on AVX2 (the same numbers:
    /// docs/precision.md). Without AVX2, fast runs as exact.
    #[arg(long, default_value = "exact", value_parser = precision_parser())]
    pub precision: Precision,
    /// How the projections are held (exact only): low keeps the file's own quantized blocks
    /// (mapped) and dequantizes a panel at a time just before each product (the same numbers;
    /// peak memory about the file's size plus the forward's buffers); fast packs them at load
    /// (f32 panels or AMX integers and scales, kept in the packed-weight cache). Default: fast
    /// when it needs at most half of the machine's available memory at 2,048 tokens (`info`
    /// says which and why, and what each setting needs).
    #[arg(long, value_parser = memory_parser())]
    pub memory: Option<Memory>,
    /// Put the model's BOS token first even though its metadata does not ask for one.
    #[arg(long, conflicts_with = "no_bos")]
    pub bos: bool,
    /// Leave out the BOS token the model's metadata asks for (Gemma puts `<bos>` first).
    #[arg(long)]
    pub no_bos: bool,
}

impl Default for ModelArgs {
    fn default() -> Self {
        ModelArgs {
            model: DEFAULT_MODEL.into(),
            precision: Precision::Exact,
            memory: None,
            bos: false,
            no_bos: false,
        }
    }
}

impl ModelArgs {
    /// The model these flags name, loaded by [`attnscope::commands::load::load`] (a progress bar
    /// where standard error is a terminal).
    pub fn load(&self) -> anyhow::Result<std::sync::Arc<Model>> {
        attnscope::commands::load::load(&self.spec())
    }

    /// The flags as the commands' [`ModelSpec`].
    pub fn spec(&self) -> ModelSpec {
        ModelSpec {
            model: self.model.clone(),
            precision: self.precision,
            memory: self.memory,
            no_bos: self.no_bos,
            progress: std::io::stderr().is_terminal(),
        }
    }
}

impl ModelArgs {
    /// The model's own files: what an output must never replace ([`model_paths`]).
    pub fn input_paths(&self) -> Vec<PathBuf> {
        model_paths(&self.model)
    }
}

/// The files of the model `spec` names, where they are here already: an alias's file (or
/// folder's files) in the cache, a GGUF file, a folder's files; none for a hub id not fetched.
pub fn model_paths(spec: &str) -> Vec<PathBuf> {
    let p = match attnscope::model::fetch::alias(spec) {
        Some(a) => attnscope::model::fetch::alias_path(a),
        None => PathBuf::from(spec),
    };
    if p.is_dir() {
        let files = std::fs::read_dir(&p).into_iter().flatten().flatten();
        files.map(|e| e.path()).filter(|f| f.is_file()).collect()
    } else if p.is_file() {
        vec![p]
    } else {
        Vec::new()
    }
}

/// `path` checked as the output of a command that reads `inputs` (before the model loads):
/// [`Output::check`].
pub fn output_path(
    path: &std::path::Path,
    force: bool,
    inputs: &[PathBuf],
) -> anyhow::Result<Output> {
    let inputs: Vec<&std::path::Path> = inputs.iter().map(PathBuf::as_path).collect();
    Output::check(path, force, &inputs)
}

/// The input of a command: its tokens and, for an encoder's sentence pair, the token types the
/// model runs and each token's segment (which text it belongs to).
pub struct Encoded {
    /// the token ids
    pub tokens: Vec<u32>,
    /// a pair's token types for the forward (`None`: one text, all 0)
    pub types: Option<Vec<u32>>,
    /// a pair's segments, 0 then 1 (`None`: one text)
    pub segments: Option<Vec<u32>>,
}

/// The model and the text most commands run on.
#[derive(clap::Args, Debug, Clone)]
pub struct ModelText {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub text: TextArgs,
}

#[derive(clap::Args, Debug, Clone)]
pub struct TextArgs {
    /// The text to run. Default: the lesson's sentence (or standard input when it is piped).
    #[arg(long, short = 't', conflicts_with = "file")]
    pub text: Option<String>,
    /// Read the text from a UTF-8 file (`-` for standard input).
    #[arg(long, short = 'f')]
    pub file: Option<PathBuf>,
    /// An encoder's second text (`inspect`, `heads`, `capture`, `heatmap`, `view`): the input is the sentence pair
    /// `[CLS] TEXT [SEP] PAIR [SEP]`, token types 0 then 1.
    #[arg(long, conflicts_with = "chat")]
    pub pair: Option<String>,
    /// A user message put through the model's own chat template (generation prompt added):
    /// the analysis runs on the chat prompt exactly as the model sees it.
    #[arg(long, conflicts_with_all = ["text", "file"])]
    pub chat: Option<String>,
    /// A system message for --chat (default: the template's own, if it has one).
    #[arg(long, requires = "chat")]
    pub system: Option<String>,
}

impl ModelText {
    /// The files the command reads: the model's and `--file`'s.
    pub fn input_paths(&self) -> Vec<PathBuf> {
        let mut v = self.model.input_paths();
        v.extend(self.text.input_paths());
        v
    }
}

impl TextArgs {
    /// `--file`'s path (not standard input's `-`).
    pub fn input_paths(&self) -> Vec<PathBuf> {
        self.file
            .iter()
            .filter(|f| f.as_os_str() != "-")
            .cloned()
            .collect()
    }

    /// The token ids to run: `--chat` through the model's own template (its BOS as the template
    /// writes it; a model without a template is refused, exit 2), else [`TextArgs::read`]'s text
    /// encoded (a BOS first as the model asks, or always with `force_bos`). `--pair` is refused
    /// (see [`TextArgs::tokens_or_pair`]).
    pub fn tokens(&self, model: &Model, force_bos: bool) -> anyhow::Result<Vec<u32>> {
        check_system(self.chat.is_some(), self.system.is_some())?;
        match &self.chat {
            Some(q) => {
                self.refuse_pair()?;
                Ok(model.chat_ids(q, self.system.as_deref())?)
            }
            None => Ok(model.encode(&self.read(model)?, force_bos)?),
        }
    }

    /// [`TextArgs::tokens`] (token types `None`: all 0, as the tokenizer types one text), or
    /// with `--pair` the encoder's sentence pair and its token types 0/1
    /// ([`Model::encode_pair`]; a decoder refuses it). The types go to the forward in
    /// `RunOptions::token_types`.
    pub fn tokens_or_pair(
        &self,
        model: &Model,
        force_bos: bool,
    ) -> anyhow::Result<(Vec<u32>, Option<Vec<u32>>)> {
        match &self.pair {
            Some(b) if self.chat.is_none() => {
                let (ids, types) =
                    model.encode_pair(&self.read_any(&ReadLimit::text_of(model))?, b)?;
                Ok((ids, Some(types)))
            }
            _ => Ok((self.tokens(model, force_bos)?, None)),
        }
    }

    /// [`TextArgs::tokens_or_pair`] with a pair's segments (0 for the first text's part, 1 for
    /// the second's, also on a model without token types: [`Model::encode_pair_segments`]), for
    /// the commands that show which text a token belongs to (`inspect`, `view`).
    pub fn encoded(&self, model: &Model, force_bos: bool) -> anyhow::Result<Encoded> {
        match &self.pair {
            Some(b) if self.chat.is_none() => {
                let limit = ReadLimit::text_of(model);
                let (tokens, types, segments) =
                    model.encode_pair_segments(&self.read_any(&limit)?, b)?;
                Ok(Encoded {
                    tokens,
                    types: Some(types),
                    segments: Some(segments),
                })
            }
            _ => Ok(Encoded {
                tokens: self.tokens(model, force_bos)?,
                types: None,
                segments: None,
            }),
        }
    }

    fn refuse_pair(&self) -> anyhow::Result<()> {
        if self.pair.is_some() {
            return Err(usage(
                "--pair (a sentence pair for an encoder) is taken by inspect, heads, capture, heatmap and view, without --chat (nor --each-line); this command runs one text",
            ));
        }
        Ok(())
    }

    /// The text for `model`: `--text`, `--file`, piped standard input, or the lesson's sentence
    /// (refusing `--pair` and `--chat`: a command that reads one plain text). A file or
    /// standard input is read up to what a text for `model` may take ([`ReadLimit::text_of`]).
    pub fn read(&self, model: &Model) -> anyhow::Result<String> {
        self.refuse_pair()?;
        self.read_any(&ReadLimit::text_of(model))
    }

    /// [`TextArgs::read`] for a text of many texts, one a line (`heads --each-line`): each line
    /// up to what a text for `model` may take ([`read_lines_file`]).
    pub fn read_lines(&self, model: &Model) -> anyhow::Result<String> {
        self.refuse_pair()?;
        match &self.file {
            Some(f) if self.text.is_none() && self.chat.is_none() => {
                read_lines_file(f, &ReadLimit::text_of(model))
            }
            _ => self.read_any(&ReadLimit {
                bytes: MAX_LINES_BYTES,
                why: "the most a file of texts may take".into(),
            }),
        }
    }

    /// The text: `--text`, `--file` or piped standard input (read up to `limit`), or the
    /// lesson's sentence.
    fn read_any(&self, limit: &ReadLimit) -> anyhow::Result<String> {
        check_system(self.chat.is_some(), self.system.is_some())?;
        if self.chat.is_some() {
            return Err(usage(
                "--chat gives a chat prompt; this command reads a plain text (--text or --file)",
            ));
        }
        if let Some(t) = &self.text {
            return Ok(t.clone());
        }
        if let Some(f) = &self.file {
            return read_text_file(f, limit);
        }
        if !std::io::stdin().is_terminal() {
            let text = read_stdin(limit)?;
            if !text.is_empty() {
                return Ok(text);
            }
        }
        Ok(LESSON_SENTENCE.to_string())
    }
}

/// Refuses `--system` without `--chat` (clap does not enforce `requires` when a conflicting
/// argument such as `--text` is present).
pub fn check_system(chat: bool, system: bool) -> anyhow::Result<()> {
    if system && !chat {
        return Err(usage(
            "--system sets the system message of a chat; give the question with --chat",
        ));
    }
    Ok(())
}

/// Prints to standard output, turning a closed pipe into an error `main` treats as success.
pub fn emit(s: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    out.write_all(s.as_bytes())?;
    out.flush()?;
    Ok(())
}

/// `--memory`'s parser: the settings' names, listed in `--help`.
pub fn memory_parser() -> impl clap::builder::TypedValueParser<Value = Memory> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Memory::ALL.map(|m| m.name()))
        .map(|s| s.parse::<Memory>().expect("a listed setting"))
}

/// `--precision`'s parser: the model's [`Precision`] names, listed in `--help` and in the error
/// for any other value (the model's type knows nothing of the command line).
pub fn precision_parser() -> impl clap::builder::TypedValueParser<Value = Precision> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Precision::ALL.map(|p| p.name()))
        .map(|s| s.parse::<Precision>().expect("one of the possible values"))
}

/// `--file`'s text read before a model is loaded, up to what a text of the longest context
/// may take ([`ReadLimit::any_model`]; the model checks its own bound before it tokenizes),
/// refused (exit 2) when it cannot be read or is not UTF-8.
pub fn read_text(f: &std::path::Path) -> anyhow::Result<String> {
    read_text_file(f, &ReadLimit::any_model())
}
