//! A fuzz-style sweep over every command's options (#56): each option of each subcommand, as
//! clap itself lists them (`attnscope __options --json`, so a new option is swept without anyone
//! adding it here), run on the tiny model with an empty, a negative, a huge, an infinite, a NaN
//! and a wrong-type value, and every path option pointed at an existing file. For each run:
//! - no panic (exit 70, attnscope's bug report; 101, Rust's) and no signal;
//! - no exit 0 with NaN in standard output (a number that is not one; where the value NaN was
//!   given as a text or a path, a command may print it back, and that is not checked), and no
//!   number option that takes NaN at all (every comparison with it is false);
//! - no existing file changed (no command is given `--force`);
//! - no run past [`RUN_LIMIT`]: a huge count must be refused or bounded, not run for hours.
//!
//! Each command starts from a base invocation that exits 0 on its own (checked), so an option's
//! value is what each run changes. The runs go on as many threads as the machine has cores.

mod common;

use serde::Deserialize;
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The values each option is given: empty, negative, huge (a count that parses), infinite as a
/// float, NaN, a word where a number or a path is expected.
const VALUES: [&str; 6] = ["", "-1", "99999999999", "1e300", "NaN", "abc"];

/// Longest a run may take.
const RUN_LIMIT: Duration = Duration::from_secs(60);

/// What the existing file a path option is pointed at holds.
const EXISTING: &[u8] = b"attnscope option sweep: this file existed before the run\n";

#[derive(Deserialize, Debug)]
struct CommandInfo {
    command: Vec<String>,
    options: Vec<OptionInfo>,
}

#[derive(Deserialize, Debug, Clone)]
struct OptionInfo {
    name: String,
    positional: bool,
    kind: String,
}

/// The files every run may read: the tiny model, a text file, a corpus record file, an encoder.
struct Fixtures {
    _dir: tempfile::TempDir,
    model: String,
    texts: String,
    records: String,
    bert: String,
    cache: PathBuf,
}

impl Fixtures {
    fn new() -> Fixtures {
        let dir = tempfile::tempdir().unwrap();
        let model = common::tiny_gguf(&dir).to_str().unwrap().to_string();
        let texts = dir.path().join("texts.txt");
        std::fs::write(&texts, "the hat\nthe cat at the hat\n").unwrap();
        let cache = dir.path().join("cache");
        let records = dir.path().join("records.jsonl");
        let mut c = command(&cache, dir.path());
        c.args(["corpus", "-m", &model, "--limit", "2", "--out"])
            .arg(&records);
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", common::stderr_of(&out));
        let bert = common::golden("arch/bert");
        Fixtures {
            model,
            texts: texts.to_str().unwrap().into(),
            records: records.to_str().unwrap().into(),
            bert: bert.to_str().unwrap().into(),
            cache,
            _dir: dir,
        }
    }
}

