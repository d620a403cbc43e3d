//! The terminal text of `attnscope inspect`.

use super::table::{bar, mask_grid, sparkline, title, Align, Table};
use crate::analysis::inspect::{InspectReport, LayerRow, NormEntry};
use crate::analysis::vocab::TopEntry;
use crate::model::tokenize::visible;

fn top_cell(t: &TopEntry) -> String {
    format!("{} {} {:.4}", t.pos, quoted(&t.token), t.weight)
}

fn norm_cell(t: &NormEntry) -> String {
    format!(
        "{} {} {:.3} ({:.0}%)",
        t.pos,
        quoted(&t.token),
        t.norm,
        t.share * 100.0
    )
}

/// Section 6: norm-based attention, per head of the chosen layer and per chosen layer.
fn norm_section(r: &InspectReport, qtok: &str, first: &str, chosen: &[&LayerRow]) -> String {
    let mut s = title(&format!(
        "6. What each key moves into query {} {qtok}: norm-based attention α·‖W_O v‖",
        r.query
    ));
    let k = r.heads.first().map(|h| h.norm_top.len()).unwrap_or(0);
    s += &format!(
        "Layer {}, per head (share of the row's total in brackets):\n",
        r.layer
    );
    let mut hdr: Vec<(String, Align)> = vec![("head".into(), Align::Right)];
    for i in 0..k {
        hdr.push((format!("top {} by norm", i + 1), Align::Left));
    }
    hdr.extend([
        (format!("{first} weight"), Align::Right),
        ("‖f(x)‖".into(), Align::Right),
        ("norm share".into(), Align::Right),
    ]);
    let mut t = Table::new(hdr);
    for h in &r.heads {
        let mut row = vec![h.head.to_string()];
        row.extend(h.norm_top.iter().map(norm_cell));
        row.extend([
            format!("{:.4}", h.first_key.weight),
            format!("{:.3}", h.first_key.value_norm.unwrap_or(f32::NAN)),
            format!("{:.1}%", h.first_key.norm_share * 100.0),
        ]);
        t.row(row);
    }
    s += &t.render();
    let k = chosen
        .first()
        .and_then(|l| l.norm_top.as_ref())
        .map(|t| t.len())
        .unwrap_or(0);
    s += "All heads together, ‖Σₕ αʰ·W_Oʰ vⱼ‖ (what key j moves through the layer):\n";
    let mut hdr: Vec<(String, Align)> = vec![("layer".into(), Align::Right)];
    for i in 0..k {
        hdr.push((format!("top {} by norm", i + 1), Align::Left));
    }
    hdr.extend([
        (format!("{first} weight"), Align::Right),
        ("norm share".into(), Align::Right),
    ]);
    let mut t = Table::new(hdr);
    for l in chosen {
        let (Some(top), Some(f)) = (&l.norm_top, &l.first_key) else {
            continue;
        };
        let mut row = vec![l.layer.to_string()];
        row.extend(top.iter().map(norm_cell));
        row.extend([
            format!("{:.1}%", f.weight * 100.0),
            format!("{:.1}%", f.norm_share * 100.0),
        ]);
        t.row(row);
    }
    s += &t.render();
    s += &format!(
        "f(x) = W_O·(W_V x + b_V) per head (Kobayashi et al. 2020). A weight says where a head looks; the norm says how much it moves: the first token {first} often takes most of the weight with a small ‖f(x)‖.\n\n"
    );
    s
}

fn quoted(s: &str) -> String {
    format!("\"{}\"", visible(s))
}

