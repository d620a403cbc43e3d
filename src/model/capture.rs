//! Capture: hook points named as in TransformerLens, an [`Observer`] the forward hands them to,
//! and [`AttnCache`], the observer that keeps what a [`CaptureSpec`] asks for.
//!
//! Nothing is captured unless asked: the forward calls [`Observer::wants`] before it copies a
//! tensor out, so memory is what was requested. Captured data leaves the model as plain
//! `Vec<f32>` plus a shape; analyses never see a candle tensor.
//!
//! Shapes (no batch dimension; attnscope runs one sequence):
//! | hook | shape |
//! |---|---|
//! | `blocks.{l}.hook_resid_pre`, `hook_attn_out`, `hook_resid_mid`, `hook_mlp_out`, `hook_resid_post` | `[pos, d_model]` |
//! | `blocks.{l}.mlp.hook_pre` (the gate's pre-activation; GPT-2: `c_fc`'s output), `mlp.hook_post` (what `W_out` reads) | `[pos, d_mlp]` |
//! | `blocks.{l}.attn.hook_q`, `hook_rot_q`, `hook_z` | `[pos, head, head_dim]` |
//! | `blocks.{l}.attn.hook_k`, `hook_v`, `hook_rot_k` | `[pos, kv_head, head_dim]` (not repeated for GQA) |
//! | `blocks.{l}.attn.hook_attn_scores` | `[head, query_pos, key_pos]`, scaled, masked = -inf |
//! | `blocks.{l}.attn.hook_pattern` | `[head, query_pos, key_pos]`, rows sum to 1 |

use rayon::prelude::*;
use std::collections::BTreeMap;

/// A hook point inside one block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Hook {
    /// `hook_embed`: the token embeddings as they enter the residual stream (Gemma's √d_model
    /// scale included, as TransformerLens folds it into `W_E`); handed at layer 0.
    Embed,
    /// `hook_pos_embed`: the learned positions (GPT-2; an encoder's, with its token types added);
    /// handed at layer 0 (the rotary families have none).
    PosEmbed,
    /// `hook_resid_pre`: the residual stream at the block's input
    ResidPre,
    /// `ln1.hook_scale`: each position's norm scale, `[pos, 1]` (RMS: `sqrt(mean(x²) + eps)`;
    /// LayerNorm: `sqrt(var + eps)`).
    Ln1Scale,
    /// `ln1.hook_normalized`: the normalized residual before the norm's weight (and bias).
    Ln1Normalized,
    /// `attn.hook_q`: the queries, `[pos, head, head_dim]`, before RoPE
    Q,
    /// `attn.hook_k`: the keys, `[pos, kv_head, head_dim]`, before RoPE
    K,
    /// `attn.hook_v`: the values, `[pos, kv_head, head_dim]`
    V,
    /// `attn.hook_rot_q`: the queries after RoPE
    RotQ,
    /// `attn.hook_rot_k`: the keys after RoPE
    RotK,
    /// `attn.hook_attn_scores`: the scaled, masked scores before the softmax, `[head, query, key]`
    AttnScores,
    /// `attn.hook_pattern`: the attention weights after the softmax, `[head, query, key]`
    Pattern,
    /// `attn.hook_z`: each head's weighted sum of the values, `[pos, head, head_dim]`
    Z,
    /// `attn.hook_result`: each head's output through its slice of W_O (no bias),
    /// `[pos, head, d_model]`; computed only when asked.
    Result,
    /// `hook_attn_out`: the attention's output added to the residual stream
    AttnOut,
    /// `hook_resid_mid`: the residual stream between attention and MLP
    ResidMid,
    /// `ln2.hook_scale`: the second norm's scale per position, `[pos, 1]`
    Ln2Scale,
    /// `ln2.hook_normalized`: the normalized residual before the second norm's weight
    Ln2Normalized,
    /// `mlp.hook_pre`: the MLP's input to its activation (a gated MLP's gate)
    MlpPre,
    /// `mlp.hook_pre_linear`: the up projection of a gated MLP (`hook_pre` is the gate's).
    MlpPreLinear,
    /// `mlp.hook_post`: the MLP's hidden activation, the input of its down projection
    MlpPost,
    /// `hook_mlp_out`: the MLP's output added to the residual stream
    MlpOut,
    /// `hook_resid_post`: the residual stream at the block's output
    ResidPost,
    /// `ln_final.hook_scale` / `hook_normalized`: the final norm, every position; handed at the
    /// last layer.
    LnFinalScale,
    /// `ln_final.hook_normalized`: the final norm's normalized residual, every position
    LnFinalNormalized,
}

impl Hook {
    /// The hooks of a block (`blocks.{l}.…`), in the order the forward hands them out.
    pub const ALL: [Hook; 21] = [
        Hook::ResidPre,
        Hook::Ln1Scale,
        Hook::Ln1Normalized,
        Hook::Q,
        Hook::K,
        Hook::V,
        Hook::RotQ,
        Hook::RotK,
        Hook::AttnScores,
        Hook::Pattern,
        Hook::Z,
        Hook::Result,
        Hook::AttnOut,
        Hook::ResidMid,
        Hook::Ln2Scale,
        Hook::Ln2Normalized,
        Hook::MlpPre,
        Hook::MlpPreLinear,
        Hook::MlpPost,
        Hook::MlpOut,
        Hook::ResidPost,
    ];

    /// The hooks outside the blocks: `hook_embed`, `hook_pos_embed` (handed at layer 0) and the
    /// final norm's (handed at the last layer).
    pub const GLOBAL: [Hook; 4] = [
        Hook::Embed,
        Hook::PosEmbed,
        Hook::LnFinalScale,
        Hook::LnFinalNormalized,
    ];

    /// Every hook a forward of `arch` hands out, in the order it hands them: the order of a
    /// capture file's tensors within each layer (`capture` writes a layer's hooks up to `z`
    /// while its MLP runs). A decoder's pre-norm block normalizes before its attention and its
    /// MLP; an encoder's post-norm block (BERT) after each residual add, so its `ln1` comes after
    /// `hook_attn_out`, and it has no rotary embeddings, no gate and no final norm. Built from the
    /// family's description alone; `hooks_come_in_the_forwards_order` (tests/arch_fixtures.rs)
    /// checks it against what each family's forward hands out.
    pub fn in_forward_order(arch: super::config::Arch) -> Vec<Hook> {
        use Hook::*;
        let family = arch.family();
        let mut order = vec![Embed];
        if family.learned_positions {
            order.push(PosEmbed);
        }
        order.push(ResidPre);
        if family.encoder {
            order.extend([Q, K, V, AttnScores, Pattern, Z, Result, AttnOut]);
            order.extend([Ln1Scale, Ln1Normalized, ResidMid, MlpPre, MlpPost, MlpOut]);
            order.extend([Ln2Scale, Ln2Normalized, ResidPost]);
            return order;
        }
        order.extend([
            Ln1Scale,
            Ln1Normalized,
            Q,
            K,
            V,
            RotQ,
            RotK,
            AttnScores,
            Pattern,
            Z,
        ]);
        order.extend([Result, AttnOut, ResidMid, Ln2Scale, Ln2Normalized, MlpPre]);
        if family.mlp.gated() {
            order.push(MlpPreLinear);
        }
        order.extend([MlpPost, MlpOut, ResidPost, LnFinalScale, LnFinalNormalized]);
        order
    }

