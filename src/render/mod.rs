//! Renderers: they format what the analyses computed; no maths here.
pub mod capture;
pub mod compare_page;
pub mod direct;
pub mod gen_attribute;
pub mod heatmap;
pub mod html;
pub mod npy;
pub mod patch_page;
pub mod progress;
pub mod report;
pub mod sparse;
pub mod table;
pub mod tensorfile;
pub mod view;

use anyhow::Context;
use std::io::Write;
use std::path::Path;

/// How `inspect` and `capture` end their output with their own timings: `(load X s, what Y s`
/// (the caller closes the parenthesis); `bench` reads them back with the same words.
pub fn timings_opening(load_s: f64, what: &str, after_s: f64) -> String {
    format!("(load {load_s:.2} s, {what} {after_s:.3} s")
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename, so a
/// reader never sees half a file; refuses to replace an existing file unless `force`.
pub fn write_new_file(path: &Path, bytes: &[u8], force: bool) -> anyhow::Result<()> {
    if path.exists() && !force {
        return Err(anyhow::Error::new(crate::model::Error::Exists {
            path: path.into(),
        }));
    }
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".into());
    let tmp = dir.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", path.display()));
    }
    Ok(())
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
        assert_eq!(std::fs::read(&p).unwrap(), b"one");
        write_new_file(&p, b"two", true).unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::read_dir(d.path()).unwrap().count(),
            1,
            "no temporary file left behind"
        );
    }
}
