//! The `attnscope patch --html` page: one self-contained file (style, script and the report
//! inline, no network). The heatmap of the share of the logit difference each patched activation
//! restores (layers × positions for `resid_pre`/`attn_out`/`mlp_out`, layers × heads for
//! `z`/`pattern`) is written as a table, so it reads without the script; the script shows a
//! clicked cell's numbers.

use super::html::html_escape as esc;
use crate::analysis::intervene::PatchReport;
use crate::analysis::vocab::{PatchCell, TokenRef};
use crate::model::tokenize::visible;

const STYLE: &str = r#"
  body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #222; background: #fafafa; }
  header { padding: 10px 16px; background: #23395d; color: #fff; }
  header h1 { font-size: 18px; margin: 0 0 4px; }
  header .facts { font-size: 13px; opacity: .9; }
  main { padding: 16px; display: grid; gap: 16px; }
  section { background: #fff; border: 1px solid #dde2ea; border-radius: 6px; padding: 10px 12px; overflow: auto; min-width: 0; }
  section h2 { font-size: 15px; margin: 0 0 8px; }
  table { border-collapse: collapse; font-size: 12px; }
  th, td { padding: 2px 6px; text-align: left; white-space: nowrap; }
  .note { font-size: 12px; color: #555; }
  .tok { white-space: pre; font-family: ui-monospace, monospace; }
  .diff { color: #b2182b; font-weight: bold; }
  #grid table { border-collapse: separate; border-spacing: 2px; }
  #grid th { font-weight: normal; font-size: 11px; color: #444; text-align: center; vertical-align: bottom; }
  #grid th.row { text-align: right; }
  #grid td.c { min-width: 34px; height: 20px; padding: 0 2px; text-align: center; font-size: 10px; font-variant-numeric: tabular-nums; cursor: pointer; border: 2px solid transparent; border-radius: 2px; }
  #grid td.c.sel { border-color: #222; }
  .legend { display: flex; align-items: center; gap: 6px; font-size: 11px; margin-top: 8px; }
  .legend .bar { width: 180px; height: 12px; border: 1px solid #ccc; }
  #detail table td:first-child { color: #555; }
  #detail table td.num { text-align: right; font-variant-numeric: tabular-nums; }
"#;

const SCRIPT: &str = r##"
"use strict";
const R = JSON.parse(document.getElementById("report").textContent);
const esc = (s) => String(s).replace(/[&<>"]/g, (c) => ({"&":"&amp;","<":"&lt;",">":"&gt;","\"":"&quot;"}[c]));
const vis = (t) => t.replace(/^ /, "␣").replace(/\n/g, "\\n");
const signed = (v, d) => (v >= 0 ? "+" : "") + v.toFixed(d);
function show(i) {
  const c = R.results[i], d = document.getElementById("detail");
  let at;
  if (c.head !== undefined) at = `<tr><td>head</td><td class="num">${c.head}</td></tr>`;
  else {
    const a = R.clean[c.pos], b = R.corrupt[c.pos];
    at = `<tr><td>position</td><td class="num">${c.pos}</td></tr><tr><td>clean token</td><td><span class="tok">${esc(vis(a.text))}</span> (id ${a.id})</td></tr><tr><td>corrupted token</td><td><span class="tok">${esc(vis(b.text))}</span> (id ${b.id})${a.id !== b.id ? ' <span class="diff">differs</span>' : ""}</td></tr>`;
  }
  d.innerHTML = `<table><tr><td>patched</td><td class="num">${esc(R.hook)}</td></tr><tr><td>layer</td><td class="num">${c.layer}</td></tr>${at}` +
    `<tr><td>logit difference, patched run</td><td class="num" data-v="logit_diff">${signed(c.logit_diff, 4)}</td></tr>` +
    `<tr><td>clean / corrupted run</td><td class="num">${signed(R.clean_logit_diff, 4)} / ${signed(R.corrupt_logit_diff, 4)}</td></tr>` +
    `<tr><td>recovered (patched − corrupt) / (clean − corrupt)</td><td class="num" data-v="recovered"><b>${c.recovered.toFixed(4)}</b></td></tr></table>`;
  d.dataset.index = i;
  d.dataset.layer = c.layer;
  if (c.head !== undefined) d.dataset.head = c.head; else delete d.dataset.head;
  if (c.pos !== undefined) d.dataset.pos = c.pos; else delete d.dataset.pos;
  d.dataset.logitDiff = c.logit_diff;
  d.dataset.recovered = c.recovered;
  document.querySelectorAll("#grid td.sel").forEach((e) => e.classList.remove("sel"));
  document.querySelector(`#grid td[data-i='${i}']`).classList.add("sel");
}
document.getElementById("grid").addEventListener("click", (e) => {
  const td = e.target.closest("td[data-i]");
  if (td) show(+td.dataset.i);
});
let best = 0;
R.results.forEach((c, i) => { if (c.recovered > R.results[best].recovered) best = i; });
if (R.results.length) show(best);
window.attnscope = { show, report: R };
document.body.dataset.ready = "1";
"##;

/// The colour of a recovered share: white at 0, blue towards 1 (the clean run's difference
/// restored), red towards −1; beyond ±1 as at ±1.
fn shade(v: f32) -> (String, bool) {
    let t = if v.is_finite() { v.abs().min(1.0) } else { 0.0 };
    let c: [f32; 3] = if v < 0.0 {
        [178.0, 24.0, 43.0]
    } else {
        [33.0, 102.0, 172.0]
    };
    let [r, g, b] = c.map(|x| (255.0 + (x - 255.0) * t).round() as u8);
    (format!("rgb({r},{g},{b})"), t > 0.55)
}

fn token(t: &TokenRef) -> String {
    format!("<span class=\"tok\">{}</span>", esc(&visible(&t.text)))
}

fn joined(ts: &[TokenRef]) -> String {
    esc(&ts.iter().map(|t| t.text.as_str()).collect::<String>())
}

/// Where a cell stands: (layer, column).
fn column(c: &PatchCell) -> usize {
    c.head.or(c.pos).unwrap_or(0)
}

/// The patch page for `r` (see the module's note).
pub fn patch_page(r: &PatchReport) -> String {
    let per_head = r.results.iter().any(|c| c.head.is_some());
    let layers = r.results.iter().map(|c| c.layer + 1).max().unwrap_or(0);
    let cols = r.results.iter().map(|c| column(c) + 1).max().unwrap_or(0);
    let mut at = vec![None; layers * cols];
    for (i, c) in r.results.iter().enumerate() {
        at[c.layer * cols + column(c)] = Some(i);
    }
    let title = format!("attnscope patch · {} · {}", r.hook, r.model);
    let mut s = String::with_capacity(4096 + r.results.len() * 200);
    s += "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n";
    s += "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n";
    s += &format!(
        "<title>{}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n",
        esc(&title)
    );
    s += &format!(
        "<header><h1 id=\"title\">Activation patching: {}</h1><div class=\"facts\" id=\"facts\">{} · {} tokens · {} layers × {} {}</div></header>\n<main>\n",
        esc(&r.hook),
        esc(&r.model),
        r.clean.len(),
        layers,
        cols,
        if per_head { "heads" } else { "positions" }
    );
    s += &summary(r);
    // the heatmap
    s += &format!(
        "<section id=\"map\"><h2>Share of the logit difference restored, {} of the corrupted run taken from the clean run</h2>",
        esc(&r.hook)
    );
    s += &format!(
        "<p class=\"note\">Each cell: (patched − corrupt) / (clean − corrupt) for {}; 1 restores the clean run's difference, 0 changes nothing. Hover a cell for its numbers, click it to show them below.</p>",
        if per_head {
            "one head of one layer (its value at every position)"
        } else {
            "one layer at one position (the corrupted run recomputed from there)"
        }
    );
    s += &grid(r, &at, layers, cols, per_head);
    s += "</table></div>";
    let (lo, _) = shade(-1.0);
    let (hi, _) = shade(1.0);
    s += &format!(
        "<div class=\"legend\" id=\"legend\"><span>−1</span><span class=\"bar\" style=\"background:linear-gradient(to right, {lo}, #fff, {hi})\"></span><span>+1 recovered (beyond ±1 as at ±1)</span></div></section>\n"
    );
    s += "<section id=\"cell\"><h2>Selected cell</h2><div id=\"detail\" class=\"note\">Click a cell of the map.</div></section>\n</main>\n";
    // the report, for the script: every `<` written \u003c so no text ends the element
    let json = serde_json::to_string(r)
        .expect("the patch report serializes")
        .replace('<', "\\u003c");
    s += &format!("<script type=\"application/json\" id=\"report\">{json}</script>\n");
    s += &format!("<script>{SCRIPT}</script>\n</body>\n</html>\n");
    s
}

/// The summary: the two texts, the answer and the wrong token, the two logit differences and
/// the work done.
fn summary(r: &PatchReport) -> String {
    let mut s = String::new();
    s += "<section id=\"summary\"><h2>Clean and corrupted runs</h2><table>";
    s += &format!(
        "<tr><td>clean text</td><td class=\"tok\">{}</td></tr><tr><td>corrupted text</td><td class=\"tok\">{}</td></tr>",
        joined(&r.clean),
        joined(&r.corrupt)
    );
    s += &format!(
        "<tr><td>answer</td><td>{} (id {})</td></tr><tr><td>wrong</td><td>{} (id {})</td></tr>",
        token(&r.answer),
        r.answer.id,
        token(&r.wrong),
        r.wrong.id
    );
    s += &format!(
        "<tr><td>logit difference answer − wrong at the last position</td><td>clean <b id=\"clean-diff\">{:+.4}</b>, corrupted <b id=\"corrupt-diff\">{:+.4}</b></td></tr></table>",
        r.clean_logit_diff, r.corrupt_logit_diff
    );
    s += &format!(
        "<p class=\"note\">{} forward passes; {} layer-position rows computed ({:.0}% of running each patch from scratch).</p></section>\n",
        r.forward_passes,
        r.layer_rows,
        100.0 * r.layer_rows as f64 / r.layer_rows_from_scratch.max(1) as f64
    );
    s
}

/// The heatmap's table: a column per head or position (the corrupted token under the clean one
/// where they differ), a row per layer, each cell shaded by its share recovered; `at` is the
/// result index of each (layer, column).
fn grid(
    r: &PatchReport,
    at: &[Option<usize>],
    layers: usize,
    cols: usize,
    per_head: bool,
) -> String {
    let mut s = String::new();
    s += "<div id=\"grid\"><table><tr><th></th>";
    for col in 0..cols {
        if per_head {
            s += &format!("<th>h{col}</th>");
        } else {
            let (a, b) = (&r.clean[col], &r.corrupt[col]);
            s += &format!("<th title=\"position {col}\">{col}<br>{}", token(a));
            if a.id != b.id {
                s += &format!("<br><span class=\"diff\">{}</span>", token(b));
            }
            s += "</th>";
        }
    }
    s += "</tr>\n";
    for l in 0..layers {
        s += &format!("<tr><th class=\"row\">L{l}</th>");
        for col in 0..cols {
            let Some(i) = at[l * cols + col] else {
                s += "<td></td>";
                continue;
            };
            let c = &r.results[i];
            let (bg, dark) = shade(c.recovered);
            let place = match (c.pos, c.head) {
                (Some(p), _) => format!(
                    "position {p} ({:?} / {:?})",
                    visible(&r.clean[p].text),
                    visible(&r.corrupt[p].text)
                ),
                (_, Some(h)) => format!("head {h}"),
                _ => String::new(),
            };
            let tip = format!(
                "layer {}, {place}: recovered {:.4}, logit difference {:+.4}",
                c.layer, c.recovered, c.logit_diff
            );
            s += &format!(
                "<td class=\"c\" data-i=\"{i}\" data-l=\"{}\" data-{}=\"{}\" data-recovered=\"{}\" style=\"background:{bg};color:{}\" title=\"{}\">{:.2}</td>",
                c.layer,
                if per_head { "h" } else { "p" },
                column(c),
                c.recovered,
                if dark { "#fff" } else { "#222" },
                esc(&tip),
                c.recovered
            );
        }
        s += "</tr>\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(id: u32, text: &str) -> TokenRef {
        TokenRef {
            id,
            text: text.into(),
        }
    }

    fn report(per_head: bool) -> PatchReport {
        let results = (0..2)
            .flat_map(|l| {
                (0..3).map(move |k| PatchCell {
                    layer: l,
                    pos: (!per_head).then_some(k),
                    head: per_head.then_some(k),
                    logit_diff: 0.5 * k as f32 - l as f32,
                    recovered: 0.25 * (l * 3 + k) as f32 - 0.5,
                })
            })
            .collect();
        PatchReport {
            model: "m<b>".into(),
            hook: "hook_resid_pre".into(),
            clean: vec![tok(1, "a</script>"), tok(2, " <!--b"), tok(3, "c")],
            corrupt: vec![tok(1, "a</script>"), tok(4, " &d"), tok(3, "c")],
            answer: tok(5, " Alice"),
            wrong: tok(6, " \"Bob\""),
            clean_logit_diff: 2.0,
            corrupt_logit_diff: -1.0,
            results,
            forward_passes: 3,
            layer_rows: 10,
            layer_rows_from_scratch: 20,
            warnings: Vec::new(),
        }
    }

    #[test]
    fn every_cell_is_on_the_page_and_token_text_is_escaped() {
        for per_head in [false, true] {
            let r = report(per_head);
            let html = patch_page(&r);
            for (i, c) in r.results.iter().enumerate() {
                assert!(
                    html.contains(&format!("data-i=\"{i}\" data-l=\"{}\"", c.layer))
                        && html.contains(&format!("data-recovered=\"{}\"", c.recovered)),
                    "cell {i}"
                );
            }
            assert!(!html.contains("a</script>") && !html.contains("<!--b"));
            assert!(!html.contains("m<b>") && html.contains("&amp;d"));
            assert!(html.contains("a\\u003c/script>"), "the JSON keeps the text");
            assert_eq!(html.matches("id=\"detail\"").count(), 1);
            assert_eq!(html.contains(">h2</th>"), per_head);
            for bad in [
                "src=\"http",
                "href=\"http",
                "<link",
                "@import",
                "<script src",
            ] {
                assert!(!html.contains(bad), "no network ({bad})");
            }
            // the ids are unique
            let mut ids: Vec<&str> = html
                .split(" id=\"")
                .skip(1)
                .map(|p| &p[..p.find('"').unwrap()])
                .collect();
            let all = ids.len();
            ids.sort_unstable();
            ids.dedup();
            assert_eq!(ids.len(), all, "{ids:?}");
        }
    }

    #[test]
    fn shades_diverge_from_white() {
        assert_eq!(shade(0.0).0, "rgb(255,255,255)");
        assert_eq!(shade(1.0).0, "rgb(33,102,172)");
        assert_eq!(shade(-3.0).0, "rgb(178,24,43)");
        assert_eq!(shade(f32::NAN).0, "rgb(255,255,255)");
    }
}