    /// Whether the hook is outside the blocks (its name has no `blocks.{l}.`).
    pub fn is_global(self) -> bool {
        Hook::GLOBAL.contains(&self)
    }

    /// The layer a hook is handed at in a model of `n_layers`: its own for a block's hook; 0 for
    /// the embeddings, the last for the final norm.
    pub fn layer_of(self, layer: usize, n_layers: usize) -> usize {
        match self {
            Hook::Embed | Hook::PosEmbed => 0,
            Hook::LnFinalScale | Hook::LnFinalNormalized => n_layers.saturating_sub(1),
            _ => layer,
        }
    }

    /// The name after `blocks.{l}.` (a global hook's whole name).
    pub fn suffix(self) -> &'static str {
        match self {
            Hook::Embed => "hook_embed",
            Hook::PosEmbed => "hook_pos_embed",
            Hook::Ln1Scale => "ln1.hook_scale",
            Hook::Ln1Normalized => "ln1.hook_normalized",
            Hook::Ln2Scale => "ln2.hook_scale",
            Hook::Ln2Normalized => "ln2.hook_normalized",
            Hook::MlpPreLinear => "mlp.hook_pre_linear",
            Hook::LnFinalScale => "ln_final.hook_scale",
            Hook::LnFinalNormalized => "ln_final.hook_normalized",
            Hook::ResidPre => "hook_resid_pre",
            Hook::Q => "attn.hook_q",
            Hook::K => "attn.hook_k",
            Hook::V => "attn.hook_v",
            Hook::RotQ => "attn.hook_rot_q",
            Hook::RotK => "attn.hook_rot_k",
            Hook::AttnScores => "attn.hook_attn_scores",
            Hook::Pattern => "attn.hook_pattern",
            Hook::Z => "attn.hook_z",
            Hook::Result => "attn.hook_result",
            Hook::AttnOut => "hook_attn_out",
            Hook::ResidMid => "hook_resid_mid",
            Hook::MlpPre => "mlp.hook_pre",
            Hook::MlpPost => "mlp.hook_post",
            Hook::MlpOut => "hook_mlp_out",
            Hook::ResidPost => "hook_resid_post",
        }
    }

    /// Short names for the command line: `pattern,scores,q,k,v,z,resid`.
    pub fn parse_list(s: &str) -> Result<Vec<Hook>, String> {
        let mut out = Vec::new();
        for raw in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let part = tl_spelling(raw)?;
            let hooks: &[Hook] = match part.as_str() {
                "pattern" => &[Hook::Pattern],
                "scores" | "attn_scores" => &[Hook::AttnScores],
                "q" => &[Hook::Q],
                "k" => &[Hook::K],
                "v" => &[Hook::V],
                "rot_q" => &[Hook::RotQ],
                "rot_k" => &[Hook::RotK],
                "z" => &[Hook::Z],
                "result" => &[Hook::Result],
                "attn_out" => &[Hook::AttnOut],
                "mlp_out" => &[Hook::MlpOut],
                "mlp_pre" => &[Hook::MlpPre],
                "mlp_post" => &[Hook::MlpPost],
                "mlp_pre_linear" => &[Hook::MlpPreLinear],
                "ln1" => &[Hook::Ln1Scale, Hook::Ln1Normalized],
                "ln2" => &[Hook::Ln2Scale, Hook::Ln2Normalized],
                "ln_final" => &[Hook::LnFinalScale, Hook::LnFinalNormalized],
                "embed" => &[Hook::Embed, Hook::PosEmbed],
                "resid" => &[Hook::ResidPre, Hook::ResidPost],
                "resid_pre" => &[Hook::ResidPre],
                "resid_mid" => &[Hook::ResidMid],
                "resid_post" => &[Hook::ResidPost],
                "ln1_scale" => &[Hook::Ln1Scale],
                "ln1_normalized" => &[Hook::Ln1Normalized],
                "ln2_scale" => &[Hook::Ln2Scale],
                "ln2_normalized" => &[Hook::Ln2Normalized],
                "ln_final_scale" => &[Hook::LnFinalScale],
                "ln_final_normalized" => &[Hook::LnFinalNormalized],
                "token_embed" => &[Hook::Embed],
                "pos_embed" => &[Hook::PosEmbed],
                "all" => &ALL_HOOKS,
                _ => {
                    return Err(format!(
                        "unknown hook `{raw}`; choose from pattern, scores, q, k, v, rot_q, rot_k, z, result, attn_out, mlp_pre, mlp_pre_linear, mlp_post, mlp_out, resid, resid_pre, resid_mid, resid_post, ln1, ln2, ln_final, embed, all (or TransformerLens's names: hook_resid_pre, attn.hook_z, ln1.hook_scale, ...)"
                    ))
                }
            };
            for h in hooks {
                if !out.contains(h) {
                    out.push(*h);
                }
            }
        }
        if out.is_empty() {
            return Err("no hooks given".into());
        }
        Ok(out)
    }

    /// Whether the hook is a `[head, query_pos, key_pos]` attention tensor.
    pub fn is_attention_map(self) -> bool {
        matches!(self, Hook::Pattern | Hook::AttnScores)
    }
}

/// A hook as [`Hook::parse_list`] names it, from TransformerLens's spellings too: a hook point's
/// name within its block (`hook_resid_pre`, `attn.hook_z`, `mlp.hook_post`, `ln1.hook_scale`,
/// `ln_final.hook_normalized`, `hook_embed`), `utils.get_act_name`'s short names and aliases
/// (`resid_pre`, `attn` for the pattern, `attn_logits`, `key`/`query`/`value`, `pre`/`post`/
/// `pre_linear`), and dashes for underscores (`resid-pre`). A full name with its layer
/// (`blocks.3.attn.hook_z`) is refused: the layers are their own option.
fn tl_spelling(raw: &str) -> Result<String, String> {
    let s = raw.to_ascii_lowercase().replace('-', "_");
    if s.starts_with("blocks.") {
        return Err(format!(
            "`{raw}` names a layer: give the hook without it (`{}`) and the layers with --layers",
            s.splitn(3, '.').nth(2).unwrap_or("hook_pattern")
        ));
    }
    // a norm's hook points keep their norm: ln1.hook_scale -> ln1_scale
    for norm in ["ln1", "ln2", "ln_final"] {
        if let Some(rest) = s.strip_prefix(norm).and_then(|r| r.strip_prefix('.')) {
            return Ok(format!("{norm}_{}", rest.trim_start_matches("hook_")));
        }
    }
    let mlp = s.starts_with("mlp.");
    let bare = s
        .trim_start_matches("attn.")
        .trim_start_matches("mlp.")
        .trim_start_matches("hook_");
    Ok(match bare {
        // TransformerLens's aliases (utils.get_act_name)
        "attn" => "pattern",
        "attn_logits" => "attn_scores",
        "key" => "k",
        "query" => "q",
        "value" => "v",
        "pre" => "mlp_pre",
        "post" => "mlp_post",
        "pre_linear" => "mlp_pre_linear",
        // hook_embed is the token embeddings alone; `embed` keeps its meaning (both)
        "embed" if s == "hook_embed" => "token_embed",
        "out" if mlp => "mlp_out",
        other => other,
    }
    .to_string())
}

