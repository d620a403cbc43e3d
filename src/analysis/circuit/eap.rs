//! Edge attribution patching (EAP, Syed et al. 2023, arXiv:2310.10348) and EAP with integrated
//! gradients (EAP-IG, Hanna et al. 2024, "Have Faith in Faithfulness", arXiv:2403.17806): every
//! edge's score from one product of the upstream nodes' differences and the readers' gradients.
//!
//! score(u → r) = Σ over positions and width of (a_u(corrupt) − a_u(clean)) · ∂m/∂in_r, the
//! gradient at the clean run (EAP) or averaged over `steps` runs whose input embeddings are
//! `x_corrupt + α (x_clean − x_corrupt)`, α = (i + ½)/steps (EAP-IG, the inputs variant). The
//! differences are kept (from the texts' first differing position on: before it every
//! difference is exactly zero), written as the runs hand each layer's nodes over straight into
//! the packed panels of the product's right-hand side `[n·d, nodes]` (no second copy, no
//! packing pass); the gradients come layer by layer from the backward
//! ([`crate::model::backward::BranchSink`]) and meet the differences in one GEMM per
//! [`LAYER_BLOCK`] layers (`[readers, n·d] · [n·d, nodes]`): the differences (166 MB at 128
//! tokens on the default model) are streamed once per block rather than once per layer, and a
//! block's gradients are let go after its product.

use super::graph::{Graph, Reader};
use super::{Method, PairTokens};
use crate::kernels::gemm::{self, Isa, PackedB};
use crate::model::backward::{BranchSink, LayerHeads, Metric, ReaderGrads};
use crate::model::{Model, Result};

/// The readers' gradients of this many layers (the logits' with the last block) meet the
/// differences in one product: a product of a few rows is bound by streaming the differences,
/// so more rows per pass save time, while the rows of a block's earlier layers read fewer
/// nodes than its last (the columns past them are computed and dropped).
pub const LAYER_BLOCK: usize = 4;

/// What the next run's node outputs do to the differences.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// the corrupted run: `a_u(corrupt)` stored
    Corrupt,
    /// the clean run: `a_u(clean)` subtracted
    Clean,
    /// a gradient run only (EAP-IG's steps): node outputs not wanted
    Gradients,
}

/// The sink that turns node outputs into differences and gradients into edge scores.
struct ScoreSink<'a> {
    graph: &'a Graph,
    /// the first position at which the clean and corrupted texts differ: before it every
    /// node's difference is exactly zero, so only the rows from it on are kept and multiplied
    from: usize,
    /// `[n·d, nodes]` packed as the right-hand side of `gradients · deltaᵀ`: a_u(corrupt) −
    /// a_u(clean), written straight into the panels as the runs hand the nodes over
    delta: PackedB,
    /// per layer, the corrupted run's `z` (`[rows, n_heads·head_dim]`) where the heads are
    /// linear in it: their differences are then one product of `z`'s difference
    z_corrupt: Vec<Vec<f32>>,
    width: usize,
    phase: Phase,
    /// each gradient run's scores are added times this
    weight: f64,
    scores: &'a mut [f64],
    /// the gradients of the readers `pending` waiting for their block's product, `[readers][n·d]`
    rows: Vec<f32>,
    pending: Vec<usize>,
    /// the layers in `pending`
    pending_layers: usize,
}

impl ScoreSink<'_> {
    fn node_rows(&mut self, first: usize, outs: &[f32]) {
        match self.phase {
            Phase::Corrupt => self.delta.set_columns(first, outs, false),
            Phase::Clean => self.delta.set_columns(first, outs, true),
            Phase::Gradients => {}
        }
    }

    /// Adds `weight ×` the scores of the edges into the readers `pending`, whose gradients are the
    /// rows of `rows` (`[readers][n·d]`): one product of the gradients with the differences of
    /// the nodes the readers read; the block is then empty.
    fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let g = self.graph;
        let k = self.width;
        let readers = std::mem::take(&mut self.pending);
        let rows = std::mem::take(&mut self.rows);
        let count = readers.len();
        let reads = readers
            .iter()
            .map(|&r| g.reads(g.reader(r)))
            .max()
            .unwrap_or(0);
        let b = &self.delta;
        let mut c = vec![0f32; count * reads];
        gemm::gemm_sub(
            &rows,
            k,
            count,
            b,
            0..k,
            0..reads,
            &mut c,
            reads,
            false,
            true,
        );
        for (j, &r) in readers.iter().enumerate() {
            let off = g.offset(r);
            for u in 0..g.reads(g.reader(r)) {
                self.scores[off + u] += self.weight * c[j * reads + u] as f64;
            }
        }
        (self.rows, self.pending) = (rows, readers);
        self.rows.clear();
        self.pending.clear();
        self.pending_layers = 0;
    }
}

