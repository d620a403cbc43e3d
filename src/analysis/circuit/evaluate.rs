//! A circuit's faithfulness by exact edge patching, and single edges patched exactly (path
//! patching, Wang et al. 2022), on the forward whose readers read their own inputs
//! ([`crate::model::backward::EditedForward`]).
//!
//! Semantics (hannamw/EAP-IG's `evaluate_graph`, as MIB runs it): the clean text runs; at each
//! reader r, every edge u → r *not* in the circuit has its upstream node's output of this run
//! replaced by the corrupted run's: `in_r = resid_r + Σ_{u→r ∉ C} (a_u(corrupt) − a_u(run))`,
//! q, k and v of each head apart. The empty circuit is then the corrupted run (every reader reads
//! the corrupted residual stream, exactly), the full circuit the clean run. EAP-IG prunes a
//! circuit first (edges of nodes not connected to both ends); that changes no number here (an
//! edge from a node none of whose inputs is in the circuit carries the corrupted output anyway;
//! an edge into a node none of whose outputs is in the circuit reaches nothing).
//!
//! MIB (Mueller et al. 2025, arXiv:2504.13151, its `evaluate_area_under_curve`): circuits of the
//! top `⌊p · edges⌋` edges for p in 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100%; faithfulness
//! `f = (m(C) − m(∅)) / (m(N) − m(∅))` (∅ the empty circuit, N the whole model); CPR is the area
//! under f over p (the trapezoid rule on p's linear scale, 0.001 to 1), with edges ranked by their
//! signed score (here: by −score, the edges that carry the clean behaviour first); CMD the area
//! between f and 1, `∫ |1 − f| dp`, with edges ranked by |score|.

use super::graph::{ranked, Graph, Node, Ranking, Reader};
use super::{edge_score, MetricKind, PairTokens, Scores};
use crate::analysis::vocab::spearman;
use crate::model::backward::{EditedForward, Prefix, ReaderEdit};
use crate::model::{Model, Result};
use rayon::prelude::*;
use serde::Serialize;

/// MIB's circuit sizes, as fractions of the edges.
pub const FRACTIONS: [f64; 10] = [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0];

/// Most bytes the per-variant node differences of one batch of circuits may take.
const DIFF_BYTES: usize = 384 << 20;

/// Most rows (variants × tokens) in one edited forward.
const MAX_ROWS: usize = 4096;

/// One circuit size.
#[derive(Clone, Debug, Serialize)]
pub struct LadderPoint {
    pub fraction: f64,
    pub edges: usize,
    /// the metric with the circuit's edges clean and every other edge corrupted (mean over pairs)
    pub metric: f32,
    pub faithfulness: f64,
}

/// A circuit's evaluation at MIB's sizes.
#[derive(Clone, Debug, Serialize)]
pub struct Evaluation {
    /// the clean and corrupted runs through the edited forward (what faithfulness is relative to)
    pub clean_metric: f32,
    pub corrupt_metric: f32,
    /// the top edges by |score|
    pub ladder: Vec<LadderPoint>,
    /// the top edges by −score (the edges that carry the clean behaviour first)
    pub signed_ladder: Vec<LadderPoint>,
    /// MIB's circuit performance ratio: the area under the signed ladder's faithfulness
    pub cpr: f64,
    /// MIB's circuit-model distance: the area between the |score| ladder's faithfulness and 1
    pub cmd: f64,
    pub seconds: f64,
}

/// One edge patched alone.
#[derive(Clone, Debug, Serialize)]
pub struct ExactEdge {
    pub from: String,
    pub to: String,
    /// its EAP / EAP-IG score: the estimate of `exact`
    pub score: f32,
    /// `m(clean run with this edge carrying the corrupted activation) − m(clean)`, mean over
    /// pairs
    pub exact: f32,
}

/// The top edges patched one at a time.
#[derive(Clone, Debug, Serialize)]
pub struct ExactEdges {
    pub edges: Vec<ExactEdge>,
    /// Spearman's ρ of the scores and the exact changes
    pub spearman: Option<f64>,
    pub seconds: f64,
}

