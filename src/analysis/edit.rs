//! The editing machinery that ablation, patching and value zeroing share: an editing observer
//! ([`Editor`]: [`Patch`]es of one hook of one layer, each a [`Fill`]) and a [`Runner`] that runs
//! a text's edited [`Variant`]s, many to a forward.
//!
//! An edit at layer `l` leaves every earlier layer as it was, and an edit at position `p` leaves
//! every earlier position as it was. So each edited run resumes from the clean run's residual
//! stream at layer `l` ([`Resume`]) and, where the edit starts at a position, reuses the clean
//! run's keys and values of the positions before it ([`KvPrefix`]). Many edited runs of one
//! text go through one forward as stacked segments (the projections read their weights once for
//! all of them), each with its own edit. The numbers are each variant's own: the kernels compute
//! each row alone and the attention runs per segment.

use crate::model::capture::{AttnCache, CaptureSpec, Hook, Observer, Queries};
use crate::model::forward::{KvPrefix, Resume, RunOptions, Segment};
use crate::model::{Error, Model, Result};
use std::ops::Range;

/// What an edit writes.
#[derive(Clone, Copy, Debug)]
pub enum Fill<'a> {
    /// zeros
    Zero,
    /// the mean over the segment's rows of the same values (before the edit)
    Mean,
    /// the same values of another run: `[segment rows, row width]`, aligned with the segment
    From(&'a [f32]),
}

/// One edit of one segment's rows of a hook's tensor.
#[derive(Clone, Debug)]
pub struct Patch<'a> {
    /// the segment's rows in the stacked tensor
    pub rows: Range<usize>,
    /// the values of a row it edits (one head's `head·d_head..(head+1)·d_head`, or all of them)
    pub cols: Range<usize>,
    /// the segment's rows it writes, relative to `rows.start`
    pub at: Vec<usize>,
    pub fill: Fill<'a>,
}

/// An observer that edits one hook of one layer ([`Observer::edit`]) and watches nothing.
#[derive(Clone, Debug)]
pub struct Editor<'a> {
    pub layer: usize,
    pub hook: Hook,
    pub patches: Vec<Patch<'a>>,
}

impl Editor<'_> {
    /// Applies the patches to `data` (`[rows, width]`).
    pub fn apply(&self, width: usize, data: &mut [f32]) -> std::result::Result<(), String> {
        for p in &self.patches {
            if p.rows.end * width > data.len() || p.cols.end > width {
                return Err(format!(
                    "an edit of rows {:?}, values {:?} does not fit a tensor of {} rows of {width}",
                    p.rows,
                    p.cols,
                    data.len() / width.max(1)
                ));
            }
            let seg = &mut data[p.rows.start * width..p.rows.end * width];
            let rows = p.rows.len();
            let mean: Vec<f32> = match p.fill {
                Fill::Mean => {
                    let mut acc = vec![0f64; p.cols.len()];
                    for r in 0..rows {
                        let row = &seg[r * width..][p.cols.clone()];
                        acc.iter_mut().zip(row).for_each(|(a, &v)| *a += v as f64);
                    }
                    acc.iter().map(|a| (a / rows as f64) as f32).collect()
                }
                _ => Vec::new(),
            };
            for &r in &p.at {
                if r >= rows {
                    return Err(format!("an edit of row {r} of a segment of {rows} rows"));
                }
                let dst = &mut seg[r * width..(r + 1) * width][p.cols.clone()];
                match p.fill {
                    Fill::Zero => dst.fill(0.0),
                    Fill::Mean => dst.copy_from_slice(&mean),
                    Fill::From(src) => {
                        let from = src
                            .get(r * width..(r + 1) * width)
                            .ok_or_else(|| format!("the source has no row {r}"))?;
                        dst.copy_from_slice(&from[p.cols.clone()])
                    }
                }
            }
        }
        Ok(())
    }
}

impl Observer for Editor<'_> {
    fn wants(&self, _: usize, _: Hook) -> bool {
        false
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(&mut self, _: usize, _: Hook, _: usize, _: [usize; 3], _: &[f32]) {}
    fn edits(&self, layer: usize, hook: Hook) -> bool {
        layer == self.layer && hook == self.hook
    }
    fn edit(
        &mut self,
        _: usize,
        _: Hook,
        shape: &[usize],
        data: &mut [f32],
    ) -> std::result::Result<(), String> {
        self.apply(shape[1..].iter().product(), data)
    }
}

/// One edited run: the text from position `from` on (the positions before it reused), resumed
/// at the runner's layer, with one edit of its rows (`at` relative to the variant: `0..n-from`).
/// For an attention map (`hook_pattern`, `hook_attn_scores`: `[heads, query, key]`) `at` names
/// heads and `cols` the values of a head's map.
#[derive(Clone, Debug)]
pub struct Variant<'a> {
    pub from: usize,
    pub cols: Range<usize>,
    pub at: Vec<usize>,
    pub fill: Fill<'a>,
}

/// Runs edited variants of one text and returns each one's last-position logits.
pub struct Runner<'a> {
    pub model: &'a Model,
    pub tokens: &'a [u32],
    /// the clean (unedited) run's `hook_resid_pre` of every layer, `[n, d_model]` each
    pub resid_pre: Vec<Vec<f32>>,
    /// the clean run's keys and values (for variants that start past position 0)
    pub kv: Option<KvPrefix>,
    /// the most rows stacked in one forward (at least one variant always goes)
    pub batch_rows: usize,
    /// forward passes run and rows computed (layers × positions), for the report
    pub passes: usize,
    pub layer_rows: usize,
}