/// The command, its environment fixed: a cache of the sweep's own (nothing fetched or cleared
/// elsewhere), the hub offline, standard input empty.
fn command(cache: &Path, cwd: &Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_attnscope"));
    c.env("ATTNSCOPE_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .env("RUST_BACKTRACE", "1")
        .current_dir(cwd)
        .stdin(Stdio::null());
    c
}

/// Each command's base invocation on the fixtures, long option names only (so a swept option
/// replaces the base's own): `{m}` the tiny model, `{texts}` a text file, `{records}` a corpus
/// record file, `{bert}` the tiny BERT, `{out}` the run's own folder (where a command writes).
const BASES: &[(&str, &str)] = &[
    ("explain", "--model {m}"),
    ("cost", "8"),
    ("inspect", "--model {m} --text the_hat_at_the"),
    ("generate", "--model {m} --text the_hat --max-new-tokens 2"),
    ("faithfulness", "--model {m} --text the_hat_at"),
    (
        "attribute",
        "--model {m} --text the_hat_at --method gradient",
    ),
    ("ablate", "--model {m} --text the_hat_at"),
    ("patch", "--model {m} --clean the_hat --corrupt the_cat"),
    ("dla", "--model {m} --text the_hat_at"),
    ("qk", "--model {m} --text the_hat_at --layer 0 --head 0"),
    (
        "circuit",
        "--model {m} --clean the_hat --corrupt the_cat --answer a --wrong b",
    ),
    ("corpus", "--model {m} --limit 2"),
    ("corpus merge", "{records}"),
    ("sinks", "--model {m} --file {texts}"),
    ("compare", "--model {m} --text the_hat --text the_cat"),
    ("heads", "--model {m} --text the_hat_at_the_hat"),
    ("scaling", "--model {m} --lengths 8 --repeats 1"),
    ("view", "--model {m} --text the_hat --out {out}/v.html"),
    (
        "heatmap",
        "--model {m} --text the_hat --layer 0 --out {out}/h.png",
    ),
    ("serve", "--model {m} --addr 127.0.0.1:0"),
    ("info", "--model {m}"),
    (
        "capture",
        "--model {m} --text the_hat --out {out}/c.safetensors",
    ),
    ("bench", "--model {m} --lengths 8 --repeats 1 --no-commands"),
    ("embed", "--model {bert} --file {texts} --out {out}/e.npy"),
    ("cache", "list"),
    ("cache list", ""),
    ("cache clear", ""),
];

/// The base invocation of a command (see [`BASES`]; `_` in a text is a space), run in `out`;
/// `None` for `fetch`, whose base would download a model (it is swept with bad values only). A
/// command not listed fails the test: give it a base in [`BASES`].
fn base(cmd: &[String], f: &Fixtures, out: &Path) -> Option<Vec<String>> {
    let name = cmd.join(" ");
    if name == "fetch" {
        return None;
    }
    let (_, rest) = BASES
        .iter()
        .find(|(c, _)| *c == name)
        .unwrap_or_else(|| panic!("no base invocation for `{name}`: add one to BASES"));
    let args = rest.split_whitespace().map(|a| {
        a.replace('_', " ")
            .replace("{m}", &f.model)
            .replace("{texts}", &f.texts)
            .replace("{records}", &f.records)
            .replace("{bert}", &f.bert)
            .replace("{out}", out.to_str().unwrap())
    });
    Some(cmd.iter().cloned().chain(args).collect())
}

/// `base` with option `opt` given `value` (replacing the base's own value of it, and a
/// positional argument replacing the base's positional values): a flag alone.
fn with_option(
    base: &[String],
    words: usize,
    opt: &OptionInfo,
    value: Option<&str>,
) -> Vec<String> {
    let mut args = base.to_vec();
    if opt.positional {
        // only `corpus merge` has positional values in its base: the record file
        args.truncate(words);
        args.extend(value.map(String::from));
        return args;
    }
    let flag = format!("--{}", opt.name);
    if let Some(i) = args.iter().position(|a| a == &flag) {
        args.remove(i);
        if opt.kind != "flag" {
            args.remove(i);
        }
    }
    args.push(flag);
    args.extend(value.map(String::from));
    args
}

/// One run of the sweep: the command line, the folder it runs in, and the existing file it
/// must leave as it was (a path option's value).
struct Case {
    label: String,
    args: Vec<String>,
    dir: tempfile::TempDir,
    existing: Option<PathBuf>,
    serve: bool,
    /// the base invocation alone, which must succeed
    base: bool,
    /// the word NaN given as a text or a path, which a command may print back
    echoes_nan: bool,
    /// NaN given to a number option, which must be refused (it compares false with everything)
    nan_number: bool,
}

/// How a run ended.
struct Outcome {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
    timed_out: bool,
    /// `serve` printed that it listens (then it was stopped)
    served: bool,
}

/// A reader thread collecting a child's stream.
fn collect(
    mut r: impl Read + Send + 'static,
) -> (Arc<Mutex<Vec<u8>>>, std::thread::JoinHandle<()>) {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let b = buf.clone();
    let h = std::thread::spawn(move || {
        let mut chunk = [0u8; 8192];
        while let Ok(n) = r.read(&mut chunk) {
            if n == 0 {
                break;
            }
            b.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    (buf, h)
}

/// Runs `c`, stopping it past [`RUN_LIMIT`] or, for `serve`, once it says it listens.
fn run(c: &Case, cache: &Path) -> Outcome {
    let t = Instant::now();
    let mut child = command(cache, c.dir.path())
        .args(&c.args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (out, out_h) = collect(child.stdout.take().unwrap());
    let (err, err_h) = collect(child.stderr.take().unwrap());
    let (mut timed_out, mut served) = (false, false);
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        served = c.serve && String::from_utf8_lossy(&out.lock().unwrap()).contains(" serving ");
        timed_out = t.elapsed() > RUN_LIMIT;
        if served || timed_out {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let _ = (out_h.join(), err_h.join());
    let text = |b: &Arc<Mutex<Vec<u8>>>| String::from_utf8_lossy(&b.lock().unwrap()).into_owned();
    Outcome {
        code: status.map(|s| s.code().unwrap_or(-1)),
        stdout: text(&out),
        stderr: text(&err),
        took: t.elapsed(),
        timed_out,
        served,
    }
}

/// Whether `text` holds NaN as a word (a number that is not one).
fn has_nan(text: &str) -> bool {
    text.split(|c: char| !c.is_ascii_alphanumeric())
        .any(|w| w == "NaN" || w == "nan")
}

/// What is wrong with a run's outcome, if anything.
fn problem(c: &Case, o: &Outcome) -> Option<String> {
    if let Some(p) = &c.existing {
        if std::fs::read(p).ok().as_deref() != Some(EXISTING) {
            return Some(format!("changed the existing file {}", p.display()));
        }
    }
    if o.timed_out {
        return Some(format!("still running after {RUN_LIMIT:?}"));
    }
    match o.code {
        None if o.served => None,
        Some(70) | Some(101) => Some("panicked".into()),
        Some(-1) => Some("killed by a signal".into()),
        Some(0) if has_nan(&o.stdout) && !c.echoes_nan => {
            Some("exit 0 with NaN in its output".into())
        }
        Some(0) if c.nan_number => Some("took NaN as a number (exit 0)".into()),
        _ => None,
    }
}

/// Every case: each command's base alone, then each option with each value (a flag alone; a
/// path option also pointed at an existing file).
fn cases(f: &Fixtures) -> Vec<Case> {
    let out = command(&f.cache, Path::new("."))
        .args(["__options", "--json"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr_of(&out));
    let commands: Vec<CommandInfo> = serde_json::from_slice(&out.stdout).unwrap();
    let mut cases = Vec::new();
    for c in &commands {
        let name = c.command.join(" ");
        let serve = name == "serve";
        let case = |label: String,
                    value: Option<Option<&str>>,
                    opt: Option<&OptionInfo>,
                    existing: bool| {
            let dir = tempfile::tempdir().unwrap();
            let b = base(&c.command, f, dir.path());
            let mut args = b.clone().unwrap_or_else(|| c.command.clone());
            let mut existing_file = None;
            if let Some(opt) = opt {
                let v = if existing {
                    let p = dir.path().join("existing.bin");
                    std::fs::write(&p, EXISTING).unwrap();
                    existing_file = Some(p.to_str().unwrap().to_string());
                    Some(existing_file.as_deref().unwrap())
                } else {
                    value.flatten()
                };
                args = with_option(&args, c.command.len(), opt, v);
            }
            let echoes_nan = value == Some(Some("NaN"))
                && opt.is_some_and(|o| ["string", "path", "other"].contains(&o.kind.as_str()));
            let nan_number = value == Some(Some("NaN")) && opt.is_some_and(|o| o.kind == "float");
            Case {
                label,
                args,
                existing: existing_file.map(PathBuf::from),
                serve,
                base: opt.is_none(),
                echoes_nan,
                nan_number,
                dir,
            }
        };
        if base(&c.command, f, Path::new("/")).is_some() {
            cases.push(case(format!("{name} (base)"), None, None, false));
        }
        for opt in &c.options {
            if opt.kind == "flag" {
                cases.push(case(
                    format!("{name} --{}", opt.name),
                    None,
                    Some(opt),
                    false,
                ));
                continue;
            }
            for v in VALUES {
                cases.push(case(
                    format!("{name} --{} {v:?}", opt.name),
                    Some(Some(v)),
                    Some(opt),
                    false,
                ));
            }
            if opt.kind == "path" {
                cases.push(case(
                    format!("{name} --{} <existing file>", opt.name),
                    None,
                    Some(opt),
                    true,
                ));
            }
        }
    }
    cases
}

/// Runs `cases` on as many threads as the machine has cores (each run is a process, mostly
/// loading the tiny model), in order of the list.
fn run_all(cases: &[Case], cache: &Path) -> Vec<Outcome> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let next = std::sync::atomic::AtomicUsize::new(0);
    let done: Mutex<Vec<(usize, Outcome)>> = Mutex::new(Vec::with_capacity(cases.len()));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let Some(c) = cases.get(i) else { break };
                let o = run(c, cache);
                done.lock().unwrap().push((i, o));
            });
        }
    });
    let mut done = done.into_inner().unwrap();
    done.sort_by_key(|(i, _)| *i);
    done.into_iter().map(|(_, o)| o).collect()
}

#[test]
fn every_option_of_every_command_with_bad_values() {
    let t = Instant::now();
    let f = Fixtures::new();
    let cases = cases(&f);
    let outcomes = run_all(&cases, &f.cache);
    let mut problems = Vec::new();
    let mut codes: BTreeMap<String, usize> = BTreeMap::new();
    for (c, o) in cases.iter().zip(&outcomes) {
        let code = match (o.code, o.served) {
            (_, true) => "served".to_string(),
            (Some(k), _) => k.to_string(),
            (None, _) => "stopped".to_string(),
        };
        *codes.entry(code).or_default() += 1;
        let failed_base = c.base && o.code != Some(0) && !o.served;
        let why =
            problem(c, o).or_else(|| failed_base.then(|| "the base invocation failed".into()));
        if let Some(why) = why {
            problems.push(format!(
                "{}: {why} (exit {:?})\n  attnscope {}\n  stderr: {}",
                c.label,
                o.code,
                c.args.join(" "),
                o.stderr
                    .trim()
                    .lines()
                    .take(3)
                    .collect::<Vec<_>>()
                    .join("\n          ")
            ));
        }
        if std::env::var_os("SWEEP_DEBUG").is_some() && o.code == Some(0) && !c.base {
            eprintln!("exit 0: {}", c.label);
        }
        if o.code == Some(1) {
            eprintln!("exit 1 (not bad input?): {}: {}", c.label, o.stderr.trim());
        }
    }
    let mut slow: Vec<(Duration, &str)> = cases
        .iter()
        .zip(&outcomes)
        .map(|(c, o)| (o.took, c.label.as_str()))
        .collect();
    slow.sort();
    eprintln!(
        "option sweep: {} runs in {:.1} s; exit codes {codes:?}; slowest: {:?}",
        cases.len(),
        t.elapsed().as_secs_f64(),
        slow.iter().rev().take(8).collect::<Vec<_>>()
    );
    assert!(
        problems.is_empty(),
        "{} of {} runs:\n{}",
        problems.len(),
        cases.len(),
        problems.join("\n")
    );
}