/// Every hook: the blocks' and the global ones.
const ALL_HOOKS: [Hook; 25] = {
    let mut all = [Hook::Embed; 25];
    let mut i = 0;
    while i < 21 {
        all[i] = Hook::ALL[i];
        i += 1;
    }
    while i < 25 {
        all[i] = Hook::GLOBAL[i - 21];
        i += 1;
    }
    all
};

/// The full TransformerLens-style name of a hook: `blocks.3.attn.hook_pattern`, `hook_embed`.
pub fn hook_name(layer: usize, hook: Hook) -> String {
    if hook.is_global() {
        hook.suffix().to_string()
    } else {
        format!("blocks.{layer}.{}", hook.suffix())
    }
}

/// What the forward hands out. Implementations decide what to keep.
///
/// An observer may also edit (interventions: ablation, patching, steering). Where
/// [`Observer::edits`] says so, the forward hands [`Observer::edit`] the live activation instead
/// of a copy, and whatever the observer writes there is what the rest of the forward computes
/// with. The edited tensor has the shape of the table above (for a forward over stacked
/// segments, their rows stacked). An edit that leaves a non-finite value is refused with an error
/// naming the hook. The attention maps (`hook_attn_scores`, `hook_pattern`) are read-only.
pub trait Observer {
    /// Whether this observer wants `hook` at `layer`; the forward copies nothing otherwise.
    fn wants(&self, layer: usize, hook: Hook) -> bool;
    /// A whole per-position tensor (everything but the attention maps), shape as in the table above.
    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]);
    /// A block of query rows `q_start..q_start + rows` of an attention map, shape
    /// `[n_heads, rows, k_width]`. Keys at `k_width..` are masked for every row of the block
    /// (weight 0, score -inf) and are not included.
    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    );
    /// Whether (and with how many top keys) this observer wants per-(head, query) statistics at
    /// `layer` (computed while streaming, without the weights).
    fn wants_stats(&self, _layer: usize) -> Option<crate::model::attention::StatsRequest> {
        None
    }
    /// Statistics of query rows `q_start..q_start + stats.rows`.
    fn attention_stats(
        &mut self,
        _layer: usize,
        _q_start: usize,
        _stats: &crate::model::attention::AttnStats,
    ) {
    }
    /// Query positions whose whole normalized rows (every head) this observer wants at `layer`
    /// without the rest of the pattern: the forward then streams and recomputes just these.
    fn wants_rows(&self, _layer: usize) -> Vec<usize> {
        Vec::new()
    }
    /// The rows of query position `q` at `layer`: `[n_heads, k_len]`, masked keys 0.
    fn attention_rows(&mut self, _layer: usize, _q: usize, _n_heads: usize, _rows: &[f32]) {}
    /// Called when `layer`'s attention is done: every hook up to [`Hook::Z`] has been handed out
    /// (the output projection and the MLP are still to come). A writer can start on the
    /// layer's patterns here, while the MLP runs.
    fn attention_done(&mut self, _layer: usize) {}
    /// Called after each layer (for progress).
    fn layer_done(&mut self, _layer: usize) {}
    /// In a forward over stacked segments ([`crate::model::Model::forward_segments`]), called
    /// before each segment's attention with its index: the attention's calls that follow
    /// (maps, statistics, rows, their query positions the segment's own) belong to that segment
    /// until the next call. `segments::PerSegment` hands them to that
    /// segment's observer.
    fn segment(&mut self, _index: usize) {}
    /// Whether the forward ends before block `layer`, once that block's `hook_resid_pre` is
    /// handed (TransformerLens's `stop_at_layer`); `n_layers`: after the last block, before the
    /// final norm. A stopped forward computes no logits.
    fn stops_before(&self, _layer: usize) -> bool {
        false
    }
    /// Whether this observer edits `hook` at `layer` (then [`Observer::edit`] gets it; where the
    /// observer also [`Observer::wants`] it, [`Observer::tensor`] or
    /// [`Observer::attention_block`] then hands it the edited tensor).
    fn edits(&self, _layer: usize, _hook: Hook) -> bool {
        false
    }
    /// The live activation at `hook`: what the observer leaves in `data` flows on. An `Err`
    /// stops the forward with [`crate::model::Error::Hook`] naming the hook and the message.
    fn edit(
        &mut self,
        _layer: usize,
        _hook: Hook,
        _shape: &[usize],
        _data: &mut [f32],
    ) -> std::result::Result<(), String> {
        Ok(())
    }
    /// Where the forward may write `layer`'s normalized pattern of query rows `q_start..q_start +
    /// rows` itself, all `k_len` keys of each row (masked ones 0): one slice of `rows · k_len`
    /// values per head, in head order. The attention kernel then computes the scores, the
    /// softmax and the weighted sum of values in the caller's memory and hands no
    /// [`Hook::Pattern`] block over (no copy). `None` (the default): blocks by `attention_block`.
    fn pattern_rows(
        &mut self,
        _layer: usize,
        _q_start: usize,
        _rows: usize,
        _n_heads: usize,
        _k_len: usize,
    ) -> Option<PatternRows<'_>> {
        None
    }
}