/// What a run through the edited forward records: every upstream node's output `[nodes, n·d]`,
/// the residual stream entering each layer and its MLP, the final one, each layer's q|k|v
/// projection (a later run's [`Prefix`]), and the metric.
struct Record {
    nodes: Vec<f32>,
    pre: Vec<Vec<f32>>,
    mid: Vec<Vec<f32>>,
    last: Vec<f32>,
    qkv: Vec<Vec<f32>>,
    metric: f32,
}

impl Record {
    /// The first `rows` positions of this run as a prefix.
    fn prefix(&self, rows: usize) -> Prefix<'_> {
        Prefix {
            rows,
            qkv: &self.qkv,
        }
    }
}

/// Records one sequence's run, editing nothing.
struct Recorder<'a> {
    graph: &'a Graph,
    width: usize,
    rec: Record,
}

impl ReaderEdit for Recorder<'_> {
    fn input(&mut self, x: &[f32]) -> Result<()> {
        self.rec.nodes[..self.width].copy_from_slice(x);
        Ok(())
    }

    fn heads(&mut self, layer: usize, outs: &[f32]) -> Result<()> {
        let at = self.graph.node_index(Node::Head { layer, head: 0 }) * self.width;
        self.rec.nodes[at..at + outs.len()].copy_from_slice(outs);
        Ok(())
    }

    fn mlp(&mut self, layer: usize, out: &[f32]) -> Result<()> {
        let at = self.graph.node_index(Node::Mlp { layer }) * self.width;
        self.rec.nodes[at..at + out.len()].copy_from_slice(out);
        Ok(())
    }

    fn read(&mut self, reader: Reader, resid: &[f32], _: &mut [f32]) -> Result<bool> {
        match reader {
            Reader::Q { head: 0, .. } => self.rec.pre.push(resid.to_vec()),
            Reader::Mlp { .. } => self.rec.mid.push(resid.to_vec()),
            Reader::Logits => self.rec.last = resid.to_vec(),
            _ => {}
        }
        Ok(false)
    }

    fn projected(&mut self, _: usize, qkv: &[f32]) {
        self.rec.qkv.push(qkv.to_vec());
    }
}

/// One text's run through the edited forward, recorded.
fn record(
    fwd: &EditedForward,
    g: &Graph,
    tokens: &[u32],
    m: crate::model::backward::Metric,
) -> Result<Record> {
    let (x, _) = fwd.model().input_embeddings(tokens)?;
    let mut r = Recorder {
        graph: g,
        width: x.len(),
        rec: Record {
            nodes: vec![0f32; g.n_nodes() * x.len()],
            pre: Vec::new(),
            mid: Vec::new(),
            last: Vec::new(),
            qkv: Vec::new(),
            metric: 0.0,
        },
    };
    let v = fwd.run(&x, (tokens.len(), 1), (0, None), m, &mut r)?;
    r.rec.metric = v[0];
    Ok(r.rec)
}

/// Circuits run in one batch: each variant keeps the edges whose rank is below its size. The
/// run computes each sequence's rows from the texts' first difference on (`skip` values into a
/// row of the record: before it every variant is the corrupted run).
struct CircuitEdit<'a> {
    graph: &'a Graph,
    corrupt: &'a Record,
    /// per variant: the edges' ranks (by the variant's ranking) and the circuit's size
    circuits: Vec<(&'a [u32], usize)>,
    /// the values of one sequence's computed rows, and the values before them
    width: usize,
    skip: usize,
    /// `[nodes][variants][n·d]`: each variant's node outputs minus the corrupted run's
    diff: Vec<f32>,
}

