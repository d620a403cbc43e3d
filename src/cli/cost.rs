//! `attnscope cost`: how the attention score matrix grows with the sequence length.

use super::common::{emit, usage};
use attnscope::render::table::{title, Align, Table};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Sequence lengths to compare (each is compared with the one before).
    #[arg(required = true, num_args = 1..)]
    lengths: Vec<u64>,
    /// Layers of the model (default: Qwen2.5-0.5B).
    #[arg(long, default_value_t = 24)]
    layers: u64,
    /// Query heads per layer.
    #[arg(long, default_value_t = 14)]
    heads: u64,
    /// Dimension of each head.
    #[arg(long, default_value_t = 64)]
    head_dim: u64,
    #[arg(long)]
    json: bool,
}

/// Byte counts as KiB/MiB/GiB/TiB.
pub fn human_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b;
    let mut u = 0;
    while v >= 1024.0 && u < units.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{v:.0} {}", units[u])
    } else {
        format!("{v:.1} {}", units[u])
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    if let Some(&bad) = a.lengths.iter().find(|&&n| n == 0 || n > 1 << 24) {
        return Err(usage(format!(
            "length {bad} is out of range: use 1..={}",
            1u64 << 24
        )));
    }
    if a.layers == 0 || a.heads == 0 || a.head_dim == 0 {
        return Err(usage("--layers, --heads and --head-dim must be at least 1"));
    }
    let rows: Vec<serde_json::Value> = a
        .lengths
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let nf = n as f64;
            let pairs = nf * nf;
            let causal = nf * (nf + 1.0) / 2.0;
            let per_head = 4.0 * pairs;
            let model = per_head * (a.layers * a.heads) as f64;
            // QKᵀ and weights·V, causal half: 2 matmuls × 2 FLOP × d × n(n+1)/2, per head and layer
            let flops = 4.0 * (a.head_dim * a.layers * a.heads) as f64 * causal;
            let growth = (i > 0).then(|| pairs / (a.lengths[i - 1] as f64).powi(2));
            json!({"n": n, "pairs": pairs, "causal_pairs": causal, "bytes_per_head": per_head, "bytes_all_layers_heads": model,
                   "attention_flops": flops, "growth_vs_previous": growth})
        })
        .collect();
    if a.json {
        return emit(&format!(
            "{}\n",
            serde_json::to_string_pretty(
                &json!({"layers": a.layers, "heads": a.heads, "head_dim": a.head_dim, "lengths": rows})
            )?
        ));
    }
    let mut t = Table::new([
        ("n", Align::Right),
        ("pairs n²", Align::Right),
        ("causal n(n+1)/2", Align::Right),
        ("one f32 n×n", Align::Right),
        (
            format!("all {}×{} maps", a.layers, a.heads).as_str(),
            Align::Right,
        ),
        ("attention FLOP", Align::Right),
        ("× previous", Align::Right),
    ]);
    for r in &rows {
        t.row([
            r["n"].to_string(),
            format!("{:.3e}", r["pairs"].as_f64().unwrap_or(0.0)),
            format!("{:.3e}", r["causal_pairs"].as_f64().unwrap_or(0.0)),
            human_bytes(r["bytes_per_head"].as_f64().unwrap_or(0.0)),
            human_bytes(r["bytes_all_layers_heads"].as_f64().unwrap_or(0.0)),
            format!("{:.3e}", r["attention_flops"].as_f64().unwrap_or(0.0)),
            r["growth_vs_previous"]
                .as_f64()
                .map(|g| format!("{g:.1}x"))
                .unwrap_or_else(|| "—".into()),
        ]);
    }
    let mut s = title("The cost of attention grows with n²");
    s += &t.render();
    s += "\nEvery query scores every earlier key, so the score matrix has n² entries (n(n+1)/2 under the causal mask).\n";
    if let [.., prev, last] = a.lengths[..] {
        let k = last as f64 / prev as f64;
        s += &format!(
            "{prev} → {last} is {k:.1}x the length and {:.1}x the scores, the memory to hold them and the attention FLOP; the projections (W_Q, W_K, W_V, W_O, MLP) grow only {k:.1}x.\n",
            k * k
        );
    }
    emit(&s)
}

#[cfg(test)]
mod tests {
    #[test]
    fn human_bytes_units() {
        assert_eq!(super::human_bytes(512.0), "512 B");
        assert_eq!(super::human_bytes(64.0 * 1024.0 * 1024.0), "64.0 MiB");
    }
}
