//! The words of a circuit's run ([`Model::branch_run`], in `branches`): the readers of the
//! residual stream ([`Reader`]), the gradients at one layer's readers ([`ReaderGrads`]), the sink
//! that receives the nodes' outputs and the readers' gradients ([`BranchSink`]) and a layer's
//! heads as the forward has them ([`LayerHeads`]). Below `branches`, `taps` and `edited`, which
//! all speak them.

use crate::model::error::Result;
use crate::model::Model;

/// A reader of the residual stream: the graph's downstream inputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reader {
    /// Query head `head`'s q (`a{L}.h{H}.q`).
    Q { layer: usize, head: usize },
    /// Key/value head `group`'s k (`a{L}.kv{G}.k`).
    K { layer: usize, group: usize },
    /// Key/value head `group`'s v (`a{L}.kv{G}.v`).
    V { layer: usize, group: usize },
    /// The MLP's input (`m{L}`).
    Mlp { layer: usize },
    /// The final norm's input (`logits`).
    Logits,
}

/// The metric's gradient at one layer's readers, `[rows, d_model]` each (the rows from the
/// sink's [`BranchSink::rows_from`] on): q of every query head (`[n_heads][rows, d]` flat), k and
/// v of every key/value head (`[n_kv_heads][rows, d]`), the MLP's.
pub struct ReaderGrads {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub mlp: Vec<f32>,
}

/// Receives what a [`Model::branch_run`] computes: the upstream nodes' outputs in the forward
/// (in order: the input, then per layer its heads and its MLP), then the gradients at the
/// readers in the backward (the logits' first, then the layers' from the last). Every `[n, d]`
/// below is the rows from [`BranchSink::rows_from`] on, `[n − from, d_model]`.
pub trait BranchSink {
    /// The first row (position) the sink needs (0: every row). A circuit's clean and corrupted
    /// texts agree before their first differing token, so every node's difference is exactly
    /// zero there, and neither the nodes' outputs nor the gradients of those rows are needed.
    fn rows_from(&self) -> usize {
        0
    }
    /// Whether the forward should compute and hand over the nodes' outputs (a head's costs a
    /// product with its slice of `W_O`).
    fn wants_nodes(&self) -> bool;
    /// The input to layer 0, `[n, d_model]`.
    fn input(&mut self, x0: &[f32]) -> Result<()>;
    /// Layer `layer`'s heads: their outputs on demand ([`LayerHeads::outputs`]).
    fn heads(&mut self, layer: usize, heads: &LayerHeads) -> Result<()>;
    /// Layer `layer`'s MLP output, `[n, d_model]`.
    fn mlp(&mut self, layer: usize, out: &[f32]) -> Result<()>;
    /// The gradient at the final norm's input (the `logits` reader), `[n, d_model]`.
    fn logits_gradient(&mut self, g: &[f32]) -> Result<()>;
    /// The gradients at layer `layer`'s readers.
    fn layer_gradients(&mut self, layer: usize, g: &ReaderGrads) -> Result<()>;
}

/// A layer's heads as a run's forward has them (the rows from the sink's
/// [`BranchSink::rows_from`] on): the attention's output `z` and the o projection's rows.
pub struct LayerHeads<'a> {
    pub(super) model: &'a Model,
    pub(super) layer: usize,
    /// `[rows, n_heads·head_dim]`
    pub z: &'a [f32],
    /// `[rows, d_model]`: the o projection's output (a post-norm's scale comes from it)
    pub(super) attn_proj: &'a [f32],
}

impl LayerHeads<'_> {
    /// The heads' outputs, `[n_heads][rows, d_model]` flat ([`Model::head_outputs`]).
    pub fn outputs(&self) -> Vec<f32> {
        self.model.head_outputs(self.layer, self.z, self.attn_proj)
    }

    /// Whether a head's output is linear in its `z`: true unless a post-attention norm scales
    /// it by the run's own row scale.
    pub fn linear(&self) -> bool {
        self.model.weights.layers[self.layer].post_norms.is_none()
    }

    /// The outputs these heads give for other rows `z` (`[rows, n_heads·head_dim]`): a
    /// difference of two runs' `z` gives the difference of their outputs, in one product
    /// rather than two. Only where [`LayerHeads::linear`].
    pub fn outputs_of(&self, z: &[f32]) -> Vec<f32> {
        assert!(self.linear(), "a post-norm's heads are not linear in z");
        self.model.head_outputs(self.layer, z, self.attn_proj)
    }
}