/// Writes [`Observer`] methods that hand the call on to an inner observer, for an observer that
/// wraps one (an [`AttnCache`] it fills, or one observer of several) and writes only the methods
/// it changes itself. The inner observer is named as a field, `cache`, or as a field indexed by
/// another, `obs[cur]`; then the methods to hand on, by name:
///
/// ```
/// use attnscope::model::capture::{AttnCache, Observer};
///
/// /// An observer that fills a cache and counts the blocks it was handed.
/// struct Keeps {
///     cache: AttnCache,
///     blocks: usize,
/// }
///
/// impl Observer for Keeps {
///     attnscope::delegate_observer!(cache: wants, tensor, pattern_rows);
///     fn attention_block(
///         &mut self,
///         layer: usize,
///         hook: attnscope::model::capture::Hook,
///         q_start: usize,
///         shape: [usize; 3],
///         data: &[f32],
///     ) {
///         self.blocks += 1;
///         self.cache.attention_block(layer, hook, q_start, shape, data);
///     }
/// }
///
/// // a default cache asks for nothing, and the wrapper says so through the handed-on `wants`
/// let keeps = Keeps { cache: AttnCache::default(), blocks: 0 };
/// assert!(!keeps.wants(0, attnscope::model::capture::Hook::Pattern));
/// assert_eq!(keeps.blocks, 0);
/// ```
#[macro_export]
macro_rules! delegate_observer {
    ($field:ident [$index:ident] : $($method:ident),+ $(,)?) => {
        $($crate::delegate_observer!(@one ($field [$index]) $method);)+
    };
    ($field:ident : $($method:ident),+ $(,)?) => {
        $($crate::delegate_observer!(@one ($field) $method);)+
    };
    (@one ($f:ident $([$i:ident])?) wants) => {
        fn wants(&self, layer: usize, hook: $crate::model::capture::Hook) -> bool {
            self.$f$([self.$i])?.wants(layer, hook)
        }
    };
    (@one ($f:ident $([$i:ident])?) tensor) => {
        fn tensor(
            &mut self,
            layer: usize,
            hook: $crate::model::capture::Hook,
            shape: &[usize],
            data: &[f32],
        ) {
            self.$f$([self.$i])?.tensor(layer, hook, shape, data)
        }
    };
    (@one ($f:ident $([$i:ident])?) attention_block) => {
        fn attention_block(
            &mut self,
            layer: usize,
            hook: $crate::model::capture::Hook,
            q_start: usize,
            shape: [usize; 3],
            data: &[f32],
        ) {
            self.$f$([self.$i])?.attention_block(layer, hook, q_start, shape, data)
        }
    };
    (@one ($f:ident $([$i:ident])?) wants_stats) => {
        fn wants_stats(&self, layer: usize) -> Option<$crate::model::attention::StatsRequest> {
            self.$f$([self.$i])?.wants_stats(layer)
        }
    };
    (@one ($f:ident $([$i:ident])?) attention_stats) => {
        fn attention_stats(
            &mut self,
            layer: usize,
            q_start: usize,
            stats: &$crate::model::attention::AttnStats,
        ) {
            self.$f$([self.$i])?.attention_stats(layer, q_start, stats)
        }
    };
    (@one ($f:ident $([$i:ident])?) wants_rows) => {
        fn wants_rows(&self, layer: usize) -> Vec<usize> {
            self.$f$([self.$i])?.wants_rows(layer)
        }
    };
    (@one ($f:ident $([$i:ident])?) attention_rows) => {
        fn attention_rows(&mut self, layer: usize, q: usize, n_heads: usize, rows: &[f32]) {
            self.$f$([self.$i])?.attention_rows(layer, q, n_heads, rows)
        }
    };
    (@one ($f:ident $([$i:ident])?) attention_done) => {
        fn attention_done(&mut self, layer: usize) {
            self.$f$([self.$i])?.attention_done(layer)
        }
    };
    (@one ($f:ident $([$i:ident])?) layer_done) => {
        fn layer_done(&mut self, layer: usize) {
            self.$f$([self.$i])?.layer_done(layer)
        }
    };
    (@one ($f:ident $([$i:ident])?) stops_before) => {
        fn stops_before(&self, layer: usize) -> bool {
            self.$f$([self.$i])?.stops_before(layer)
        }
    };
    (@one ($f:ident $([$i:ident])?) edits) => {
        fn edits(&self, layer: usize, hook: $crate::model::capture::Hook) -> bool {
            self.$f$([self.$i])?.edits(layer, hook)
        }
    };
    (@one ($f:ident $([$i:ident])?) edit) => {
        fn edit(
            &mut self,
            layer: usize,
            hook: $crate::model::capture::Hook,
            shape: &[usize],
            data: &mut [f32],
        ) -> ::std::result::Result<(), String> {
            self.$f$([self.$i])?.edit(layer, hook, shape, data)
        }
    };
    (@one ($f:ident $([$i:ident])?) pattern_rows) => {
        fn pattern_rows(
            &mut self,
            layer: usize,
            q_start: usize,
            rows: usize,
            n_heads: usize,
            k_len: usize,
        ) -> Option<$crate::model::capture::PatternRows<'_>> {
            self.$f$([self.$i])?.pattern_rows(layer, q_start, rows, n_heads, k_len)
        }
    };
}

/// A caller's rows for the forward to write a pattern block in ([`Observer::pattern_rows`]).
pub struct PatternRows<'a> {
    /// per head, `rows · k_len` values
    pub heads: Vec<&'a mut [f32]>,
    /// each row's keys after the block's last query hold zeros already (fresh memory, or a
    /// recycled whole pattern): they need no writing, so pages wholly past the causal mask are
    /// never touched
    pub zeroed: bool,
}

/// An observer that wants nothing.
pub struct NoCapture;

impl Observer for NoCapture {
    fn wants(&self, _: usize, _: Hook) -> bool {
        false
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
}

/// Which query rows to keep.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Queries {
    /// every query position
    All,
    /// the last position only
    Last,
    /// these positions
    List(Vec<usize>),
}

impl Queries {
    /// The positions kept in a sequence of `seq_len` tokens.
    pub fn resolve(&self, seq_len: usize) -> Vec<usize> {
        match self {
            Queries::All => (0..seq_len).collect(),
            Queries::Last => vec![seq_len.saturating_sub(1)],
            Queries::List(v) => v.clone(),
        }
    }
}

/// What to capture: hook kinds × layers × heads × query rows (TransformerLens' `names_filter`).
#[derive(Clone, Debug)]
pub struct CaptureSpec {
    /// the hook points captured
    pub hooks: Vec<Hook>,
    /// `None` = every layer.
    pub layers: Option<Vec<usize>>,
    /// `None` = every head (for per-head hooks; K/V are indexed by KV head and always kept whole).
    pub heads: Option<Vec<usize>>,
    /// the query rows kept
    pub queries: Queries,
}

impl CaptureSpec {
    /// Every head's pattern, every layer, every query.
    pub fn patterns() -> Self {
        CaptureSpec {
            hooks: vec![Hook::Pattern],
            layers: None,
            heads: None,
            queries: Queries::All,
        }
    }