/// Renders the report; `mask_tokens` caps the causal-mask grid.
pub fn render(r: &InspectReport, mask_tokens: usize) -> String {
    let m = &r.model;
    let n = r.tokens.len();
    let mut s = String::new();
    s += &title(&format!("1. Model: {}", m.name));
    if let Some(d) = &m.description {
        s += &format!("{d}\n");
    }
    s += &format!(
        "arch {} · {} layers · {} query heads · {} KV heads: {} · head dim {} (d_model {} / {} heads) · precision {}\n\n",
        m.arch, m.n_layers, m.n_heads, m.n_kv_heads, m.gqa, m.head_dim, m.d_model, m.n_heads, m.precision
    );
    s += &title(&format!("2. Tokens ({n})"));
    let mut t = Table::new([
        ("pos", Align::Right),
        ("id", Align::Right),
        ("token", Align::Left),
    ]);
    for tok in &r.tokens {
        t.row([tok.pos.to_string(), tok.id.to_string(), visible(&tok.text)]);
    }
    s += &t.render();
    s += "␣ marks a leading space; <e1 bb> are bytes of a character split across tokens.\n\n";
    let k = n.min(mask_tokens);
    s += &title(&format!("3. Causal mask (first {k} of {n} tokens)"));
    let labels: Vec<String> = r.tokens[..k]
        .iter()
        .map(|t| format!("{}:{}", t.pos, visible(&t.text)))
        .collect();
    s += &mask_grid(&labels);
    s += "\n";
    let qtok = quoted(&r.tokens[r.query].text);
    s += &heads_section(r, &qtok);
    let chosen: Vec<&LayerRow> = r.layers.iter().filter(|l| l.top.is_some()).collect();
    s += &layers_section(r, &qtok, &chosen);
    let first = quoted(&r.tokens[0].text);
    s += &norm_section(r, &qtok, &first, &chosen);
    s += &sink_section(r, &first);
    s += &answer_section(r);
    s += &title("9. Caution");
    s += &format!("{}\n", r.caution);
    s
}

/// Section 4: the chosen layer's heads, each head's top keys for the query, max and entropy.
fn heads_section(r: &InspectReport, qtok: &str) -> String {
    let mut s = String::new();
    let top_n = r.heads.first().map(|h| h.top.len()).unwrap_or(0);
    s += &title(&format!(
        "4. Layer {}, query {} {qtok}: top {top_n} keys of each head",
        r.layer, r.query
    ));
    let mut hdr: Vec<(String, Align)> = vec![
        ("head".into(), Align::Right),
        ("kv set".into(), Align::Right),
    ];
    for i in 0..top_n {
        hdr.push((format!("top {}", i + 1), Align::Left));
    }
    hdr.extend([
        ("max".to_string(), Align::Right),
        ("entropy".to_string(), Align::Right),
        ("".to_string(), Align::Left),
    ]);
    let mut t = Table::new(hdr);
    for h in &r.heads {
        let mut row = vec![h.head.to_string(), h.kv_head.to_string()];
        row.extend(h.top.iter().map(top_cell));
        row.extend([
            format!("{:.4}", h.max_weight),
            format!("{:.4}", h.entropy),
            if h.concentrated {
                "◀ concentrated".into()
            } else {
                String::new()
            },
        ]);
        t.row(row);
    }
    s += &t.render();
    s += "entropy in nats (0 = all weight on one token; ln n = spread evenly). ◀ marks a head with max weight ≥ 0.9.\n\n";
    s
}

/// Section 5: the head-averaged top keys of the query in each of the `chosen` layers.
fn layers_section(r: &InspectReport, qtok: &str, chosen: &[&LayerRow]) -> String {
    let mut s = String::new();
    let k = chosen
        .first()
        .and_then(|l| l.top.as_ref())
        .map(|t| t.len())
        .unwrap_or(0);
    s += &title(&format!(
        "5. Head-averaged top {k} keys of query {} {qtok}",
        r.query
    ));
    let mut hdr: Vec<(String, Align)> = vec![("layer".into(), Align::Right)];
    for i in 0..k {
        hdr.push((format!("top {}", i + 1), Align::Left));
    }
    let mut t = Table::new(hdr);
    for l in chosen {
        let mut row = vec![l.layer.to_string()];
        row.extend(
            l.top
                .as_ref()
                .expect("chosen layers have top")
                .iter()
                .map(top_cell),
        );
        t.row(row);
    }
    s += &t.render();
    s += "\n";
    s
}

