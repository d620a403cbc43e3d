//! What the circuit page shows when a head is clicked (issue #58, part 5): the head's attention
//! row from the clean text's last position (the forward's `hook_pattern`, the position whose
//! logits the metric reads) and the QK split ([`crate::analysis::qk`]) of that query's score
//! against the key it attends to most. The page is one file, so these are computed when it is
//! written, for the heads the top edges touch (at most [`MAX_HEADS`]), and embedded.

use super::graph::NodeInfo;
use super::EdgeScore;
use crate::analysis::qk::{qk, Against, QkOptions, QkTerm};
use crate::analysis::vocab::TokenRef;
use crate::model::capture::{AttnCache, CaptureSpec, Hook, Queries};
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::Serialize;
use std::collections::HashMap;

/// The heads are those of the top this many edges (by |score|).
pub const HEAD_EDGES: usize = 100;
/// At most this many heads (the first met going down the edges).
pub const MAX_HEADS: usize = 32;
/// The largest terms of each head's QK split kept (the page names how many there are).
pub const TOP_TERMS: usize = 12;

/// One clickable head.
#[derive(Clone, Debug, Serialize)]
pub struct HeadView {
    /// the head's node name, `a{L}.h{H}`
    pub name: String,
    pub layer: usize,
    pub head: usize,
    /// the query position (the text's last)
    pub query: usize,
    /// the query's attention weight on every key `0..n` (after the softmax; 0 where masked)
    pub row: Vec<f32>,
    /// the key of the largest weight, whose score is split
    pub key: usize,
    /// the pre-softmax score of (query, key), its split's terms added up, and `sum − score`
    pub score: f64,
    pub sum: f64,
    pub gap: f64,
    /// how many terms the split has (`terms` keeps the largest [`TOP_TERMS`])
    pub n_terms: usize,
    pub terms: Vec<QkTerm>,
}

/// The clickable heads of a page and the text they were computed on.
#[derive(Clone, Debug, Serialize)]
pub struct HeadViews {
    pub tokens: Vec<TokenRef>,
    /// the edges whose heads were taken, and the cap on their number
    pub head_edges: usize,
    pub max_heads: usize,
    pub heads: Vec<HeadView>,
}

/// The heads the top `HEAD_EDGES` of `edges` touch, as `(layer, head)`, in the order met (first
/// the edge's upstream head, then the head whose query it feeds), at most `MAX_HEADS`. A key or
/// value reader belongs to a key/value group, not one head, so it adds none.
pub fn touched_heads(nodes: &[NodeInfo], edges: &[EdgeScore]) -> Vec<(usize, usize)> {
    let by_name: HashMap<&str, &NodeInfo> = nodes.iter().map(|n| (n.name.as_str(), n)).collect();
    let mut heads = Vec::new();
    for e in edges.iter().take(HEAD_EDGES) {
        for name in [e.from.as_str(), e.to.as_str()] {
            let Some(n) = by_name.get(name) else { continue };
            if let ("head" | "q", Some(l), Some(h)) = (n.kind, n.layer, n.head) {
                if !heads.contains(&(l, h)) && heads.len() < MAX_HEADS {
                    heads.push((l, h));
                }
            }
        }
    }
    heads
}

/// Each head's view on `tokens`: one forward for the attention rows, one QK split per head.
pub fn head_views(
    model: &Model,
    tokens: &[u32],
    heads: &[(usize, usize)],
) -> anyhow::Result<HeadViews> {
    let n = tokens.len();
    let mut layers: Vec<usize> = heads.iter().map(|&(l, _)| l).collect();
    layers.sort_unstable();
    layers.dedup();
    let spec = CaptureSpec {
        hooks: vec![Hook::Pattern],
        layers: Some(layers),
        heads: None,
        queries: Queries::Last,
    };
    let mut cache = AttnCache::new(&spec, n);
    model.forward(tokens, &RunOptions::last_logits(n), &mut cache)?;
    let views = heads
        .iter()
        .map(|&(layer, head)| {
            let row = cache
                .pattern(layer)
                .and_then(|p| p.row_at(head, n - 1).map(<[f32]>::to_vec))
                .ok_or_else(|| {
                    anyhow::anyhow!(
                        "the forward kept no pattern of head {layer}.{head}: you likely have a bug"
                    )
                })?;
            view(model, tokens, (layer, head), row)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    Ok(HeadViews {
        tokens: TokenRef::all(model, tokens),
        head_edges: HEAD_EDGES,
        max_heads: MAX_HEADS,
        heads: views,
    })
}

/// One head's view: its row, and the split of its score against the row's top key.
fn view(
    model: &Model,
    tokens: &[u32],
    (layer, head): (usize, usize),
    row: Vec<f32>,
) -> anyhow::Result<HeadView> {
    let query = tokens.len() - 1;
    // the first of equal largest weights, as `qk` picks its attended key
    let key = (0..=query).fold(0, |best, j| if row[j] > row[best] { j } else { best });
    let r = qk(
        model,
        &QkOptions {
            tokens: tokens.to_vec(),
            layer,
            head,
            query: Some(query),
            key: Some(key),
            against: Against::Second,
        },
    )?;
    Ok(HeadView {
        name: format!("a{layer}.h{head}"),
        layer,
        head,
        query,
        row,
        key,
        score: r.score,
        sum: r.sum,
        gap: r.gap,
        n_terms: r.terms.len(),
        terms: r.terms.into_iter().take(TOP_TERMS).collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::circuit::graph::Graph;

    #[test]
    fn the_heads_are_those_of_the_top_edges_queries_included_groups_not() {
        let g = Graph::of(3, 4, 2);
        let edge = |from: &str, to: &str| EdgeScore {
            from: from.into(),
            to: to.into(),
            score: 1.0,
        };
        let edges = [
            edge("a0.h1", "a2.h3.q"),
            edge("input", "a1.kv0.k"),
            edge("a1.h2", "logits"),
            edge("a0.h1", "m1"),
        ];
        assert_eq!(
            touched_heads(&g.node_infos(), &edges),
            vec![(0, 1), (2, 3), (1, 2)]
        );
    }
}