    /// Every tensor an [`AttnCache`] of this spec will hold after a forward over `seq_len` tokens,
    /// as (hook name, shape), in the order the forward hands them out (layer, then
    /// [`Hook::in_forward_order`]), before anything runs. Hooks the family does not have
    /// (`hook_pos_embed` of a rotary model, an encoder's `rot_q`) are left out.
    pub fn tensors(&self, dims: &super::ModelDims, seq_len: usize) -> Vec<(String, Vec<usize>)> {
        self.keys(dims)
            .into_iter()
            .map(|(l, h)| (hook_name(l, h), self.shape(dims, seq_len, h)))
            .collect()
    }

    /// The (layer, hook) of every tensor [`CaptureSpec::tensors`] lists, in its order.
    pub fn keys(&self, dims: &super::ModelDims) -> Vec<(usize, Hook)> {
        let mut layers = self
            .layers
            .clone()
            .unwrap_or_else(|| (0..dims.n_layers).collect());
        layers.sort_unstable();
        layers.dedup();
        let order = Hook::in_forward_order(dims.arch);
        let mut out = Vec::with_capacity(layers.len() * self.hooks.len());
        for &l in &layers {
            for &h in order.iter().filter(|h| self.hooks.contains(h)) {
                if h.layer_of(l, dims.n_layers) == l {
                    out.push((l, h)); // a global hook: at the layer that hands it only
                }
            }
        }
        out
    }

    /// The shape of `hook`'s tensor for a forward over `seq_len` tokens.
    fn shape(&self, dims: &super::ModelDims, seq_len: usize, h: Hook) -> Vec<usize> {
        let nq = self.queries.resolve(seq_len).len();
        let heads = self.heads.as_ref().map_or(dims.n_heads, |h| h.len());
        match h {
            Hook::Ln1Scale | Hook::Ln2Scale | Hook::LnFinalScale => vec![nq, 1],
            Hook::Embed
            | Hook::PosEmbed
            | Hook::Ln1Normalized
            | Hook::Ln2Normalized
            | Hook::LnFinalNormalized => vec![nq, dims.d_model],
            Hook::MlpPreLinear => vec![nq, dims.d_ff],
            Hook::Result => vec![nq, heads, dims.d_model],
            Hook::ResidPre | Hook::AttnOut | Hook::ResidMid | Hook::MlpOut | Hook::ResidPost => {
                vec![nq, dims.d_model]
            }
            Hook::MlpPre | Hook::MlpPost => vec![nq, dims.d_ff],
            Hook::Q | Hook::RotQ | Hook::Z => vec![nq, heads, dims.head_dim],
            Hook::K | Hook::V | Hook::RotK => vec![nq, dims.n_kv_heads, dims.head_dim],
            Hook::AttnScores | Hook::Pattern => vec![heads, nq, seq_len],
        }
    }
}

/// One captured tensor.
#[derive(Clone, Debug)]
pub struct Captured {
    /// the hook's name (`blocks.3.attn.hook_pattern`)
    pub name: String,
    /// the layer
    pub layer: usize,
    /// the hook point
    pub hook: Hook,
    /// the tensor's shape
    pub shape: Vec<usize>,
    /// the values, row-major
    pub data: Vec<f32>,
    /// The heads kept (index into the model's heads), for per-head hooks.
    pub heads: Option<Vec<usize>>,
    /// The query rows kept, for per-position hooks.
    pub queries: Vec<usize>,
}

/// An attention map of one layer, `[heads.len(), queries.len(), k_len]`.
#[derive(Clone, Debug)]
pub struct AttnPattern<'a> {
    /// the layer
    pub layer: usize,
    /// the heads kept (model head indices)
    pub heads: &'a [usize],
    /// the query positions kept
    pub queries: &'a [usize],
    /// the number of keys per row
    pub k_len: usize,
    /// the weights, row-major `[heads, queries, k_len]`
    pub data: &'a [f32],
}

impl AttnPattern<'_> {
    /// The row of head index `hi` (into `heads`) and query index `qi` (into `queries`).
    pub fn row(&self, hi: usize, qi: usize) -> &[f32] {
        &self.data[(hi * self.queries.len() + qi) * self.k_len..][..self.k_len]
    }
    /// The row of query position `q` for model head `head`, if captured.
    pub fn row_at(&self, head: usize, q: usize) -> Option<&[f32]> {
        let hi = self.heads.iter().position(|&h| h == head)?;
        let qi = self.queries.iter().position(|&x| x == q)?;
        Some(self.row(hi, qi))
    }
}

/// A buffer handed back for reuse, and whether every head's rows hold zeros above the diagonal
/// (it was a whole pattern of every query, as [`AttnCache::take`] gave it).
#[derive(Clone, Debug)]
struct Spare {
    data: Vec<f32>,
    upper_zero: bool,
}

/// A buffer of `len` values for an attention map: a recycled one of that length when there is
/// one, as it is (`Some(upper_zero)`: its old values are overwritten row by row as blocks arrive,
/// and rows no block brought are set to the masked value by [`AttnCache::take`]), else a fresh
/// one of `fill` (`None`). `prefer_upper_zero`: take a buffer with zeros above the diagonal first.
fn buffer(
    spare: &mut Vec<Spare>,
    len: usize,
    fill: f32,
    prefer_upper_zero: bool,
) -> (Vec<f32>, Option<bool>) {
    let fits = |s: &Spare| s.data.len() == len;
    let at = spare
        .iter()
        .position(|s| fits(s) && s.upper_zero == prefer_upper_zero)
        .or_else(|| spare.iter().position(fits));
    match at {
        Some(i) => {
            let s = spare.swap_remove(i);
            (s.data, Some(s.upper_zero))
        }
        None => (vec![fill; len], None),
    }
}

/// The captured activations of one forward, keyed by hook name.
#[derive(Clone, Debug, Default)]
pub struct AttnCache {
    /// the hook points of the spec it was made for
    pub spec_hooks: Vec<Hook>,
    layers: Option<Vec<usize>>,
    heads: Option<Vec<usize>>,
    queries: Vec<usize>,
    seq_len: usize,
    /// the captured tensors, keyed by (layer, hook)
    pub entries: BTreeMap<(usize, Hook), Captured>,
    /// buffers handed back by [`AttnCache::recycle`], reused for the next entry of their size
    spare: Vec<Spare>,
    /// entries on a recycled buffer: which of their kept query rows a block has written
    written: BTreeMap<(usize, Hook), Recycled>,
}

/// An entry being filled on a recycled buffer.
#[derive(Clone, Debug)]
struct Recycled {
    /// which of the kept query rows a block has written
    rows: Vec<bool>,
    /// a pattern whose rows hold zeros above the diagonal already
    upper_zero: bool,
}

/// Whether `queries` are every position of an `n`-token sequence, in order.
fn every_position(queries: &[usize], n: usize) -> bool {
    queries.len() == n && queries.iter().enumerate().all(|(i, &q)| i == q)
}

