//! The circuit graph as data (issue #58): upstream nodes, downstream inputs (the readers of the
//! residual stream) and the edges between them, with one score per edge; nothing here computes a
//! score (`eap.rs`) or evaluates a circuit (`evaluate.rs`).
//!
//! Upstream nodes, in order: `input` (the input to layer 0), then per layer `a{L}.h{H}` (each query
//! head's output through its columns of `W_O`) and `m{L}` (the MLP's output). Downstream inputs,
//! in order: per layer `a{L}.h{H}.q`, `a{L}.kv{G}.k` and `a{L}.kv{G}.v` (one key and one value
//! input per key/value head: a GQA group shares them), `m{L}`; then `logits`. Each downstream input
//! is the sum of the outputs of every upstream node before it (the residual stream), so an edge
//! joins each such pair: the attention of layer L reads `input` and the layers < L, the MLP of
//! layer L also reads layer L's heads, the logits read everything. The upstream nodes a reader
//! reads are a prefix of the upstream list, so edge `(u, r)` sits at `offset(r) + u`.

pub use crate::model::backward::Reader;
use crate::model::config::ModelDims;
use serde::Serialize;

/// An upstream node: what writes into the residual stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Node {
    /// The input to layer 0 (the embeddings, with Gemma's scale and GPT-2's positions).
    Input,
    /// A query head's output (`z` through its columns of `W_O`).
    Head { layer: usize, head: usize },
    /// An MLP's output.
    Mlp { layer: usize },
}

/// The graph of a decoder: its nodes, readers and edges (every edge, scored or not).
#[derive(Clone, Debug)]
pub struct Graph {
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    /// per reader, where its edges start in the edge list
    offsets: Vec<usize>,
    n_edges: usize,
}

/// A node or a reader as the JSON lists it.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct NodeInfo {
    pub name: String,
    /// `input`, `head`, `mlp` (upstream); `q`, `k`, `v`, `mlp_in`, `logits` (downstream)
    pub kind: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layer: Option<usize>,
    /// the query head (`head`, `q`) or the key/value head (`k`, `v`)
    #[serde(skip_serializing_if = "Option::is_none")]
    pub head: Option<usize>,
    /// upstream (writes into the residual stream) or downstream (reads it)
    pub upstream: bool,
}

impl Graph {
    /// The graph of a model of these dimensions.
    pub fn new(dims: &ModelDims) -> Graph {
        Graph::of(dims.n_layers, dims.n_heads, dims.n_kv_heads)
    }

    /// The graph of `n_layers` layers of `n_heads` query heads and `n_kv_heads` key/value heads.
    pub fn of(n_layers: usize, n_heads: usize, n_kv_heads: usize) -> Graph {
        let mut g = Graph {
            n_layers,
            n_heads,
            n_kv_heads,
            offsets: Vec::new(),
            n_edges: 0,
        };
        let mut at = 0;
        for r in 0..g.n_readers() {
            g.offsets.push(at);
            at += g.reads(g.reader(r));
        }
        g.n_edges = at;
        g
    }

    /// Upstream nodes: the input, and per layer its heads and its MLP.
    pub fn n_nodes(&self) -> usize {
        1 + self.n_layers * (self.n_heads + 1)
    }

    /// Readers per layer: each query head's q, each key/value head's k and v, the MLP.
    pub fn readers_per_layer(&self) -> usize {
        self.n_heads + 2 * self.n_kv_heads + 1
    }

    /// Downstream inputs: every layer's readers and the logits.
    pub fn n_readers(&self) -> usize {
        self.n_layers * self.readers_per_layer() + 1
    }

    pub fn n_edges(&self) -> usize {
        self.n_edges
    }

    /// Upstream node `i`.
    pub fn node(&self, i: usize) -> Node {
        if i == 0 {
            return Node::Input;
        }
        let (layer, j) = ((i - 1) / (self.n_heads + 1), (i - 1) % (self.n_heads + 1));
        if j < self.n_heads {
            Node::Head { layer, head: j }
        } else {
            Node::Mlp { layer }
        }
    }

    /// The index of an upstream node.
    pub fn node_index(&self, node: Node) -> usize {
        match node {
            Node::Input => 0,
            Node::Head { layer, head } => 1 + layer * (self.n_heads + 1) + head,
            Node::Mlp { layer } => 1 + layer * (self.n_heads + 1) + self.n_heads,
        }
    }

