//! `attnscope explain`: one attention step, printed so a student can redo it on paper.

use super::common::{emit, usage};
use crate::reference::walkthrough::{head_split, walkthrough, Walkthrough};
use crate::reference::{dot, saturation};
use crate::render::table::{mask_grid, title, Align, Table};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The words, one position each (split on whitespace).
    #[arg(long, default_value = "Hà Nội là thủ đô")]
    text: String,
    /// Width of the vectors (and of the one head): q, k, v have d numbers each.
    #[arg(long, default_value_t = 4)]
    d: usize,
    /// Seed of the small one-decimal inputs and weights.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Query heads, for the multi-head / GQA split (default: Qwen2.5-0.5B).
    #[arg(long, default_value_t = 14)]
    heads: usize,
    /// Key/value heads shared by the query heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Model width split among the heads.
    #[arg(long, default_value_t = 896)]
    d_model: usize,
    /// Print every matrix as one JSON document instead.
    #[arg(long)]
    json: bool,
    /// The lesson's last chapter instead: a toy RNN against a toy attention layer over n tokens
    /// (sequential steps, path length, and the gradient of the last output with respect to the
    /// first input, measured).
    #[arg(long)]
    rnn: bool,
    /// Sequence lengths for --rnn.
    #[arg(long, default_value = "4,16,64,256,512", requires = "rnn")]
    lengths: String,
    /// Spectral radius of the RNN's recurrent matrix for --rnn (W = rho · orthogonal).
    #[arg(long, default_value_t = 0.9, requires = "rnn")]
    rho: f64,
}

/// `explain --rnn`: the table of the lesson's last chapter.
fn rnn(a: &Args) -> anyhow::Result<()> {
    let ns: Vec<usize> = a
        .lengths
        .split(',')
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| (2..=4096).contains(&n))
        })
        .collect::<Option<_>>()
        .ok_or_else(|| {
            usage(format!(
                "--lengths {} must be a list of lengths in 2..=4096, e.g. 4,16,64",
                a.lengths
            ))
        })?;
    if !(a.rho > 0.0 && a.rho <= 2.0) {
        return Err(usage(format!(
            "--rho {} is out of range: use 0 < rho <= 2",
            a.rho
        )));
    }
    let d = a.d.clamp(2, 64);
    let rows = crate::reference::rnn::compare(&ns, d, a.rho, a.seed);
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(
                &serde_json::json!({"d": d, "rho": a.rho, "seed": a.seed, "rows": rows})
            )?
        ));
    }
    let mut s = crate::render::table::title(
        "Why attention replaced recurrent networks (toy RNN against toy attention, measured)",
    );
    s += &format!("width d = {d}; RNN h_t = tanh(W h_(t-1) + U x_t) with W = {} · orthogonal; attention y = Σ α_nj W_V x_j; seed {}\n", a.rho, a.seed);
    s += "‖∂y/∂x₁‖: how much the last output still depends on the first token (chain rule, exact)\n\n";
    let mut t = crate::render::table::Table::new([
        ("n", crate::render::table::Align::Right),
        (
            "sequential steps RNN / attn",
            crate::render::table::Align::Right,
        ),
        ("path x₁→y RNN / attn", crate::render::table::Align::Right),
        ("‖∂y/∂x₁‖ RNN (tanh)", crate::render::table::Align::Right),
        ("linear RNN", crate::render::table::Align::Right),
        ("= rhoⁿ⁻¹‖U‖", crate::render::table::Align::Right),
        ("attention", crate::render::table::Align::Right),
    ]);
    for r in &rows {
        t.row([
            r.n.to_string(),
            format!(
                "{} / {}",
                r.rnn_sequential_steps, r.attention_sequential_steps
            ),
            format!("{} / {}", r.rnn_path_length, r.attention_path_length),
            format!("{:.3e}", r.rnn_tanh_gradient),
            format!("{:.3e}", r.rnn_linear_gradient),
            format!("{:.3e}", r.rnn_linear_closed_form),
            format!("{:.3e}", r.attention_gradient),
        ]);
    }
    s += &t.render();
    s += "\nThe RNN must run its n steps one after another, and the first token's influence passes through n - 1\n";
    s += "Jacobians, so it shrinks geometrically (exactly rhoⁿ⁻¹ for the linear RNN). Attention reaches every token\n";
    s += "in one step of one matmul: the first token's gradient shrinks at most with its attention weight.\n";
    emit(&s)
}

fn num(x: f32, decimals: usize) -> String {
    if x == f32::NEG_INFINITY {
        "-inf".into()
    } else {
        format!("{x:.decimals$}")
    }
}