impl AttnCache {
    /// An empty cache that will keep what `spec` asks for, for a sequence of `seq_len` tokens.
    pub fn new(spec: &CaptureSpec, seq_len: usize) -> Self {
        AttnCache {
            spec_hooks: spec.hooks.clone(),
            layers: spec.layers.clone(),
            heads: spec.heads.clone(),
            queries: spec.queries.resolve(seq_len),
            seq_len,
            entries: BTreeMap::new(),
            spare: Vec::new(),
            written: BTreeMap::new(),
        }
    }

    /// Hands back the data of an entry the caller is done with (a streamed layer's pattern,
    /// written out), so the next layer's entry of that size reuses memory already paged in
    /// rather than faulting a fresh one in (at 2,048 tokens, 235 MB per layer). Its old values
    /// are overwritten as the next blocks arrive, not cleared first (that cost 5.6 GB of writes
    /// at 2,048 tokens): take the entries built on it with [`AttnCache::take`].
    pub fn recycle(&mut self, buf: Vec<f32>) {
        self.keep_spare(Spare {
            data: buf,
            upper_zero: false,
        });
    }

    /// [`AttnCache::recycle`] of an entry as [`AttnCache::take`] gave it after its forward
    /// completed, unchanged: a whole pattern of every query holds zeros above the diagonal (every
    /// key after its query is masked), and a pattern made on it later leaves them as they are
    /// instead of writing them again (at 2,048 tokens, 117 MB a layer whose pages the writing of
    /// the file then reads as the shared zero page).
    pub fn recycle_entry(&mut self, c: Captured) {
        let n = self.seq_len;
        let upper_zero = c.hook == Hook::Pattern
            && self.every_query()
            && every_position(&c.queries, n)
            && matches!(c.shape[..], [h, q, k] if q == n && k == n && h * n * n == c.data.len());
        self.keep_spare(Spare {
            data: c.data,
            upper_zero,
        });
    }

    fn keep_spare(&mut self, s: Spare) {
        if self.spare.len() < 2 {
            self.spare.push(s);
        }
    }

    /// Whether the cache keeps every query position, in order.
    fn every_query(&self) -> bool {
        every_position(&self.queries, self.seq_len)
    }

    /// Captured entries in hook-name order (layer, then position in the block).
    pub fn iter(&self) -> impl Iterator<Item = &Captured> {
        self.entries.values()
    }

    /// Removes and returns an entry, complete: rows of a recycled buffer that no block wrote
    /// (a query the forward did not run) hold the masked value, not an older layer's numbers.
    pub fn take(&mut self, layer: usize, hook: Hook) -> Option<Captured> {
        let mut c = self.entries.remove(&(layer, hook))?;
        if let Some(Recycled { rows: written, .. }) = self.written.remove(&(layer, hook)) {
            let fill = masked_value(hook);
            let n = self.seq_len;
            for head in c.data.chunks_mut(written.len() * n) {
                for (qi, _) in written.iter().enumerate().filter(|(_, &w)| !w) {
                    head[qi * n..(qi + 1) * n].fill(fill);
                }
            }
        }
        Some(c)
    }

    /// The tensor of `hook` at `layer`, if captured.
    pub fn get(&self, layer: usize, hook: Hook) -> Option<&Captured> {
        self.entries.get(&(layer, hook))
    }

    /// The post-softmax pattern of `layer`, if captured.
    pub fn pattern(&self, layer: usize) -> Option<AttnPattern<'_>> {
        self.attention_map(layer, Hook::Pattern)
    }

    /// The `[heads, queries, keys]` map of `hook` (the scores or the pattern) at `layer`, if
    /// captured.
    pub fn attention_map(&self, layer: usize, hook: Hook) -> Option<AttnPattern<'_>> {
        let c = self.get(layer, hook)?;
        Some(AttnPattern {
            layer,
            heads: c.heads.as_deref().expect("attention maps record heads"),
            queries: &c.queries,
            k_len: self.seq_len,
            data: &c.data,
        })
    }

    fn head_list(&self, n: usize) -> Vec<usize> {
        self.heads.clone().unwrap_or_else(|| (0..n).collect())
    }

    /// Makes the entry of an attention map `key` if there is none yet: a fresh buffer of the
    /// masked value, or a recycled one whose rows are then tracked as they are written.
    fn ensure_map(&mut self, key: (usize, Hook), heads: &[usize]) {
        if self.entries.contains_key(&key) {
            return;
        }
        let (layer, hook) = key;
        let (nq, n) = (self.queries.len(), self.seq_len);
        let pattern = hook == Hook::Pattern && self.every_query();
        let (data, recycled) = buffer(
            &mut self.spare,
            heads.len() * nq * n,
            masked_value(hook),
            pattern,
        );
        if let Some(upper_zero) = recycled {
            self.written.insert(
                key,
                Recycled {
                    rows: vec![false; nq],
                    upper_zero: upper_zero && pattern,
                },
            );
        }
        let entry = Captured {
            name: hook_name(layer, hook),
            layer,
            hook,
            shape: vec![heads.len(), nq, n],
            data,
            heads: Some(heads.to_vec()),
            queries: self.queries.clone(),
        };
        self.entries.insert(key, entry);
    }
}

impl Observer for AttnCache {
    fn wants(&self, layer: usize, hook: Hook) -> bool {
        self.spec_hooks.contains(&hook) && self.layers.as_ref().is_none_or(|ls| ls.contains(&layer))
    }