    /// Reader `r`, in the order of the module's header.
    pub fn reader(&self, r: usize) -> Reader {
        let per = self.readers_per_layer();
        if r == self.n_layers * per {
            return Reader::Logits;
        }
        let (layer, j) = (r / per, r % per);
        let (nh, nkv) = (self.n_heads, self.n_kv_heads);
        match j {
            j if j < nh => Reader::Q { layer, head: j },
            j if j < nh + 2 * nkv => {
                let group = (j - nh) / 2;
                if (j - nh) % 2 == 0 {
                    Reader::K { layer, group }
                } else {
                    Reader::V { layer, group }
                }
            }
            _ => Reader::Mlp { layer },
        }
    }

    /// The index of a reader.
    pub fn reader_index(&self, reader: Reader) -> usize {
        let per = self.readers_per_layer();
        match reader {
            Reader::Q { layer, head } => layer * per + head,
            Reader::K { layer, group } => layer * per + self.n_heads + 2 * group,
            Reader::V { layer, group } => layer * per + self.n_heads + 2 * group + 1,
            Reader::Mlp { layer } => layer * per + per - 1,
            Reader::Logits => self.n_layers * per,
        }
    }

    /// How many upstream nodes `reader` reads: those before it (a prefix of the node list).
    pub fn reads(&self, reader: Reader) -> usize {
        let per_layer = self.n_heads + 1;
        match reader {
            Reader::Q { layer, .. } | Reader::K { layer, .. } | Reader::V { layer, .. } => {
                1 + layer * per_layer
            }
            Reader::Mlp { layer } => 1 + layer * per_layer + self.n_heads,
            Reader::Logits => self.n_nodes(),
        }
    }

    /// Where reader `r`'s edges start in the edge list.
    pub fn offset(&self, r: usize) -> usize {
        self.offsets[r]
    }

    /// Edge `e` as (upstream node index, reader index).
    pub fn edge(&self, e: usize) -> (usize, usize) {
        let r = self.offsets.partition_point(|&o| o <= e) - 1;
        (e - self.offsets[r], r)
    }

    /// The index of the edge from node `u` to reader `r`, if they are joined.
    pub fn edge_index(&self, u: usize, r: usize) -> Option<usize> {
        (r < self.n_readers() && u < self.reads(self.reader(r))).then(|| self.offsets[r] + u)
    }

    /// An upstream node's name: `input`, `a{L}.h{H}`, `m{L}`.
    pub fn node_name(&self, i: usize) -> String {
        match self.node(i) {
            Node::Input => "input".into(),
            Node::Head { layer, head } => format!("a{layer}.h{head}"),
            Node::Mlp { layer } => format!("m{layer}"),
        }
    }

    /// A reader's name: `a{L}.h{H}.q`, `a{L}.kv{G}.k`, `a{L}.kv{G}.v`, `m{L}`, `logits`.
    pub fn reader_name(&self, r: usize) -> String {
        match self.reader(r) {
            Reader::Q { layer, head } => format!("a{layer}.h{head}.q"),
            Reader::K { layer, group } => format!("a{layer}.kv{group}.k"),
            Reader::V { layer, group } => format!("a{layer}.kv{group}.v"),
            Reader::Mlp { layer } => format!("m{layer}"),
            Reader::Logits => "logits".into(),
        }
    }

    /// The edge named by its upstream node and its reader (as [`Graph::node_name`] and
    /// [`Graph::reader_name`] write them), if the graph has it.
    pub fn edge_by_name(&self, from: &str, to: &str) -> Option<usize> {
        let u = (0..self.n_nodes()).find(|&i| self.node_name(i) == from)?;
        let r = (0..self.n_readers()).find(|&r| self.reader_name(r) == to)?;
        self.edge_index(u, r)
    }