fn matrix(
    name: &str,
    what: &str,
    m: &[f32],
    row_labels: &[String],
    col_labels: &[String],
    decimals: usize,
) -> String {
    let cols = col_labels.len();
    let mut t = Table::new(
        std::iter::once((String::new(), Align::Left))
            .chain(col_labels.iter().map(|c| (c.clone(), Align::Right))),
    );
    for (label, r) in row_labels.iter().zip(m.chunks(cols)) {
        t.row(std::iter::once(label.clone()).chain(r.iter().map(|&x| num(x, decimals))));
    }
    format!(
        "{name} ({} × {cols}): {what}\n{}\n",
        row_labels.len(),
        t.render()
    )
}

fn json_matrix(m: &[f32], cols: usize) -> serde_json::Value {
    json!(m
        .chunks(cols)
        .map(|r| r
            .iter()
            .map(|&x| if x == f32::NEG_INFINITY {
                json!("-inf")
            } else {
                json!(x)
            })
            .collect::<Vec<_>>())
        .collect::<Vec<_>>())
}

/// The "why √d" measurement: (d, scaled max, scaled entropy, unscaled max, unscaled entropy).
fn sqrt_d_rows(n_keys: usize) -> Vec<(usize, f32, f32, f32, f32)> {
    [4usize, 64, 1024]
        .iter()
        .map(|&d| {
            let (sm, se) = saturation(d, n_keys, 500, true, 42);
            let (um, ue) = saturation(d, n_keys, 500, false, 42);
            (d, sm, se, um, ue)
        })
        .collect()
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if a.rnn {
        return rnn(&a);
    }
    let words: Vec<String> = a.text.split_whitespace().map(String::from).collect();
    if words.is_empty() {
        return Err(usage(
            "--text has no words; give a few words separated by spaces",
        ));
    }
    if words.len() > 64 {
        return Err(usage(format!(
            "--text has {} words; explain is for working by hand, use at most 64",
            words.len()
        )));
    }
    if a.d == 0 || a.d > 64 {
        return Err(usage(format!(
            "--d {} is out of range: use 1..=64 (a width you can follow by hand)",
            a.d
        )));
    }
    let split = head_split(a.d_model, a.heads, a.kv_heads).map_err(usage)?;
    let w = walkthrough(&words, a.d, a.seed);
    let sat = sqrt_d_rows(16);
    if a.json {
        let d = a.d;
        let doc = json!({
            "words": w.words, "d": d, "seed": a.seed,
            "X": json_matrix(&w.x, d), "W_Q": json_matrix(&w.w_q, d), "W_K": json_matrix(&w.w_k, d), "W_V": json_matrix(&w.w_v, d),
            "Q": json_matrix(&w.q, d), "K": json_matrix(&w.k, d), "V": json_matrix(&w.v, d),
            "raw_scores": json_matrix(&w.steps.raw_scores, words.len()),
            "scale": 1.0 / (d as f64).sqrt(),
            "scaled_scores": json_matrix(&w.steps.scaled_scores, words.len()),
            "masked_scores": json_matrix(&w.steps.masked_scores, words.len()),
            "weights": json_matrix(&w.steps.pattern, words.len()),
            "Y": json_matrix(&w.steps.out, d),
            "mask": (0..words.len()).map(|i| (0..words.len()).map(|j| j <= i).collect::<Vec<_>>()).collect::<Vec<_>>(),
            "sqrt_d": sat.iter().map(|&(d, sm, se, um, ue)| json!({"d": d, "scaled": {"max_weight": sm, "entropy": se}, "unscaled": {"max_weight": um, "entropy": ue}})).collect::<Vec<_>>(),
            "heads": {"d_model": a.d_model, "n_heads": a.heads, "n_kv_heads": a.kv_heads, "head_dim": a.d_model / a.heads,
                      "kv_set_of_head": (0..a.heads).map(|h| crate::reference::kv_head(h, a.heads / a.kv_heads)).collect::<Vec<_>>(), "summary": split},
        });
        return emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?));
    }
    emit(&render(&w, &sat, &split, &a))
}