    /// The pattern's own rows, when it keeps every query and every head of a whole forward
    /// (its layout is then the forward's: `[head, query, key]`).
    fn pattern_rows(
        &mut self,
        layer: usize,
        q_start: usize,
        rows: usize,
        n_heads: usize,
        k_len: usize,
    ) -> Option<PatternRows<'_>> {
        let n = self.seq_len;
        let every_query = self.every_query();
        let every_head = self
            .heads
            .as_ref()
            .is_none_or(|h| h.iter().copied().eq(0..n_heads));
        if !self.wants(layer, Hook::Pattern)
            || k_len != n
            || q_start + rows > n
            || !every_query
            || !every_head
        {
            return None;
        }
        let key = (layer, Hook::Pattern);
        self.ensure_map(key, &(0..n_heads).collect::<Vec<_>>());
        // a fresh buffer is all zeros; a recycled one holds an older layer's numbers, zeros
        // above the diagonal where it was a whole pattern (the kernel writes each row up to the
        // block's last query: what is left of the row lies above the diagonal)
        let zeroed = match self.written.get_mut(&key) {
            Some(w) => {
                w.rows[q_start..q_start + rows]
                    .iter_mut()
                    .for_each(|x| *x = true);
                w.upper_zero
            }
            None => true,
        };
        let entry = self.entries.get_mut(&key).expect("made above");
        Some(PatternRows {
            heads: entry
                .data
                .chunks_mut(n * n)
                .map(|head| &mut head[q_start * n..(q_start + rows) * n])
                .collect(),
            zeroed,
        })
    }

    fn tensor(&mut self, layer: usize, hook: Hook, shape: &[usize], data: &[f32]) {
        // shape [pos, (head,) ...]; keep the chosen query rows, and heads for per-head hooks
        let row: usize = shape[1..].iter().product();
        let per_head = matches!(hook, Hook::Q | Hook::RotQ | Hook::Z | Hook::Result);
        let heads = per_head.then(|| self.head_list(shape[1]));
        let mut out = Vec::new();
        for &q in &self.queries {
            let r = &data[q * row..][..row];
            match &heads {
                Some(hs) => {
                    let hd = shape[2];
                    for &h in hs {
                        out.extend_from_slice(&r[h * hd..][..hd]);
                    }
                }
                None => out.extend_from_slice(r),
            }
        }
        let mut new_shape = shape.to_vec();
        new_shape[0] = self.queries.len();
        if let Some(hs) = &heads {
            new_shape[1] = hs.len();
        }
        self.entries.insert(
            (layer, hook),
            Captured {
                name: hook_name(layer, hook),
                layer,
                hook,
                shape: new_shape,
                data: out,
                heads,
                queries: self.queries.clone(),
            },
        );
    }

    fn attention_block(
        &mut self,
        layer: usize,
        hook: Hook,
        q_start: usize,
        shape: [usize; 3],
        data: &[f32],
    ) {
        let [n_heads, rows, k_width] = shape;
        let heads = self.head_list(n_heads);
        let (nq, n) = (self.queries.len(), self.seq_len);
        let fill = masked_value(hook);
        let key = (layer, hook);
        self.ensure_map(key, &heads);
        let entry = self.entries.get_mut(&key).expect("made above");
        let written = self.written.get_mut(&key);
        // the kept queries of this block: (index among the kept, row in the block)
        let kept: Vec<(usize, usize)> = self
            .queries
            .iter()
            .enumerate()
            .filter(|&(_, &q)| q >= q_start && q < q_start + rows)
            .map(|(qi, &q)| (qi, q - q_start))
            .collect();
        if kept.is_empty() {
            return;
        }
        // one head per task: a fresh buffer is paged in on first write, and the kernel's work
        // of clearing pages (a quarter of an all-pattern forward's time, measured) then runs on
        // every core rather than on this one
        // a recycled buffer's rows get their masked tail too (a fresh one holds it already)
        let tail = written.is_some();
        let copy = |(dst, &h): (&mut [f32], &usize)| {
            for &(qi, r) in &kept {
                let src = &data[(h * rows + r) * k_width..][..k_width];
                let row = &mut dst[qi * n..(qi + 1) * n];
                row[..k_width].copy_from_slice(src);
                if tail {
                    row[k_width..].fill(fill);
                }
            }
        };
        if kept.len() * k_width * heads.len() >= 1 << 16 {
            entry
                .data
                .par_chunks_mut(nq * n)
                .zip(heads.par_iter())
                .for_each(copy);
        } else {
            entry
                .data
                .chunks_mut(nq * n)
                .zip(heads.iter())
                .for_each(copy);
        }
        if let Some(w) = written {
            kept.iter().for_each(|&(qi, _)| w.rows[qi] = true);
        }
    }
}

