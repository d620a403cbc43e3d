//! The `attnscope circuit --html` page: the report's top edges, nodes, ladder and exact edge
//! patches, and the clickable heads' attention rows and QK splits
//! ([`crate::analysis::circuit::head_views`]), inline in `assets/circuit.html`, no network.

use crate::analysis::circuit::head_views::HeadViews;
use crate::analysis::circuit::CircuitReport;
use serde_json::{json, Value};
use std::collections::HashMap;

const TEMPLATE: &str = include_str!("../../assets/circuit.html");

/// The most edges the page keeps (the largest |score| first): enough for the ladder's small
/// circuits, few enough for an SVG to draw.
pub const MAX_EDGES: usize = 2000;

/// The page of a circuit report: its data inline, no network.
/// `[n_layers, n_heads, n_kv_heads]` place the nodes; `heads` are the heads a click shows.
pub fn page(
    r: &CircuitReport,
    [n_layers, n_heads, n_kv_heads]: [usize; 3],
    heads: &HeadViews,
) -> String {
    let exact: HashMap<(&str, &str), f32> = r
        .exact_edges
        .iter()
        .flat_map(|x| &x.edges)
        .map(|e| ((e.from.as_str(), e.to.as_str()), e.exact))
        .collect();
    let edges: Vec<Value> = r
        .edges
        .iter()
        .take(MAX_EDGES)
        .map(|e| {
            let x = exact.get(&(e.from.as_str(), e.to.as_str()));
            json!({"from": e.from, "to": e.to, "score": e.score, "exact": x})
        })
        .collect();
    let ev = r.evaluation.as_ref();
    let data = json!({
        "model": r.model, "method": r.method, "steps": r.steps, "metric": r.metric,
        "pairs": r.pairs, "clean_metric": r.clean_metric, "corrupt_metric": r.corrupt_metric,
        "n_nodes": r.n_nodes, "n_readers": r.n_readers, "n_edges": r.n_edges,
        "n_layers": n_layers, "n_heads": n_heads, "n_kv_heads": n_kv_heads,
        "nodes": r.nodes, "edges": edges,
        "ladder": ev.map(|e| &e.ladder), "cpr": ev.map(|e| e.cpr), "cmd": ev.map(|e| e.cmd),
        "head_views": heads,
    });
    let json = data.to_string().replace('<', "\\u003c");
    TEMPLATE.replace("/*ATTNSCOPE_DATA*/null", &json).replace(
        "<!--TITLE-->",
        &crate::render::html::html_escape(&format!("attnscope circuit: {}", r.model)),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::circuit::{EdgeScore, MetricKind};

    #[test]
    fn the_page_has_its_data_inline_and_no_external_urls() {
        let r = CircuitReport {
            model: "m<x>".into(),
            method: "eap",
            steps: None,
            metric: MetricKind::LogitDiff,
            pairs: 1,
            clean_metric: 1.0,
            corrupt_metric: -1.0,
            n_nodes: 0,
            n_readers: 0,
            n_edges: 1,
            nodes: vec![],
            edges: vec![EdgeScore {
                from: "input".into(),
                to: "logits</script>".into(),
                score: 0.5,
            }],
            evaluation: None,
            exact_edges: None,
            seconds: 0.0,
        };
        let views = HeadViews {
            tokens: vec![],
            head_edges: 100,
            max_heads: 32,
            heads: vec![],
        };
        let p = page(&r, [2, 4, 2], &views);
        assert!(!p.contains("/*ATTNSCOPE_DATA*/null") && p.contains("\"score\":0.5"));
        assert!(
            !p.contains("logits</script>"),
            "a name cannot close the script"
        );
        assert!(p.contains("attnscope circuit: m&lt;x&gt;"));
        // the one URL is SVG's namespace, never fetched
        let svg_ns = p.matches("http://www.w3.org/2000/svg").count();
        assert_eq!(p.matches("http://").count(), svg_ns);
        assert!(!p.contains("https://"), "no network");
    }
}