/// Section 7: the attention sink per layer (the query's and all queries'), its peaks and
/// largest rise, what a sliding window does to it, and its sparklines.
fn sink_section(r: &InspectReport, first: &str) -> String {
    let m = &r.model;
    let mut s = String::new();
    s += &title(&format!(
        "7. Attention sink: share of attention on the first token {first}, averaged over heads"
    ));
    let (pq, pa) = (&r.sink.query, &r.sink.all_queries);
    let mut t = Table::new([
        ("layer", Align::Right),
        (format!("query {}", r.query).as_str(), Align::Right),
        ("", Align::Left),
        ("all queries", Align::Right),
        ("", Align::Left),
        ("", Align::Left),
    ]);
    for l in &r.layers {
        let mut mark = Vec::new();
        if l.layer == pa.peak_layer {
            mark.push("▲ peak (all queries)".to_string());
        }
        if l.layer == pq.peak_layer {
            mark.push(format!("▲ peak (query {})", r.query));
        }
        if let Some((a, b, rise)) = pa.largest_jump {
            if l.layer == b {
                mark.push(format!("↑ largest rise, +{rise:.3} from layer {a}"));
            }
        }
        t.row([
            l.layer.to_string(),
            format!("{:.4}", l.sink_query),
            bar(l.sink_query, 20),
            format!("{:.4}", l.sink_all_queries),
            bar(l.sink_all_queries, 20),
            mark.join(", "),
        ]);
    }
    s += &t.render();
    if let (Some(w), false) = (m.sliding_window, m.windowed_layers.is_empty()) {
        let which = if m.windowed_layers.len() == m.n_layers {
            "Every layer has".to_string()
        } else {
            let list: Vec<String> = m.windowed_layers.iter().map(|l| l.to_string()).collect();
            format!("Layers {} have", list.join(", "))
        };
        s += &if r.query >= w {
            format!("{which} a sliding window of {w} tokens: there query {} cannot see the first token {first}, so its share is 0 by construction, and over all queries only the first {w} see it.\n", r.query)
        } else {
            format!("{which} a sliding window of {w} tokens: query {} still sees the first token {first}; there, queries from position {w} on do not.\n", r.query)
        };
    }
    let sq: Vec<f32> = r.layers.iter().map(|l| l.sink_query).collect();
    let sa: Vec<f32> = r.layers.iter().map(|l| l.sink_all_queries).collect();
    s += &format!(
        "query {:>3}    {}\nall queries  {}\n",
        r.query,
        sparkline(&sq),
        sparkline(&sa)
    );
    s += &format!(
        "peak: layer {} ({:.4}) over all queries, layer {} ({:.4}) for query {}; mean of the middle layers {}-{}: {:.4} (all queries), {:.4} (query {})\n\n",
        pa.peak_layer,
        pa.peak,
        pq.peak_layer,
        pq.peak,
        r.query,
        pa.middle_layers.0,
        pa.middle_layers.1,
        pa.middle_mean,
        pq.middle_mean,
        r.query
    );
    s
}

/// Section 8: the model's answer, the next-token candidates.
fn answer_section(r: &InspectReport) -> String {
    let mut s = String::new();
    s += &title(&format!(
        "8. The model's answer: next token after position {}",
        r.query
    ));
    let mut t = Table::new([
        ("rank", Align::Right),
        ("id", Align::Right),
        ("token", Align::Left),
        ("prob", Align::Right),
        ("logit", Align::Right),
        ("", Align::Left),
    ]);
    for (i, c) in r.next_token.iter().enumerate() {
        t.row([
            (i + 1).to_string(),
            c.id.to_string(),
            quoted(&c.token),
            format!("{:.4}", c.prob),
            format!("{:.4}", c.logit),
            bar(c.prob, 20),
        ]);
    }
    s += &t.render();
    s += "\n";
    s
}