impl CircuitEdit<'_> {
    /// Node `u`'s outputs of every variant (`[variants][n·d]`), minus the corrupted run's.
    fn set_diff(&mut self, u: usize, outs: &[f32]) {
        let (w, b) = (self.width, self.circuits.len());
        let full = self.skip + w;
        let corr = &self.corrupt.nodes[u * full + self.skip..(u + 1) * full];
        let dst = &mut self.diff[u * b * w..(u + 1) * b * w];
        dst.par_chunks_mut(w)
            .zip(outs.par_chunks(w))
            .for_each(|(d, o)| {
                for ((d, o), c) in d.iter_mut().zip(o).zip(corr) {
                    *d = o - c;
                }
            });
    }
}

impl ReaderEdit for CircuitEdit<'_> {
    fn input(&mut self, x: &[f32]) -> Result<()> {
        self.set_diff(0, x);
        Ok(())
    }

    fn heads(&mut self, layer: usize, outs: &[f32]) -> Result<()> {
        let first = self.graph.node_index(Node::Head { layer, head: 0 });
        let per = outs.len() / self.graph.n_heads;
        for h in 0..self.graph.n_heads {
            self.set_diff(first + h, &outs[h * per..(h + 1) * per]);
        }
        Ok(())
    }

    fn mlp(&mut self, layer: usize, out: &[f32]) -> Result<()> {
        let u = self.graph.node_index(Node::Mlp { layer });
        self.set_diff(u, out);
        Ok(())
    }

    fn read(&mut self, reader: Reader, resid: &[f32], out: &mut [f32]) -> Result<bool> {
        let g = self.graph;
        let (w, nb) = (self.width, self.circuits.len());
        let (off, reads) = (g.offset(g.reader_index(reader)), g.reads(reader));
        let corr: &[f32] = match reader {
            Reader::Q { layer, .. } | Reader::K { layer, .. } | Reader::V { layer, .. } => {
                &self.corrupt.pre[layer][self.skip..]
            }
            Reader::Mlp { layer } => &self.corrupt.mid[layer][self.skip..],
            Reader::Logits => &self.corrupt.last[self.skip..],
        };
        let diff = &self.diff;
        // the variants apart, in parallel (each writes its own rows)
        let edited = out[..nb * w]
            .par_chunks_mut(w)
            .zip(resid.par_chunks(w))
            .zip(self.circuits.par_iter())
            .enumerate()
            .map(|(b, ((dst, src), &(rank, size)))| {
                let inside = |u: usize| (rank[off + u] as usize) < size;
                let n_in = (0..reads).filter(|&u| inside(u)).count();
                // the shorter sum: from the corrupted stream up the circuit's edges, or from
                // this run's stream down the others
                let (from_corrupt, sign) = if n_in <= reads - n_in {
                    (true, 1.0)
                } else {
                    (false, -1.0)
                };
                dst.copy_from_slice(if from_corrupt { corr } else { src });
                for u in (0..reads).filter(|&u| inside(u) == from_corrupt) {
                    let d = &diff[(u * nb + b) * w..(u * nb + b + 1) * w];
                    dst.iter_mut().zip(d).for_each(|(o, d)| *o += sign * d);
                }
                n_in < reads
            })
            .reduce(|| false, |a, b| a | b);
        Ok(edited)
    }
}

/// The metric of each circuit `(ranks, size)` on one pair (the clean text's input `x` of `n`
/// tokens, the corrupted run's record, the texts' first differing position `p`): batches of
/// circuits through the edited forward, each sequence's rows from `p` on (before it every
/// variant is the corrupted run: the texts are the same there).
fn circuit_metrics(
    fwd: &EditedForward,
    g: &Graph,
    (x, n, p): (&[f32], usize, usize),
    corrupt: &Record,
    circuits: &[(&[u32], usize)],
    metric: crate::model::backward::Metric,
) -> Result<Vec<f32>> {
    let skip = x.len() / n * p;
    let w = x.len() - skip;
    let per_batch = (DIFF_BYTES / (g.n_nodes() * w * 4))
        .min(MAX_ROWS / (n - p))
        .max(1);
    let prefix = corrupt.prefix(p);
    let mut out = Vec::with_capacity(circuits.len());
    for chunk in circuits.chunks(per_batch) {
        let b = chunk.len();
        let mut edit = CircuitEdit {
            graph: g,
            corrupt,
            circuits: chunk.to_vec(),
            width: w,
            skip,
            diff: vec![0f32; g.n_nodes() * b * w],
        };
        let xs: Vec<f32> = (0..b).flat_map(|_| x[skip..].iter().copied()).collect();
        out.extend(fwd.run(&xs, (n, b), (0, Some(&prefix)), metric, &mut edit)?);
    }
    Ok(out)
}