    /// Every upstream node, then every reader, as the JSON lists them.
    pub fn node_infos(&self) -> Vec<NodeInfo> {
        let ups = (0..self.n_nodes()).map(|i| {
            let (kind, layer, head) = match self.node(i) {
                Node::Input => ("input", None, None),
                Node::Head { layer, head } => ("head", Some(layer), Some(head)),
                Node::Mlp { layer } => ("mlp", Some(layer), None),
            };
            NodeInfo {
                name: self.node_name(i),
                kind,
                layer,
                head,
                upstream: true,
            }
        });
        let downs = (0..self.n_readers()).map(|r| {
            let (kind, layer, head) = match self.reader(r) {
                Reader::Q { layer, head } => ("q", Some(layer), Some(head)),
                Reader::K { layer, group } => ("k", Some(layer), Some(group)),
                Reader::V { layer, group } => ("v", Some(layer), Some(group)),
                Reader::Mlp { layer } => ("mlp_in", Some(layer), None),
                Reader::Logits => ("logits", None, None),
            };
            NodeInfo {
                name: self.reader_name(r),
                kind,
                layer,
                head,
                upstream: false,
            }
        });
        ups.chain(downs).collect()
    }
}

/// How a circuit of a given size takes its edges from the scores.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ranking {
    /// The largest |score| first (MIB's CMD, the ladder).
    Absolute,
    /// The largest −score first: the edges whose corruption lowers the metric most, i.e. that
    /// carry the clean behaviour (MIB's CPR ranks by the signed score in its sign convention,
    /// `(clean − corrupt) · ∇m`, which is −score here).
    Signed,
}

/// Edge indices ordered by `ranking` (ties: the lower edge index first).
pub fn ranked(scores: &[f32], ranking: Ranking) -> Vec<usize> {
    let key = |e: usize| match ranking {
        Ranking::Absolute => scores[e].abs(),
        Ranking::Signed => -scores[e],
    };
    let mut order: Vec<usize> = (0..scores.len()).collect();
    order.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(n_layers: usize, n_heads: usize, n_kv_heads: usize) -> Graph {
        Graph::of(n_layers, n_heads, n_kv_heads)
    }

    /// The counts `circuits_ref.py` gives for SmolLM2 (30 layers, 9 heads, 3 KV heads) and
    /// Qwen2.5-0.5B (24, 14, 2).
    #[test]
    fn edge_counts_match_the_reference() {
        assert_eq!(graph(30, 9, 3).n_edges(), 70_651);
        assert_eq!(graph(24, 14, 2).n_edges(), 79_813);
        let g = graph(24, 14, 2);
        assert_eq!(g.n_nodes(), 361);
        assert_eq!(g.n_readers(), 24 * 19 + 1);
    }

    /// Indices and names go back and forth; every edge joins a node to a later reader.
    #[test]
    fn indices_and_names_round_trip() {
        let g = graph(3, 4, 2);
        for r in 0..g.n_readers() {
            assert_eq!(g.reader_index(g.reader(r)), r);
        }
        for i in 0..g.n_nodes() {
            assert_eq!(g.node_index(g.node(i)), i);
        }
        for e in 0..g.n_edges() {
            let (u, r) = g.edge(e);
            assert_eq!(g.edge_index(u, r), Some(e));
            let (nu, nr) = (g.node_name(u), g.reader_name(r));
            assert_eq!(g.edge_by_name(&nu, &nr), Some(e), "{nu} -> {nr}");
        }
        // layer 1's q reads input and layer 0; its MLP also reads layer 1's heads
        let q13 = g.reader_index(Reader::Q { layer: 1, head: 3 });
        assert_eq!(q13, 12);
        let m0 = g.node_index(Node::Mlp { layer: 0 });
        assert_eq!(g.edge_by_name("m0", "a1.h3.q"), Some(g.offset(q13) + m0));
        assert!(g.edge_by_name("a1.h0", "a1.h3.q").is_none());
        assert!(g.edge_by_name("a1.h0", "m1").is_some());
        assert!(g.edge_by_name("m1", "m1").is_none());
        assert!(g.edge_by_name("m2", "logits").is_some());
        assert_eq!(g.reader_name(g.n_readers() - 1), "logits");
        assert_eq!(g.reader_name(4), "a0.kv0.k");
        assert_eq!(g.reader_name(5), "a0.kv0.v");
    }

    #[test]
    fn rankings_order_by_magnitude_or_by_negative_score() {
        let s = [0.5, -2.0, 1.0, -0.25];
        assert_eq!(ranked(&s, Ranking::Absolute), vec![1, 2, 0, 3]);
        assert_eq!(ranked(&s, Ranking::Signed), vec![1, 3, 0, 2]);
    }
}