impl<'a> Runner<'a> {
    /// The clean run of `tokens`: its last-position logits, and a runner that resumes from it.
    /// `capture` (hooks of every layer, all positions) is filled by the same forward.
    pub fn clean(
        model: &'a Model,
        tokens: &'a [u32],
        extra: &[Hook],
    ) -> Result<(Runner<'a>, Vec<f32>, AttnCache)> {
        let n = tokens.len();
        let mut hooks = vec![Hook::ResidPre];
        hooks.extend(extra.iter().filter(|&&h| h != Hook::ResidPre));
        let mut cache = AttnCache::new(
            &CaptureSpec {
                hooks,
                layers: None,
                heads: None,
                queries: Queries::All,
            },
            n,
        );
        let mut out = model.forward(
            tokens,
            &RunOptions {
                logits_at: vec![n - 1],
                keep_kv: true,
                ..Default::default()
            },
            &mut cache,
        )?;
        let resid_pre = (0..model.dims.n_layers)
            .map(|l| {
                cache
                    .get(l, Hook::ResidPre)
                    .expect("every layer's hook_resid_pre was captured")
                    .data
                    .clone()
            })
            .collect();
        let logits = out.logits.pop().expect("one row of logits was asked for");
        let runner = Runner {
            model,
            tokens,
            resid_pre,
            kv: out.kv.take(),
            batch_rows: 1024,
            passes: 1,
            layer_rows: model.dims.n_layers * n,
        };
        Ok((runner, logits, cache))
    }

    /// Runs `variants`, each edited at `hook` of `layer`, resumed there; last-position logits of
    /// each, in order. `tick(done)` after each forward.
    pub fn run(
        &mut self,
        layer: usize,
        hook: Hook,
        variants: &[Variant],
        tick: impl FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        self.run_logits(layer, hook, variants, false, tick)
    }

    /// As [`Runner::run`], with each variant's logits at every position from its `from` on
    /// (`[n - from, vocab]`, flattened), for a metric that reads more than the last position
    /// (the positions before `from` are the unedited run's).
    pub fn run_every_position(
        &mut self,
        layer: usize,
        hook: Hook,
        variants: &[Variant],
    ) -> Result<Vec<Vec<f32>>> {
        self.run_logits(layer, hook, variants, true, |_| {})
    }

    fn run_logits(
        &mut self,
        layer: usize,
        hook: Hook,
        variants: &[Variant],
        every: bool,
        mut tick: impl FnMut(usize),
    ) -> Result<Vec<Vec<f32>>> {
        let n = self.tokens.len();
        let mut out = Vec::with_capacity(variants.len());
        // the maps are handed over per segment: their variants run one at a time
        let maps = hook.is_attention_map();
        let mut start = 0;
        while start < variants.len() {
            // as many variants as fit in batch_rows (at least one)
            let mut end = start + 1;
            let mut rows = n - variants[start].from;
            while !maps && end < variants.len() && rows + n - variants[end].from <= self.batch_rows
            {
                rows += n - variants[end].from;
                end += 1;
            }
            let chunk = &variants[start..end];
            let (segs, resid, patches) = self.stack(layer, chunk, maps, every)?;
            let mut editor = Editor {
                layer,
                hook,
                patches,
            };
            let prefix = if chunk.iter().any(|v| v.from > 0) {
                self.kv.as_ref()
            } else {
                None
            };
            let res = self.model.forward_segments(
                prefix,
                &segs,
                Some(Resume { layer, resid }),
                &RunOptions::default(),
                &mut editor,
            )?;
            if every {
                // each variant's rows, in order
                let mut lg = res.logits.into_iter();
                for v in chunk {
                    out.push(lg.by_ref().take(n - v.from).flatten().collect());
                }
            } else {
                out.extend(res.logits);
            }
            self.passes += 1;
            self.layer_rows += (self.model.dims.n_layers - layer) * rows;
            start = end;
            tick(end);
        }
        Ok(out)
    }

    /// One forward's segments, resumed residual stream and edits for `chunk`.
    #[allow(clippy::type_complexity)]
    fn stack<'v>(
        &self,
        layer: usize,
        chunk: &[Variant<'v>],
        maps: bool,
        every: bool,
    ) -> Result<(Vec<Segment<'a>>, Vec<f32>, Vec<Patch<'v>>)> {
        let n = self.tokens.len();
        let dm = self.model.dims.d_model;
        let mut segs = Vec::with_capacity(chunk.len());
        let mut resid = Vec::new();
        let mut patches = Vec::with_capacity(chunk.len());
        let mut r0 = 0;
        for v in chunk {
            if v.from >= n {
                return Err(Error::OutOfRange {
                    what: "position".into(),
                    value: v.from.to_string(),
                    range: format!("0..={}", n - 1),
                });
            }
            let m = n - v.from;
            segs.push(Segment {
                tokens: &self.tokens[v.from..],
                reuse: v.from,
                knockout: Vec::new(),
                logits_at: if every {
                    (v.from..n).collect()
                } else {
                    vec![n - 1]
                },
            });
            resid.extend_from_slice(&self.resid_pre[layer][v.from * dm..]);
            patches.push(Patch {
                rows: if maps {
                    0..self.model.dims.n_heads
                } else {
                    r0..r0 + m
                },
                cols: v.cols.clone(),
                at: v.at.clone(),
                fill: v.fill,
            });
            r0 += m;
        }
        Ok((segs, resid, patches))
    }
}