/// The first position at which the pair's texts differ, at most the last.
fn first_difference(p: &PairTokens) -> usize {
    super::first_difference(p).min(p.clean.len() - 1)
}

/// Each edge's rank by `ranking`.
fn ranks(scores: &[f32], ranking: Ranking) -> Vec<u32> {
    let mut rank = vec![0u32; scores.len()];
    for (i, e) in ranked(scores, ranking).into_iter().enumerate() {
        rank[e] = i as u32;
    }
    rank
}

/// The trapezoid rule of `y` over MIB's fractions.
fn area(y: &[f64]) -> f64 {
    FRACTIONS
        .windows(2)
        .zip(y.windows(2))
        .map(|(x, y)| (x[1] - x[0]) * (y[0] + y[1]) / 2.0)
        .sum()
}

/// The circuits of the top edges at MIB's sizes, by |score| and by −score, evaluated by exact
/// edge patching on every pair; faithfulness, CPR and CMD.
pub fn evaluate(
    fwd: &EditedForward,
    pairs: &[PairTokens],
    metric: MetricKind,
    s: &Scores,
) -> anyhow::Result<Evaluation> {
    let t0 = std::time::Instant::now();
    let g = &s.graph;
    let model = fwd.model();
    let (abs, signed) = (
        ranks(&s.scores, Ranking::Absolute),
        ranks(&s.scores, Ranking::Signed),
    );
    let sizes: Vec<usize> = FRACTIONS
        .iter()
        .map(|f| (f * g.n_edges() as f64) as usize)
        .collect();
    let circuits: Vec<(&[u32], usize)> = sizes
        .iter()
        .map(|&k| (&abs[..], k))
        .chain(sizes.iter().map(|&k| (&signed[..], k)))
        .collect();
    // the whole model (every edge: the clean run) first, then the circuits of fewer edges; a
    // circuit of every edge is the first's number
    let whole = (&abs[..], g.n_edges());
    let runs: Vec<(&[u32], usize)> = std::iter::once(whole)
        .chain(circuits.iter().copied().filter(|c| c.1 < g.n_edges()))
        .collect();
    let mut sums = vec![0f64; circuits.len()];
    let (mut clean, mut corrupt) = (0f64, 0f64);
    let w = 1.0 / pairs.len() as f64;
    for p in pairs {
        let m = metric.of(p);
        let rc = record(fwd, g, &p.corrupt, m)?;
        let (x, _) = model.input_embeddings(&p.clean)?;
        let at = (&x[..], p.clean.len(), first_difference(p));
        let vals = circuit_metrics(fwd, g, at, &rc, &runs, m)?;
        let mut rest = vals[1..].iter();
        for (s, c) in sums.iter_mut().zip(&circuits) {
            let v = if c.1 < g.n_edges() { rest.next() } else { None };
            *s += *v.unwrap_or(&vals[0]) as f64 * w;
        }
        clean += vals[0] as f64 * w;
        corrupt += rc.metric as f64 * w;
    }
    let faith = |v: f64| (v - corrupt) / (clean - corrupt);
    let ladder = |range: std::ops::Range<usize>| -> Vec<LadderPoint> {
        range
            .zip(FRACTIONS.iter().zip(&sizes))
            .map(|(i, (&fraction, &edges))| LadderPoint {
                fraction,
                edges,
                metric: sums[i] as f32,
                faithfulness: faith(sums[i]),
            })
            .collect()
    };
    let (by_abs, by_signed) = (ladder(0..10), ladder(10..20));
    let cmd = area(
        &by_abs
            .iter()
            .map(|p| (1.0 - p.faithfulness).abs())
            .collect::<Vec<_>>(),
    );
    let cpr = area(&by_signed.iter().map(|p| p.faithfulness).collect::<Vec<_>>());
    Ok(Evaluation {
        clean_metric: clean as f32,
        corrupt_metric: corrupt as f32,
        ladder: by_abs,
        signed_ladder: by_signed,
        cpr,
        cmd,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// Single edges patched in the clean run: each variant's edge `u → r` carries the corrupted
/// output of `u` (`delta`: a_u(corrupt) − a_u(clean)), every other reader reads as it is.
struct EdgeEdit {
    /// per variant: its reader and delta (the rows the run computes)
    variants: Vec<(Reader, Vec<f32>)>,
}

impl ReaderEdit for EdgeEdit {
    fn input(&mut self, _: &[f32]) -> Result<()> {
        Ok(())
    }
    fn heads(&mut self, _: usize, _: &[f32]) -> Result<()> {
        Ok(())
    }
    fn mlp(&mut self, _: usize, _: &[f32]) -> Result<()> {
        Ok(())
    }
    fn read(&mut self, reader: Reader, resid: &[f32], out: &mut [f32]) -> Result<bool> {
        if !self.variants.iter().any(|(r, _)| *r == reader) {
            return Ok(false);
        }
        let w = resid.len() / self.variants.len();
        for (b, (r, delta)) in self.variants.iter().enumerate() {
            let (dst, src) = (&mut out[b * w..(b + 1) * w], &resid[b * w..(b + 1) * w]);
            dst.copy_from_slice(src);
            if *r == reader {
                dst.iter_mut().zip(delta).for_each(|(o, d)| *o += d);
            }
        }
        Ok(true)
    }
}

/// The layer a reader's edited run starts at (the logits: after the last layer).
fn start_layer(r: Reader, n_layers: usize) -> usize {
    match r {
        Reader::Q { layer, .. }
        | Reader::K { layer, .. }
        | Reader::V { layer, .. }
        | Reader::Mlp { layer } => layer,
        Reader::Logits => n_layers,
    }
}

/// Δm of each edge of `edges` patched alone on one pair: the variants of one start layer in
/// batches, each from the clean run's residual stream entering that layer.
fn edge_deltas(
    fwd: &EditedForward,
    g: &Graph,
    (clean, corrupt): (&Record, &Record),
    (n, p, edges): (usize, usize, &[usize]),
    metric: crate::model::backward::Metric,
) -> Result<Vec<f32>> {
    let w = clean.nodes.len() / g.n_nodes();
    // each sequence's rows from the texts' first difference on (the same before it)
    let skip = w / n * p;
    let prefix = clean.prefix(p);
    let mut out = vec![0f32; edges.len()];
    for from in 0..=g.n_layers {
        let mine: Vec<usize> = (0..edges.len())
            .filter(|&i| start_layer(g.reader(g.edge(edges[i]).1), g.n_layers) == from)
            .collect();
        let x0 = if from == g.n_layers {
            &clean.last
        } else {
            &clean.pre[from]
        };
        for chunk in mine.chunks((MAX_ROWS / (n - p)).max(1)) {
            let variants = chunk
                .iter()
                .map(|&i| {
                    let (u, r) = g.edge(edges[i]);
                    let at = u * w + skip..(u + 1) * w;
                    let (a, c) = (&corrupt.nodes[at.clone()], &clean.nodes[at]);
                    (g.reader(r), a.iter().zip(c).map(|(a, c)| a - c).collect())
                })
                .collect();
            let mut edit = EdgeEdit { variants };
            let x0 = &x0[skip..];
            let xs: Vec<f32> = (0..chunk.len()).flat_map(|_| x0.iter().copied()).collect();
            let at = (from, Some(&prefix));
            let vals = fwd.run(&xs, (n, chunk.len()), at, metric, &mut edit)?;
            for (&i, v) in chunk.iter().zip(vals) {
                out[i] = v - clean.metric;
            }
        }
    }
    Ok(out)
}

/// The top `k` edges by |score|, each patched alone exactly (mean Δm over the pairs), beside
/// their scores, with the rank correlation.
pub fn exact_edges(
    fwd: &EditedForward,
    pairs: &[PairTokens],
    metric: MetricKind,
    s: &Scores,
    k: usize,
) -> anyhow::Result<ExactEdges> {
    let t0 = std::time::Instant::now();
    let g = &s.graph;
    let top: Vec<usize> = ranked(&s.scores, Ranking::Absolute)
        .into_iter()
        .take(k)
        .collect();
    let mut sums = vec![0f64; top.len()];
    let w = 1.0 / pairs.len() as f64;
    for p in pairs {
        let m = metric.of(p);
        let clean = record(fwd, g, &p.clean, m)?;
        let corrupt = record(fwd, g, &p.corrupt, m)?;
        let at = (p.clean.len(), first_difference(p), &top[..]);
        let d = edge_deltas(fwd, g, (&clean, &corrupt), at, m)?;
        sums.iter_mut().zip(d).for_each(|(s, v)| *s += v as f64 * w);
    }
    let edges: Vec<ExactEdge> = top
        .iter()
        .zip(&sums)
        .map(|(&e, &v)| {
            let es = edge_score(g, &s.scores, e);
            ExactEdge {
                from: es.from,
                to: es.to,
                score: es.score,
                exact: v as f32,
            }
        })
        .collect();
    let a: Vec<f64> = edges.iter().map(|e| e.score as f64).collect();
    let b: Vec<f64> = edges.iter().map(|e| e.exact as f64).collect();
    Ok(ExactEdges {
        spearman: spearman(&a, &b),
        edges,
        seconds: t0.elapsed().as_secs_f64(),
    })
}

/// The metric of explicit circuits (each a list of edge indices) on one pair by exact edge
/// patching, with the clean and corrupted runs' metrics through the same forward: `(clean,
/// corrupt, per circuit)`.
pub fn run_circuits(
    model: &Model,
    pair: &PairTokens,
    metric: MetricKind,
    g: &Graph,
    circuits: &[Vec<usize>],
) -> anyhow::Result<(f32, f32, Vec<f32>)> {
    let fwd = model.edited_forward()?;
    let m = metric.of(pair);
    let clean = record(&fwd, g, &pair.clean, m)?.metric;
    let rc = record(&fwd, g, &pair.corrupt, m)?;
    // each circuit as ranks: its edges first (0..k), every other edge after
    let ranks: Vec<Vec<u32>> = circuits
        .iter()
        .map(|c| {
            let mut r = vec![u32::MAX; g.n_edges()];
            for (i, &e) in c.iter().enumerate() {
                r[e] = i as u32;
            }
            r
        })
        .collect();
    let list: Vec<(&[u32], usize)> = ranks
        .iter()
        .zip(circuits)
        .map(|(r, c)| (&r[..], c.len()))
        .collect();
    let (x, _) = model.input_embeddings(&pair.clean)?;
    let at = (&x[..], pair.clean.len(), first_difference(pair));
    let vals = circuit_metrics(&fwd, g, at, &rc, &list, m)?;
    Ok((clean, rc.metric, vals))
}

/// Δm of each edge (by index) patched alone in the clean run on one pair.
pub fn patch_edges(
    model: &Model,
    pair: &PairTokens,
    metric: MetricKind,
    g: &Graph,
    edges: &[usize],
) -> anyhow::Result<Vec<f32>> {
    let fwd = model.edited_forward()?;
    let m = metric.of(pair);
    let clean = record(&fwd, g, &pair.clean, m)?;
    let corrupt = record(&fwd, g, &pair.corrupt, m)?;
    Ok(edge_deltas(
        &fwd,
        g,
        (&clean, &corrupt),
        (pair.clean.len(), first_difference(pair), edges),
        m,
    )?)
}
