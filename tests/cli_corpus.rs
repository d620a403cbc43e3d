//! `corpus` (shards, resume, merge, Slurm arrays), `cache list|clear` and the loader's report of an internal panic, on tiny generated models.
// index loops over (layer, head, query) read like the maths; nested test types stay inline
#![allow(clippy::needless_range_loop, clippy::type_complexity)]

mod common;

use attnscope::model::tiny::{tiny_model, write_gguf};
use attnscope::model::Arch;
use candle_core::quantized::GgmlDType;
use common::{attnscope, fails_with, run_err, run_json, stderr_of, succeeds, tiny_gguf};

/// `corpus` of the model `model` on the lines of `texts`, with `--json`.
struct Corpus<'a> {
    model: &'a str,
    texts: &'a std::path::Path,
}

impl Corpus<'_> {
    /// Runs it with `extra` after, asserted to succeed.
    fn run(&self, extra: &[&str]) -> std::process::Output {
        succeeds(
            attnscope()
                .args(["corpus", "--model", self.model, "--file"])
                .arg(self.texts)
                .arg("--json")
                .args(extra),
        )
    }

    fn json(&self, extra: &[&str]) -> serde_json::Value {
        serde_json::from_slice(&self.run(extra).stdout).unwrap()
    }
}

#[test]
fn corpus_shards_merge_to_the_single_run_and_resume() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let m = m.to_str().unwrap();
    let texts = dir.path().join("texts.txt");
    std::fs::write(
        &texts,
        "the hat\nat the the\nhe sat\n\nthe the the at\nhat\n",
    )
    .unwrap();
    let corpus = Corpus {
        model: m,
        texts: &texts,
    };
    let single = corpus.json(&[]);
    assert_eq!(single["sentences"], 5);
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    corpus.json(&["--shard", "0/2", "--out", a.to_str().unwrap()]);
    let b_first = corpus.json(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    assert_eq!(b_first["sentences"], 2);
    // resume: a second run with the same --out adds nothing
    corpus.json(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    assert_eq!(std::fs::read_to_string(&b).unwrap().lines().count(), 2);
    a_resumed_shard_keeps_its_whole_records(&corpus, &b);
    a_file_that_is_not_ours_is_refused_not_cut(&corpus, &dir.path().join("other.jsonl"));
    let merged = run_json([
        "corpus",
        "merge",
        a.to_str().unwrap(),
        b.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(merged, single, "merged shards must equal the single run");
    run_err(["corpus", "--model", m, "--shard", "2/2"], 2);
}

/// Resuming shard 1/2 into `b` (its whole output): a run killed in the middle of a line has the
/// torn line dropped (and said), the complete one kept, and the resumed file equals the
/// uninterrupted one; a last record whose newline was lost is kept, and the next record starts
/// on its own line.
fn a_resumed_shard_keeps_its_whole_records(corpus: &Corpus, b: &std::path::Path) {
    let resume = || corpus.run(&["--shard", "1/2", "--out", b.to_str().unwrap()]);
    let whole = std::fs::read_to_string(b).unwrap();
    let cut = whole.find('\n').unwrap() + 1 + 40;
    std::fs::write(b, &whole[..cut]).unwrap();
    let out = resume();
    assert!(stderr_of(&out).contains("torn line"), "{}", stderr_of(&out));
    assert_eq!(std::fs::read_to_string(b).unwrap(), whole);
    std::fs::write(
        b,
        whole
            .trim_end_matches('\n')
            .split_inclusive('\n')
            .next()
            .unwrap()
            .trim_end(),
    )
    .unwrap();
    resume();
    assert_eq!(std::fs::read_to_string(b).unwrap(), whole);
}

/// An `--out` file (`other`) that is not ours is refused, not cut.
fn a_file_that_is_not_ours_is_refused_not_cut(corpus: &Corpus, other: &std::path::Path) {
    std::fs::write(other, "{\"hello\": 1}\n{\"id\": 3, \"te").unwrap();
    fails_with(
        attnscope()
            .args(["corpus", "--model", corpus.model, "--file"])
            .arg(corpus.texts)
            .arg("--out")
            .arg(other),
        2,
    );
    assert_eq!(
        std::fs::read_to_string(other).unwrap(),
        "{\"hello\": 1}\n{\"id\": 3, \"te"
    );
}

/// A panic in attnscope's own loading (here the packing, made to panic with ATTNSCOPE_FAULT) is
/// reported as attnscope's bug with exit code 70 (EX_SOFTWARE), never as the user's corrupt
/// file (exit 2, "fetch it again"), which is what the loader boundary said before it wrapped
/// only the third-party readers; a truly corrupt file still gets exit 2 and its message.
#[test]
fn an_internal_panic_is_reported_as_a_bug_not_as_a_bad_file() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let run = |fault: Option<&str>, model: &std::path::Path| {
        let mut c = attnscope();
        c.args(["inspect", "--model"])
            .arg(model)
            .args(["--text", "the hat"]);
        c.env("ATTNSCOPE_PANEL_CACHE", "off");
        match fault {
            Some(f) => c.env("ATTNSCOPE_FAULT", f),
            None => c.env_remove("ATTNSCOPE_FAULT"),
        };
        c.output().unwrap()
    };
    let ok = run(None, &m);
    assert_eq!(ok.status.code(), Some(0), "{}", stderr_of(&ok));
    let bug = run(Some("pack"), &m);
    let err = stderr_of(&bug);
    assert_eq!(bug.status.code(), Some(70), "{err}");
    assert!(
        err.contains("internal error: fault injected at `pack`")
            && err.contains("this is a bug in attnscope")
            && err.contains("not a problem with your input or your model file"),
        "{err}"
    );
    for blame in ["corrupt", "fetch it again", "truncated", "panicked at"] {
        assert!(
            !err.contains(blame),
            "the bug is blamed on the file ({blame}): {err}"
        );
    }
    assert!(bug.stdout.is_empty());
    // a damaged file is still the file's: exit 2, the file named
    let bytes = std::fs::read(&m).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let bad = run(None, &cut);
    assert_eq!(bad.status.code(), Some(2), "{}", stderr_of(&bad));
    assert!(stderr_of(&bad).contains("cut.gguf"), "{}", stderr_of(&bad));
}

/// `attnscope cache list --json` names each packed-weight cache file's model, layout and size
/// (with the total and the cap, ATTNSCOPE_PANEL_CACHE_MAX_GB), and `cache clear` removes one
/// model's files (by a path to it) or all of them; ATTNSCOPE_CACHE points at a temporary folder.
#[test]
fn cache_list_and_clear() {
    let dir = tempfile::tempdir().unwrap();
    // the cache writes no file that would leave less than SPARE_BYTES free: the test needs
    // that much and the tiny models' few MB
    let free = attnscope::model::panels::free_bytes(dir.path());
    assert!(
        free.is_none_or(|f| f > attnscope::model::panels::SPARE_BYTES + (64 << 20)),
        "cache_list_and_clear needs 1 GiB + 64 MiB free on the disk holding {} for the packed-weight cache to write its files; it has {} MiB",
        dir.path().display(),
        free.unwrap_or(0) >> 20
    );
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    write_gguf(&tiny_model(Arch::Qwen2, 1), Arch::Qwen2, GgmlDType::F32, &a).unwrap();
    write_gguf(&tiny_model(Arch::Llama, 2), Arch::Llama, GgmlDType::F32, &b).unwrap();
    // the tiny models are under the command line's 64 MB floor: written through the library
    let written = write_packed_weights(&[&a, &b], &dir.path().join("panels"));
    let cache = |args: &[&str]| {
        let out = attnscope()
            .arg("cache")
            .args(args)
            .env("ATTNSCOPE_CACHE", dir.path())
            .env("ATTNSCOPE_PANEL_CACHE_MAX_GB", "0.5")
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr_of(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let listed: serde_json::Value = serde_json::from_str(&cache(&["list", "--json"])).unwrap();
    assert_eq!(listed["max_bytes"], 1u64 << 29);
    let files = listed["files"].as_array().unwrap();
    assert_eq!(files.len(), 2, "{listed}");
    let mut models: Vec<&str> = files.iter().map(|f| f["model"].as_str().unwrap()).collect();
    models.sort();
    assert_eq!(models, ["a.gguf", "b.gguf"]);
    let layout =
        attnscope::model::weights::PanelLayout::of(attnscope::model::Precision::Exact).name();
    let mut total = 0;
    for f in files {
        assert_eq!(f["layout"], layout.as_str());
        let path = std::path::PathBuf::from(f["path"].as_str().unwrap());
        assert_eq!(f["bytes"], std::fs::metadata(&path).unwrap().len());
        assert_eq!(f["usable"], true);
        total += f["bytes"].as_u64().unwrap();
    }
    assert_eq!(listed["total_bytes"], total);
    let text = cache(&["list"]);
    assert!(
        text.contains("a.gguf") && text.contains("2 files"),
        "{text}"
    );
    // one model's, by another path to it
    let link = dir.path().join("link-to-a.gguf");
    std::fs::hard_link(&a, &link).unwrap();
    let out = cache(&["clear", "--model", link.to_str().unwrap()]);
    assert!(out.starts_with("removed 1 files"), "{out}");
    assert!(!written[0].exists() && written[1].exists());
    let out = cache(&["clear"]);
    assert!(out.starts_with("removed 1 files"), "{out}");
    assert!(!written[1].exists());
    let listed: serde_json::Value = serde_json::from_str(&cache(&["list", "--json"])).unwrap();
    assert_eq!(listed["files"].as_array().unwrap().len(), 0);
}

/// Loads each of `models` with the packed-weight cache in `panels` (no floor, no cap), which
/// writes its file; returns the files.
fn write_packed_weights(
    models: &[&std::path::Path],
    panels: &std::path::Path,
) -> Vec<std::path::PathBuf> {
    use attnscope::model::panels::Settings;
    let settings = Settings {
        dir: panels.to_path_buf(),
        min_bytes: 0,
        max_bytes: u64::MAX,
    };
    let mut written = Vec::new();
    for m in models {
        let model = attnscope::model::Model::load_with(
            m.to_str().unwrap(),
            attnscope::model::Precision::Exact,
            false,
            Some(&settings),
        )
        .unwrap();
        let file = model.panel_file().unwrap_or_else(|| {
            panic!(
                "{} was loaded but no packed-weight file was written (its note on stderr says why)",
                m.display()
            )
        });
        written.push(file.to_path_buf());
    }
    written
}

/// A corpus record (what `corpus --out` writes) with `layers` layers of `heads` heads.
fn corpus_record(
    id: usize,
    text: &str,
    model: &str,
    layers: usize,
    heads: usize,
) -> serde_json::Value {
    let per_head = vec![vec![0.5f32; heads]; layers];
    serde_json::json!({
        "id": id, "text": text, "model": model, "n_tokens": 3,
        "model_sha256": "ab".repeat(32), "bos": false, "precision": "exact",
        "attnscope_version": env!("CARGO_PKG_VERSION"),
        "sink_query": vec![0.4f32; layers], "sink_all": vec![0.6f32; layers],
        "head_alpha1": per_head, "head_max_last": per_head, "head_mean_max": per_head,
        "head_mean_entropy": per_head,
        "next_token_id": 1, "next_token": "x", "next_token_prob": 0.5,
    })
}

/// `corpus merge` checks every record and refuses (exit 2, naming the file and line) a record
/// whose arrays disagree with its layer count or with the other records (it used to panic, exit
/// 101), a share outside [0, 1] or a negative entropy (merged silently), an empty profile,
/// another model, and an id that names two different texts (it used to
/// merge them silently); a repeated record of the same text is merged once.
#[test]
fn corpus_merge_refuses_records_that_do_not_agree() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("a.jsonl");
    let lines = |rs: &[serde_json::Value]| rs.iter().map(|r| format!("{r}\n")).collect::<String>();
    std::fs::write(
        &good,
        lines(&[
            corpus_record(0, "the hat", "m", 2, 3),
            corpus_record(1, "he sat", "m", 2, 3),
        ]),
    )
    .unwrap();
    let merge = |second: &str| {
        let b = dir.path().join("b.jsonl");
        std::fs::write(&b, second).unwrap();
        let mut c = attnscope();
        c.args(["corpus", "merge", "--json"]).arg(&good).arg(&b);
        c
    };
    // the same record again (a resumed shard) and a new one: merged, the repeat once
    let ok = succeeds(&mut merge(&lines(&[
        corpus_record(1, "he sat", "m", 2, 3),
        corpus_record(2, "at", "m", 2, 3),
    ])));
    let agg: serde_json::Value = serde_json::from_slice(&ok.stdout).unwrap();
    assert_eq!(agg["sentences"], 3);
    let mut short_query = corpus_record(3, "hat", "m", 2, 3);
    short_query["sink_query"] = serde_json::json!([0.4]);
    let mut ragged_heads = corpus_record(3, "hat", "m", 2, 3);
    ragged_heads["head_max_last"][1] = serde_json::json!([0.5, 0.5]);
    let empty = corpus_record(3, "hat", "m", 0, 3);
    // values no run writes: a share of 5 moved the merged means silently
    let mut big_share = corpus_record(3, "hat", "m", 2, 3);
    big_share["sink_all"][1] = serde_json::json!(5.0);
    let mut negative_entropy = corpus_record(3, "hat", "m", 2, 3);
    negative_entropy["head_mean_entropy"][0][2] = serde_json::json!(-1.0);
    let cases: [(serde_json::Value, &str); 8] = [
        (
            big_share,
            "`sink_all` holds 5, not an attention weight or probability",
        ),
        (
            negative_entropy,
            "`head_mean_entropy` holds -1, not an entropy",
        ),
        (
            short_query,
            "`sink_query` has 1 layers but `sink_all` has 2",
        ),
        (ragged_heads, "layer 1 of `head_max_last` has 2 heads"),
        (empty, "its profile is empty"),
        // every array one layer shorter than the other records'
        (
            corpus_record(3, "hat", "m", 1, 3),
            "(1 layers, 3 heads), but",
        ),
        (
            corpus_record(3, "hat", "m", 2, 2),
            "(2 layers, 2 heads), but",
        ),
        (corpus_record(3, "hat", "other", 2, 3), "from model `other`"),
    ];
    for (bad, want) in cases {
        let err = fails_with(
            &mut merge(&lines(&[corpus_record(2, "at", "m", 2, 3), bad])),
            2,
        );
        assert!(
            err.contains("b.jsonl:2:"),
            "{want}: the file and line: {err}"
        );
        assert!(err.contains(want), "{want}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    // one id, two texts: both places are named
    let err = fails_with(
        &mut merge(&lines(&[corpus_record(1, "a different text", "m", 2, 3)])),
        2,
    );
    assert!(
        err.contains("b.jsonl:1: record 1 is for the text \"a different text\"")
            && err.contains("a.jsonl:2 has record 1 for \"he sat\""),
        "{err}"
    );
    // no records in one file (a.jsonl still holds records), then none at all
    succeeds(&mut merge("\n"));
    let empty = dir.path().join("empty.jsonl");
    std::fs::write(&empty, "").unwrap();
    let out = fails_with(attnscope().args(["corpus", "merge"]).arg(&empty), 2);
    assert!(out.contains("hold no records"), "{}", out);
}

/// Issue #56, defect 3: records did not say what made them, so `corpus merge` and a resumed
/// `--out` mixed BOS and no-BOS records (or two precisions) silently, and a record id seen twice
/// with the same text but other numbers was "merged once" (whichever came first). Each record
/// now names the model file's sha256, BOS, precision and attnscope's version; a resume or a
/// merge that mixes them is refused (exit 2, naming both values and places), as is a repeated
/// id with other numbers, and a record without these fields (an older attnscope's) is told how
/// to regenerate its file.
#[test]
fn corpus_records_carry_their_settings_and_are_never_mixed() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let texts = dir.path().join("texts.txt");
    std::fs::write(
        &texts,
        "the hat
at the the
he sat
",
    )
    .unwrap();
    let corpus = |out: &std::path::Path, extra: &[&str]| {
        let mut c = attnscope();
        c.args(["corpus", "--json", "--model"])
            .arg(&m)
            .arg("--file")
            .arg(&texts);
        c.arg("--out").arg(out).args(extra);
        c
    };
    let (plain, bos) = (dir.path().join("plain.jsonl"), dir.path().join("bos.jsonl"));
    succeeds(&mut corpus(&plain, &["--limit", "2"]));
    succeeds(&mut corpus(&bos, &["--bos"]));
    let first: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&plain)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let sha = {
        use sha2::Digest;
        format!("{:x}", sha2::Sha256::digest(std::fs::read(&m).unwrap()))
    };
    assert_eq!(first["model_sha256"], sha.as_str());
    assert_eq!(first["bos"], false);
    assert_eq!(first["precision"], "exact");
    assert_eq!(first["attnscope_version"], env!("CARGO_PKG_VERSION"));
    // resuming the no-BOS file with --bos: refused, the file untouched
    let before = std::fs::read_to_string(&plain).unwrap();
    let err = fails_with(&mut corpus(&plain, &["--bos"]), 2);
    assert!(
        err.contains("bos false") && err.contains("bos true"),
        "{err}"
    );
    assert_eq!(std::fs::read_to_string(&plain).unwrap(), before);
    // merging them: refused, naming both places
    let err = fails_with(
        attnscope().args(["corpus", "merge"]).arg(&plain).arg(&bos),
        2,
    );
    assert!(
        err.contains("bos.jsonl:1") && err.contains("plain.jsonl:1") && err.contains("bos true"),
        "{err}"
    );
    // one id, one text, other numbers (a record of the BOS run under the plain file's settings)
    let mut other: serde_json::Value = serde_json::from_str(
        std::fs::read_to_string(&bos)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    other["bos"] = serde_json::json!(false);
    let twin = dir.path().join("twin.jsonl");
    std::fs::write(
        &twin,
        format!(
            "{other}
"
        ),
    )
    .unwrap();
    let err = fails_with(
        attnscope().args(["corpus", "merge"]).arg(&plain).arg(&twin),
        2,
    );
    assert!(
        err.contains("twin.jsonl:1") && err.contains("other numbers"),
        "{err}"
    );
    // an older attnscope's record (no settings): told how to regenerate
    let mut old = first.clone();
    for k in ["model_sha256", "bos", "precision", "attnscope_version"] {
        old.as_object_mut().unwrap().remove(k);
    }
    let old_file = dir.path().join("old.jsonl");
    std::fs::write(
        &old_file,
        format!(
            "{old}
"
        ),
    )
    .unwrap();
    let err = fails_with(attnscope().args(["corpus", "merge"]).arg(&old_file), 2);
    assert!(
        err.contains("old.jsonl:1") && err.contains("regenerate"),
        "{err}"
    );
    let err = fails_with(&mut corpus(&old_file, &[]), 2);
    assert!(err.contains("regenerate"), "{err}");
}

/// examples/slurm: the array job's body run as Slurm would (3 tasks, one of them twice, as after a
/// requeue), then the dependent merge: the aggregate equals one process over all texts.
#[test]
fn slurm_array_shards_merge_to_the_single_run() {
    let dir = tempfile::tempdir().unwrap();
    let m = tiny_gguf(&dir);
    let texts = dir.path().join("texts.txt");
    std::fs::write(
        &texts,
        "the hat\nat the the\nhe sat\n\nthe the the at\nhat\nsat at the hat he\n",
    )
    .unwrap();
    let out = dir.path().join("out");
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/slurm");
    let bin = assert_cmd::cargo::cargo_bin("attnscope");
    let sh = |script: &str, task: Option<usize>| {
        let mut c = std::process::Command::new("bash");
        c.arg(root.join(script))
            .env("TEXTS", &texts)
            .env("MODEL", &m)
            .env("OUT", &out)
            .env("ATTNSCOPE", &bin)
            .env_remove("SLURM_CPUS_PER_TASK");
        if let Some(t) = task {
            c.env("SLURM_ARRAY_TASK_ID", t.to_string())
                .env("SLURM_ARRAY_TASK_COUNT", "3");
        }
        let o = c.output().unwrap();
        assert!(
            o.status.success(),
            "{script} {task:?}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
    };
    for t in [0, 1, 2, 1] {
        sh("corpus.sbatch", Some(t));
    }
    sh("merge.sbatch", None);
    let merged: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("aggregate.json")).unwrap())
            .unwrap();
    let single = run_json([
        "corpus",
        "--model",
        m.to_str().unwrap(),
        "--file",
        texts.to_str().unwrap(),
        "--json",
    ]);
    assert_eq!(single["sentences"], 6);
    assert_eq!(
        merged, single,
        "the merged shards must equal the single run"
    );
    // the requeued task added nothing: 6 records in all
    let records: usize = (0..3)
        .map(|t| {
            std::fs::read_to_string(out.join(format!("shard_{t}.jsonl")))
                .unwrap()
                .lines()
                .count()
        })
        .sum();
    assert_eq!(records, 6);
    // without TEXTS the script says what is missing
    let o = std::process::Command::new("bash")
        .arg(root.join("corpus.sbatch"))
        .env_remove("TEXTS")
        .output()
        .unwrap();
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("set TEXTS"));
}