impl BranchSink for ScoreSink<'_> {
    fn rows_from(&self) -> usize {
        self.from
    }

    fn wants_nodes(&self) -> bool {
        self.phase != Phase::Gradients
    }

    fn input(&mut self, x0: &[f32]) -> Result<()> {
        self.node_rows(0, x0);
        Ok(())
    }

    fn heads(&mut self, layer: usize, heads: &LayerHeads) -> Result<()> {
        let first = self
            .graph
            .node_index(super::graph::Node::Head { layer, head: 0 });
        if !heads.linear() {
            self.node_rows(first, &heads.outputs());
            return Ok(());
        }
        // linear in z: the corrupted run's z kept, the clean run's difference multiplied once
        match self.phase {
            Phase::Corrupt => {
                self.z_corrupt.resize_with(layer + 1, Vec::new);
                self.z_corrupt[layer] = heads.z.to_vec();
            }
            Phase::Clean => {
                let mut dz = std::mem::take(&mut self.z_corrupt[layer]);
                dz.iter_mut().zip(heads.z).for_each(|(d, c)| *d -= c);
                self.delta.set_columns(first, &heads.outputs_of(&dz), false);
            }
            Phase::Gradients => {}
        }
        Ok(())
    }

    fn mlp(&mut self, layer: usize, out: &[f32]) -> Result<()> {
        let at = self.graph.node_index(super::graph::Node::Mlp { layer });
        self.node_rows(at, out);
        Ok(())
    }

    fn logits_gradient(&mut self, g: &[f32]) -> Result<()> {
        self.rows.extend_from_slice(&g[..self.width]);
        self.pending.push(self.graph.reader_index(Reader::Logits));
        Ok(())
    }

    fn layer_gradients(&mut self, layer: usize, g: &ReaderGrads) -> Result<()> {
        let graph = self.graph;
        let (nh, nkv, k) = (graph.n_heads, graph.n_kv_heads, self.width);
        // the layer's readers' gradients in the graph's order (q heads, k and v of each
        // key/value head, the MLP), added to the block
        let rows = &mut self.rows;
        rows.extend_from_slice(&g.q[..nh * k]);
        for grp in 0..nkv {
            rows.extend_from_slice(&g.k[grp * k..(grp + 1) * k]);
            rows.extend_from_slice(&g.v[grp * k..(grp + 1) * k]);
        }
        rows.extend_from_slice(&g.mlp[..k]);
        let first = graph.reader_index(Reader::Q { layer, head: 0 });
        self.pending
            .extend(first..first + graph.readers_per_layer());
        self.pending_layers += 1;
        // the backward runs from the last layer down: layer 0 closes the last block
        if self.pending_layers == LAYER_BLOCK || layer == 0 {
            self.flush();
        }
        Ok(())
    }
}

/// One pair's edge scores added into `scores` (times `weight`: 1 / the number of pairs), by
/// `method`, for `metric`; the clean and corrupted runs' metric values.
pub(super) fn score_pair(
    model: &Model,
    graph: &Graph,
    pair: &PairTokens,
    (method, metric): (Method, Metric),
    scores: &mut [f64],
    weight: f64,
) -> Result<(f32, f32)> {
    let (xc, _) = model.input_embeddings(&pair.clean)?;
    let (xx, _) = model.input_embeddings(&pair.corrupt)?;
    let n = pair.clean.len();
    let from = super::first_difference(pair).min(n - 1);
    let width = (n - from) * model.dims.d_model;
    let mut sink = ScoreSink {
        graph,
        from,
        delta: PackedB::zeros(width, graph.n_nodes(), Isa::detect()),
        z_corrupt: Vec::new(),
        rows: Vec::new(),
        pending: Vec::new(),
        pending_layers: 0,
        width,
        phase: Phase::Corrupt,
        weight,
        scores,
    };
    let corrupt = model.branch_run(&xx, metric, false, &mut sink)?.value;
    sink.phase = Phase::Clean;
    let clean = match method {
        Method::Eap => {
            let clean = model.branch_run(&xc, metric, true, &mut sink)?.value;
            sink.flush();
            clean
        }
        Method::EapIg { steps } => {
            let clean = model.branch_run(&xc, metric, false, &mut sink)?.value;
            sink.phase = Phase::Gradients;
            sink.weight = weight / steps as f64;
            for i in 0..steps {
                let a = (i as f32 + 0.5) / steps as f32;
                let x: Vec<f32> = xx.iter().zip(&xc).map(|(x, c)| x + a * (c - x)).collect();
                model.branch_run(&x, metric, true, &mut sink)?;
                sink.flush();
            }
            clean
        }
    };
    Ok((clean, corrupt))
}
