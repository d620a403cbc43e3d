//! `attnscope cache list|clear`: the packed-weight cache's files (`<cache>/panels`), and
//! removing them (all, or one model's).

use super::common::emit;
use attnscope::model::panels::{self, CacheFile};
use attnscope::render::table::{title, Align, Table};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Sub,
}

#[derive(clap::Subcommand, Debug)]
enum Sub {
    /// The cache's files, most recently used first: model, layout, size, last use, and the
    /// cap (ATTNSCOPE_PANEL_CACHE_MAX_GB) they share.
    List {
        /// Print JSON: the folder, the cap, the total and each file's model, layout and size.
        #[arg(long)]
        json: bool,
    },
    /// Remove the cache's files (they are rebuilt on the next load of each model).
    Clear {
        /// Only this model's files: an alias, a path to its file or folder (any path to the
        /// same file), or its name as `cache list` shows it.
        #[arg(long)]
        model: Option<String>,
        /// Print the removed files as JSON.
        #[arg(long)]
        json: bool,
    },
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

fn table(files: &[CacheFile]) -> String {
    let mut t = Table::new([
        ("model", Align::Left),
        ("layout", Align::Left),
        ("size", Align::Right),
        ("last used", Align::Left),
        ("usable", Align::Left),
        ("file", Align::Left),
    ]);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    for f in files {
        let age = now.saturating_sub(f.last_used);
        let ago = match age {
            0..=119 => format!("{age} s ago"),
            120..=7199 => format!("{} min ago", age / 60),
            7200..=172_799 => format!("{} h ago", age / 3600),
            _ => format!("{} days ago", age / 86_400),
        };
        t.row([
            if f.model.is_empty() {
                "?".into()
            } else {
                f.model.clone()
            },
            f.layout.clone(),
            format!("{:.1} MB", f.bytes as f64 / 1e6),
            ago,
            if f.usable { "yes" } else { "no (stale)" }.into(),
            f.path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
        ]);
    }
    t.render()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let dir = panels::dir_from_env();
    match a.cmd {
        Sub::List { json } => {
            let files = panels::list(&dir);
            let total: u64 = files.iter().map(|f| f.bytes).sum();
            let max = panels::max_bytes_from_env();
            let enabled = panels::Settings::from_env().is_some();
            if json {
                return emit(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "dir": dir,
                        "enabled": enabled,
                        "max_bytes": max,
                        "total_bytes": total,
                        "files": files,
                    }))?
                ));
            }
            let mut s = title(&format!("The packed-weight cache, {}", dir.display()));
            s += &format!(
                "{} files, {} of a {} cap (ATTNSCOPE_PANEL_CACHE_MAX_GB){}; the least recently used go first\n\n",
                files.len(),
                gib(total),
                gib(max),
                if enabled {
                    ""
                } else {
                    "; the cache is off (ATTNSCOPE_PANEL_CACHE)"
                }
            );
            if !files.is_empty() {
                s += &table(&files);
            }
            emit(&s)
        }
        Sub::Clear { model, json } => {
            let removed = panels::clear(&dir, model.as_deref())
                .map_err(|e| anyhow::anyhow!("removing files from {}: {e}", dir.display()))?;
            let total: u64 = removed.iter().map(|f| f.bytes).sum();
            if json {
                return emit(&format!(
                    "{}\n",
                    serde_json::to_string_pretty(&serde_json::json!({
                        "dir": dir,
                        "removed": removed,
                        "removed_bytes": total,
                    }))?
                ));
            }
            if removed.is_empty() {
                if let Some(m) = &model {
                    eprintln!("attnscope: note: no file of the cache belongs to `{m}`; `attnscope cache list` shows the models it holds");
                }
            }
            let mut s = format!(
                "removed {} files ({}) from {}\n",
                removed.len(),
                gib(total),
                dir.display()
            );
            if !removed.is_empty() {
                s += &table(&removed);
            }
            emit(&s)
        }
    }
}