/// What a masked key holds in an attention map: weight 0, score -inf.
fn masked_value(hook: Hook) -> f32 {
    if hook == Hook::AttnScores {
        f32::NEG_INFINITY
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Writes a whole causal pattern of `layer` through `pattern_rows` as the kernel does (each
    /// row up to its block's last query, the rest only when the rows are not `zeroed`); returns
    /// whether the rows came `zeroed`.
    fn write_pattern(c: &mut AttnCache, layer: usize, heads: usize, n: usize) -> bool {
        let mut zeroed = Vec::new();
        for q0 in (0..n).step_by(2) {
            let rows = 2.min(n - q0);
            let d = c
                .pattern_rows(layer, q0, rows, heads, n)
                .expect("every query and head");
            zeroed.push(d.zeroed);
            for head in d.heads {
                for (r, row) in head.chunks_mut(n).enumerate() {
                    let kw = q0 + rows;
                    for (j, x) in row.iter_mut().enumerate() {
                        if j < kw {
                            *x = if j <= q0 + r { 0.5 } else { 0.0 };
                        } else if !d.zeroed {
                            *x = 0.0;
                        }
                    }
                }
            }
        }
        assert!(zeroed.iter().all(|&z| z == zeroed[0]));
        zeroed[0]
    }

    /// A whole pattern handed back by `recycle_entry` is reused with its zeros above the
    /// diagonal left in place; a raw buffer, a score map's (-inf there) or a pattern of a few
    /// queries is reused as an older layer's numbers, to be overwritten. Every pattern made on
    /// them reads back the same.
    #[test]
    fn only_a_whole_recycled_pattern_keeps_its_zeros_above_the_diagonal() {
        let (heads, n) = (2, 5);
        let spec = |hooks: Vec<Hook>, queries| CaptureSpec {
            hooks,
            layers: None,
            heads: None,
            queries,
        };
        let mut c = AttnCache::new(&spec(vec![Hook::Pattern], Queries::All), n);
        assert!(
            write_pattern(&mut c, 0, heads, n),
            "a fresh buffer is zeros"
        );
        let want = c.take(0, Hook::Pattern).unwrap();
        c.recycle_entry(want.clone());
        assert!(
            write_pattern(&mut c, 1, heads, n),
            "a recycled whole pattern"
        );
        let got = c.take(1, Hook::Pattern).unwrap();
        assert_eq!(got.data, want.data);
        // a buffer of unknown contents
        c.recycle(vec![7.0; heads * n * n]);
        assert!(!write_pattern(&mut c, 2, heads, n));
        assert_eq!(c.take(2, Hook::Pattern).unwrap().data, want.data);
        // a score map of the same size
        let mut scores = got.clone();
        scores.hook = Hook::AttnScores;
        scores.data.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
        c.recycle_entry(scores);
        assert!(!write_pattern(&mut c, 3, heads, n));
        assert_eq!(c.take(3, Hook::Pattern).unwrap().data, want.data);
        // with both at hand, the pattern's buffer is the one taken for a pattern
        let mut scores = got.clone();
        scores.hook = Hook::AttnScores;
        c.recycle_entry(scores);
        c.recycle_entry(got);
        assert!(write_pattern(&mut c, 4, heads, n));
        // a pattern of some queries has other rows: never kept as a whole one
        let mut part = want.clone();
        part.queries = vec![1, 3];
        part.shape = vec![heads, 2, n];
        part.data.truncate(heads * 2 * n);
        c.spare.clear();
        c.recycle_entry(part);
        assert!(!c.spare[0].upper_zero);
    }

    /// The hook-name list is part of the API (TransformerLens test_cache_hook_names): pin it.
    #[test]
    fn hook_names_are_pinned() {
        let names: Vec<String> = Hook::ALL.iter().map(|&h| hook_name(2, h)).collect();
        assert_eq!(
            names,
            [
                "blocks.2.hook_resid_pre",
                "blocks.2.ln1.hook_scale",
                "blocks.2.ln1.hook_normalized",
                "blocks.2.attn.hook_q",
                "blocks.2.attn.hook_k",
                "blocks.2.attn.hook_v",
                "blocks.2.attn.hook_rot_q",
                "blocks.2.attn.hook_rot_k",
                "blocks.2.attn.hook_attn_scores",
                "blocks.2.attn.hook_pattern",
                "blocks.2.attn.hook_z",
                "blocks.2.attn.hook_result",
                "blocks.2.hook_attn_out",
                "blocks.2.hook_resid_mid",
                "blocks.2.ln2.hook_scale",
                "blocks.2.ln2.hook_normalized",
                "blocks.2.mlp.hook_pre",
                "blocks.2.mlp.hook_pre_linear",
                "blocks.2.mlp.hook_post",
                "blocks.2.hook_mlp_out",
                "blocks.2.hook_resid_post",
            ]
        );
        let global: Vec<String> = Hook::GLOBAL.iter().map(|&h| hook_name(2, h)).collect();
        assert_eq!(
            global,
            [
                "hook_embed",
                "hook_pos_embed",
                "ln_final.hook_scale",
                "ln_final.hook_normalized"
            ]
        );
    }

    #[test]
    fn cache_assembles_blocks_and_pads_masked_keys() {
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern],
            layers: Some(vec![1]),
            heads: Some(vec![1]),
            queries: Queries::All,
        };
        let mut c = AttnCache::new(&spec, 3);
        assert!(!c.wants(0, Hook::Pattern) && c.wants(1, Hook::Pattern) && !c.wants(1, Hook::Q));
        // two heads; block of rows 0..2 (keys 0..2), then row 2 (keys 0..3)
        c.attention_block(
            1,
            Hook::Pattern,
            0,
            [2, 2, 2],
            &[1.0, 0.0, 0.5, 0.5, 1.0, 0.0, 0.2, 0.8],
        );
        c.attention_block(
            1,
            Hook::Pattern,
            2,
            [2, 1, 3],
            &[0.3, 0.3, 0.4, 0.1, 0.1, 0.8],
        );
        let p = c.pattern(1).unwrap();
        assert_eq!(p.data, &[1.0, 0.0, 0.0, 0.2, 0.8, 0.0, 0.1, 0.1, 0.8]);
        assert_eq!(p.row_at(1, 2).unwrap(), &[0.1, 0.1, 0.8]);
        assert!(p.row_at(0, 2).is_none());
    }

    /// Blocks large enough for the copy to run one head per task, into a fresh buffer and into
    /// recycled ones (overwritten, not cleared): every value lands where a plain loop puts it, and
    /// rows no block brought (layer 2 runs only its first block) hold the masked value, not an
    /// older layer's numbers.
    #[test]
    fn large_blocks_and_recycled_buffers_land_in_place() {
        let (heads, n, rows) = (4usize, 256usize, 128usize);
        let spec = CaptureSpec {
            hooks: vec![Hook::Pattern, Hook::AttnScores],
            layers: None,
            heads: Some(vec![3, 1]),
            queries: Queries::All,
        };
        let value = |l: usize, h: usize, q: usize, k: usize| {
            (l * 1_000_000 + h * 100_000 + q * 300 + k) as f32
        };
        let mut c = AttnCache::new(&spec, n);
        for layer in 0..3 {
            for hook in [Hook::Pattern, Hook::AttnScores] {
                let blocks: &[usize] = if layer == 2 { &[0] } else { &[0, rows] };
                for &q0 in blocks {
                    // keys up to the block's last query, as the forward hands them over
                    let kw = q0 + rows;
                    let mut data = vec![0f32; heads * rows * kw];
                    for h in 0..heads {
                        for r in 0..rows {
                            for k in 0..kw {
                                data[(h * rows + r) * kw + k] = value(layer, h, q0 + r, k);
                            }
                        }
                    }
                    c.attention_block(layer, hook, q0, [heads, rows, kw], &data);
                }
                let e = c.take(layer, hook).unwrap();
                let masked = if hook == Hook::AttnScores {
                    f32::NEG_INFINITY
                } else {
                    0.0
                };
                for (hi, &h) in [3usize, 1].iter().enumerate() {
                    for q in 0..n {
                        for k in 0..n {
                            let want = if k < (q / rows + 1) * rows
                                && blocks.contains(&(q / rows * rows))
                            {
                                value(layer, h, q, k)
                            } else {
                                masked
                            };
                            let got = e.data[(hi * n + q) * n + k];
                            assert!(
                                got == want,
                                "layer {layer} {hook:?} head {h} ({q}, {k}): {got} vs {want}"
                            );
                        }
                    }
                }
                // the next layer's entry of this hook reuses the buffer
                c.recycle(e.data);
            }
        }
    }

    #[test]
    fn hook_list_parsing() {
        assert_eq!(
            Hook::parse_list("pattern,resid").unwrap(),
            vec![Hook::Pattern, Hook::ResidPre, Hook::ResidPost]
        );
        assert!(Hook::parse_list("patern")
            .unwrap_err()
            .contains("unknown hook `patern`"));
    }

    /// #59: TransformerLens's spellings, and dashes, name the same hooks.
    #[test]
    fn hook_lists_take_transformer_lens_spellings() {
        let same = [
            ("hook_resid_pre", "resid_pre"),
            ("resid-pre", "resid_pre"),
            ("attn.hook_z", "z"),
            ("attn.hook_pattern,attn", "pattern"),
            ("attn_logits", "scores"),
            ("key,query,value", "k,q,v"),
            (
                "mlp.hook_pre,mlp.hook_post,mlp.hook_pre_linear",
                "mlp_pre,mlp_post,mlp_pre_linear",
            ),
            ("hook_mlp_out,HOOK_ATTN_OUT", "mlp_out,attn_out"),
        ];
        for (tl, ours) in same {
            assert_eq!(Hook::parse_list(tl), Hook::parse_list(ours), "{tl}");
        }
        assert_eq!(
            Hook::parse_list("ln1.hook_scale,ln_final.hook_normalized").unwrap(),
            vec![Hook::Ln1Scale, Hook::LnFinalNormalized]
        );
        assert_eq!(Hook::parse_list("hook_embed").unwrap(), vec![Hook::Embed]);
        let e = Hook::parse_list("blocks.3.attn.hook_z").unwrap_err();
        assert!(e.contains("attn.hook_z") && e.contains("--layers"), "{e}");
    }
}