fn render(w: &Walkthrough, sat: &[(usize, f32, f32, f32, f32)], split: &str, a: &Args) -> String {
    let (n, d) = (w.words.len(), w.d);
    let dims: Vec<String> = (0..d).map(|j| format!("{j}")).collect();
    let words = &w.words;
    let mut s = String::new();
    s += &title("One attention step, by hand");
    s += &format!(
        "{n} positions ({}), vectors of d = {d}, one head; inputs and weights are one-decimal numbers from seed {}.\n\n",
        words.join(", "),
        w.seed
    );
    s += &matrix(
        "X",
        "the input vector of each word, one row per position",
        &w.x,
        words,
        &dims,
        1,
    );
    let wl: Vec<String> = (0..d).map(|j| format!("{j}")).collect();
    s += &matrix("W_Q", "query weights; q = W_Q x", &w.w_q, &wl, &dims, 1);
    s += &matrix("W_K", "key weights; k = W_K x", &w.w_k, &wl, &dims, 1);
    s += &matrix("W_V", "value weights; v = W_V x", &w.w_v, &wl, &dims, 1);
    s += &matrix(
        "Q",
        "row i is q_i = W_Q x_i: what position i is looking for",
        &w.q,
        words,
        &dims,
        2,
    );
    s += &matrix(
        "K",
        "row j is k_j = W_K x_j: what position j offers to be found by",
        &w.k,
        words,
        &dims,
        2,
    );
    s += &matrix(
        "V",
        "row j is v_j = W_V x_j: what position j hands over",
        &w.v,
        words,
        &dims,
        2,
    );
    // one entry worked out in full: the last query against the first key
    let (i, j) = (n - 1, 0);
    let qi = &w.q[i * d..][..d];
    let kj = &w.k[j * d..][..d];
    let terms: Vec<String> = qi
        .iter()
        .zip(kj)
        .map(|(a, b)| format!("({a:.2})·({b:.2})"))
        .collect();
    s += &format!(
        "One score by hand: q_{i}·k_{j} (\"{}\" looking at \"{}\") = {} = {:.4}\n\n",
        words[i],
        words[j],
        terms.join(" + "),
        dot(qi, kj)
    );
    s += &matrix(
        "Scores Q·Kᵀ",
        "entry (i, j) = q_i·k_j; rows are queries, columns keys",
        &w.steps.raw_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        &format!("Scaled scores Q·Kᵀ / √{d}"),
        &format!("divided by √d = {:.4}", (d as f32).sqrt()),
        &w.steps.scaled_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        "Masked scores",
        "the causal mask: a word may not look at later words, their scores become -inf",
        &w.steps.masked_scores,
        words,
        words,
        4,
    );
    s += &matrix(
        "Weights = softmax(masked scores)",
        "each row sums to 1; masked entries are exactly 0",
        &w.steps.pattern,
        words,
        words,
        4,
    );
    // the softmax of the last row, by hand
    let row = &w.steps.masked_scores[i * n..][..n];
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = row.iter().map(|x| (x - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    s += &format!(
        "Softmax of row {i} by hand: subtract the max {max:.4}, exponentiate: [{}], sum {sum:.4}, divide: [{}]\n\n",
        exps.iter().map(|e| format!("{e:.4}")).collect::<Vec<_>>().join(", "),
        exps.iter().map(|e| format!("{:.4}", e / sum)).collect::<Vec<_>>().join(", ")
    );
    s += &matrix(
        "Y = weights · V",
        "row i is the weighted sum of the value vectors position i may see",
        &w.steps.out,
        words,
        &dims,
        4,
    );
    s += &title("Causal mask");
    s += &mask_grid(words);
    s += "\n";
    s += &title("Why divide by √d");
    s += "Softmax of q·k over 16 keys, q and k with independent N(0,1) entries, mean of 500 draws:\n";
    let mut t = Table::new([
        ("d", Align::Right),
        ("max weight, q·k/√d", Align::Right),
        ("entropy (nats)", Align::Right),
        ("max weight, q·k", Align::Right),
        ("entropy (nats)", Align::Right),
    ]);
    for &(d, sm, se, um, ue) in sat {
        t.row([
            d.to_string(),
            format!("{sm:.3}"),
            format!("{se:.3}"),
            format!("{um:.3}"),
            format!("{ue:.3}"),
        ]);
    }
    s += &t.render();
    s += &format!(
        "q·k has variance d, so without the scale the scores spread out as d grows and softmax puts almost everything on one key\n(entropy → 0; uniform would be ln 16 = {:.3}). Dividing by √d keeps the spread, and the weights, the same for every d.\n\n",
        16f32.ln()
    );
    s += &title("Many heads, shared keys and values");
    s += &format!(
        "d_model {} split into {} heads: each head attends with its own {}-dim q, k, v, and the {} head outputs are concatenated back to {} and mixed by W_O.\n",
        a.d_model,
        a.heads,
        a.d_model / a.heads,
        a.heads,
        a.d_model
    );
    s += &format!(
        "With {} key/value heads (grouped-query attention) each KV set serves {} query heads (kv_head = head / {}):\n{split}\n",
        a.kv_heads,
        a.heads / a.kv_heads,
        a.heads / a.kv_heads
    );
    s
}
