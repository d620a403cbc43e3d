//! What an encoder's attention is read for (Clark et al. 2019, "What does BERT look at?"): per
//! layer, the share of attention that lands on `[CLS]`, on `[SEP]` and on punctuation, averaged
//! over heads and queries; and the rows of one query (head-averaged per layer, per head in one
//! layer). There is no next token to predict, so none is reported.

use super::vocab::{entropy, max_argmax, top_k};
use super::vocab::{ModelFacts, TokenInfo, TopEntry};
use crate::model::capture::{Hook, Observer};
use crate::model::error::Result;
use crate::model::forward::RunOptions;
use crate::model::Model;
use serde::Serialize;

/// Whether a token's text is punctuation: every character in Unicode's punctuation categories
/// (P*), as Python's `unicodedata.category(c).startswith("P")` says. Covered: ASCII (its
/// symbols `$+<=>^`|~` are not punctuation), Latin-1, General Punctuation, CJK and fullwidth
/// punctuation.
pub fn is_punctuation(text: &str) -> bool {
    !text.is_empty() && text.chars().all(is_punct_char)
}

fn is_punct_char(c: char) -> bool {
    let u = c as u32;
    match u {
        0x21..=0x7e => c.is_ascii_punctuation() && !"$+<=>^`|~".contains(c),
        0xa1 | 0xa7 | 0xab | 0xb6 | 0xb7 | 0xbb | 0xbf | 0x37e | 0x387 => true,
        // General Punctuation: dashes, quotes, daggers, ellipsis, ‰ … (the symbols ⁄ ⁒ are Sm)
        0x2010..=0x2027 | 0x2030..=0x205e => u != 0x2044 && u != 0x2052,
        // CJK: 、。〃 brackets 〈〉《》「」『』【】 〔〕…〟 (〒〓 are symbols)
        0x3001..=0x3003 | 0x3008..=0x3011 | 0x3014..=0x301f | 0x30fb => true,
        // fullwidth ！＂＃％＆＇（）＊，－．／：；？＠［＼］＿｛｝ and ｡｢｣､･
        0xff01..=0xff03 | 0xff05..=0xff0a | 0xff0c..=0xff0f | 0xff1a | 0xff1b | 0xff1f | 0xff20 => {
            true
        }
        0xff3b..=0xff3d | 0xff3f | 0xff5b | 0xff5d | 0xff5f..=0xff65 => true,
        _ => false,
    }
}

/// Per layer, the share of attention on `[CLS]`, on `[SEP]` and on punctuation tokens:
/// `mean over heads and queries of Σ_{keys in the set} α`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SpecialShares {
    pub cls: Vec<f32>,
    pub sep: Vec<f32>,
    pub punct: Vec<f32>,
}

/// The observer behind [`inspect`]: per layer, the sums over heads and queries of the weight on
/// each key set, and the rows of one query (every head).
struct SharesCollector {
    n: usize,
    query: usize,
    /// Per key: (is \[CLS\], is \[SEP\], is punctuation).
    kinds: Vec<(bool, bool, bool)>,
    sums: Vec<[f64; 3]>,
    /// Per layer `[n_heads, n]`.
    rows: Vec<Vec<f32>>,
}

impl Observer for SharesCollector {
    fn wants(&self, _: usize, hook: Hook) -> bool {
        hook == Hook::Pattern
    }
    fn tensor(&mut self, _: usize, _: Hook, _: &[usize], _: &[f32]) {}
    fn attention_block(
        &mut self,
        layer: usize,
        _: Hook,
        q_start: usize,
        [heads, rows, kw]: [usize; 3],
        data: &[f32],
    ) {
        let n = self.n;
        if self.rows[layer].is_empty() {
            self.rows[layer] = vec![0f32; heads * n];
        }
        for h in 0..heads {
            for r in 0..rows {
                let row = &data[(h * rows + r) * kw..][..kw];
                for (j, &w) in row.iter().enumerate() {
                    let (c, s, p) = self.kinds[j];
                    let w = w as f64;
                    let sums = &mut self.sums[layer];
                    if c {
                        sums[0] += w;
                    }
                    if s {
                        sums[1] += w;
                    }
                    if p {
                        sums[2] += w;
                    }
                }
                if q_start + r == self.query {
                    self.rows[layer][h * n..h * n + kw].copy_from_slice(row);
                }
            }
        }
    }
}

impl SharesCollector {
    /// A collector for keys of `kinds` (one per token) over `layers` layers, keeping the rows
    /// of `query` (`usize::MAX`: none).
    fn new(kinds: Vec<(bool, bool, bool)>, query: usize, layers: usize) -> Self {
        SharesCollector {
            n: kinds.len(),
            query,
            kinds,
            sums: vec![[0f64; 3]; layers],
            rows: vec![Vec::new(); layers],
        }
    }

    /// Per layer, each key set's share: its sum over `heads` heads and every query, divided by
    /// their count.
    fn shares(&self, heads: usize) -> SpecialShares {
        let per = (heads * self.n) as f64;
        let share =
            |k: usize| -> Vec<f32> { self.sums.iter().map(|s| (s[k] / per) as f32).collect() };
        SpecialShares {
            cls: share(0),
            sep: share(1),
            punct: share(2),
        }
    }

    /// The query's row at `layer`, averaged over its `heads` heads.
    fn head_mean(&self, layer: usize, heads: usize) -> Vec<f32> {
        let mut mean = vec![0f64; self.n];
        for row in self.rows[layer].chunks(self.n) {
            mean.iter_mut().zip(row).for_each(|(m, &w)| *m += w as f64);
        }
        mean.iter().map(|m| (m / heads as f64) as f32).collect()
    }

    /// The query's row of head `h` at `layer`.
    fn head_row(&self, layer: usize, h: usize) -> &[f32] {
        &self.rows[layer][h * self.n..(h + 1) * self.n]
    }
}

/// Per key: (is \[CLS\], is \[SEP\], is punctuation); a \[CLS\] or \[SEP\] is never punctuation.
fn key_kinds(model: &Model, tokens: &[u32]) -> Vec<(bool, bool, bool)> {
    let (cls, sep) = model.special_ids();
    tokens
        .iter()
        .zip(model.token_texts(tokens))
        .map(|(&t, text)| {
            let special = Some(t) == cls || Some(t) == sep;
            (
                Some(t) == cls,
                Some(t) == sep,
                !special && is_punctuation(&text),
            )
        })
        .collect()
}

/// The \[CLS\]/\[SEP\]/punctuation shares of every layer from patterns captured elsewhere: `maps`
/// yields each layer's `[n_heads, n, n]` weights (the view's); the same sums as [`inspect`].
pub fn shares_of_patterns<'a>(
    model: &Model,
    tokens: &[u32],
    maps: impl Iterator<Item = &'a [f32]>,
) -> SpecialShares {
    shares_of_kinds(key_kinds(model, tokens), model.dims.n_heads, maps)
}

/// [`shares_of_patterns`] for patterns without a model (Python's `viz.attention_heads`): a key
/// is \[CLS\] or \[SEP\] when its text is exactly `[CLS]` or `[SEP]`, punctuation as
/// [`is_punctuation`] says; `maps` yields each layer's `[heads, n, n]`.
pub fn shares_of_texts<'a>(
    texts: &[String],
    heads: usize,
    maps: impl Iterator<Item = &'a [f32]>,
) -> SpecialShares {
    let kinds = texts
        .iter()
        .map(|t| {
            let (c, s) = (t == "[CLS]", t == "[SEP]");
            (c, s, !c && !s && is_punctuation(t))
        })
        .collect();
    shares_of_kinds(kinds, heads, maps)
}

fn shares_of_kinds<'a>(
    kinds: Vec<(bool, bool, bool)>,
    h: usize,
    maps: impl Iterator<Item = &'a [f32]>,
) -> SpecialShares {
    let n = kinds.len();
    let mut c = SharesCollector::new(kinds, usize::MAX, 0);
    for (l, p) in maps.enumerate() {
        c.sums.push([0f64; 3]);
        c.rows.push(Vec::new());
        c.attention_block(l, Hook::Pattern, 0, [h, n, n], p);
    }
    c.shares(h)
}

/// One layer of [`EncoderReport`]: the head-averaged row of the query, its top keys.
#[derive(Clone, Debug, Serialize)]
pub struct EncoderLayer {
    pub layer: usize,
    pub top: Vec<TopEntry>,
}

/// One head of the chosen layer for the query.
#[derive(Clone, Debug, Serialize)]
pub struct EncoderHead {
    pub head: usize,
    pub top: Vec<TopEntry>,
    pub max_weight: f32,
    pub argmax: usize,
    pub entropy: f32,
}

/// What `inspect` reports on an encoder.
#[derive(Clone, Debug, Serialize)]
pub struct EncoderReport {
    pub model: ModelFacts,
    /// "encoder (bidirectional)".
    pub kind: &'static str,
    pub tokens: Vec<TokenInfo>,
    /// Each token's type as the model ran it: 0, or 1 for the second text of a pair (all 0 on
    /// a model without token types: RoBERTa, DistilBERT).
    pub token_types: Vec<u32>,
    /// Which text of a pair each token belongs to: 0, or 1 for the second (RoBERTa's
    /// `</s> B </s>`), whether or not the model runs token types; all 0 for one text.
    pub segments: Vec<u32>,
    pub query: usize,
    pub layer: usize,
    pub special_shares: SpecialShares,
    pub layers: Vec<EncoderLayer>,
    pub heads: Vec<EncoderHead>,
}

/// The special-token shares of every layer, and the rows of `query` (head-averaged top `top`
/// keys per layer; per head of `layer` for `heads`), from one forward of the encoder on `tokens`
/// of the given types (`None`: all 0, one text; a pair's as [`Model::encode_pair`] gives them).
pub fn inspect(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    query: usize,
    layer: usize,
    heads: &[usize],
    top: usize,
) -> Result<EncoderReport> {
    let d = &model.dims;
    let n = tokens.len();
    let texts = model.token_texts(tokens);
    let c = collect_shares(model, tokens, types, query)?;
    let layers = (0..d.n_layers)
        .map(|l| EncoderLayer {
            layer: l,
            top: top_entries(&c.head_mean(l, d.n_heads), top, &texts),
        })
        .collect();
    let heads = heads
        .iter()
        .map(|&h| head_of(c.head_row(layer, h), h, top, &texts))
        .collect();
    let types = types.map_or_else(|| vec![0; n], <[u32]>::to_vec);
    Ok(EncoderReport {
        model: ModelFacts::of(model),
        kind: "encoder (bidirectional)",
        tokens: token_infos(tokens, &texts),
        segments: types.clone(),
        token_types: types,
        query,
        layer,
        special_shares: c.shares(d.n_heads),
        layers,
        heads,
    })
}

/// One forward of the encoder on `tokens` (of `types`) into a [`SharesCollector`] that keeps
/// the rows of `query`.
fn collect_shares(
    model: &Model,
    tokens: &[u32],
    types: Option<&[u32]>,
    query: usize,
) -> Result<SharesCollector> {
    let mut c = SharesCollector::new(key_kinds(model, tokens), query, model.dims.n_layers);
    let opts = RunOptions {
        token_types: types.map(<[u32]>::to_vec),
        ..Default::default()
    };
    model.forward(tokens, &opts, &mut c)?;
    Ok(c)
}

/// The `top` keys of `row`, with their texts.
fn top_entries(row: &[f32], top: usize, texts: &[String]) -> Vec<TopEntry> {
    top_k(row, top)
        .into_iter()
        .map(|r| TopEntry {
            pos: r.pos,
            token: texts[r.pos].clone(),
            weight: r.weight,
        })
        .collect()
}

/// Head `head`'s report from its `row` of the query: its top keys, largest weight and entropy.
fn head_of(row: &[f32], head: usize, top: usize, texts: &[String]) -> EncoderHead {
    let (max_weight, argmax) = max_argmax(row);
    EncoderHead {
        head,
        top: top_entries(row, top, texts),
        max_weight,
        argmax,
        entropy: entropy(row),
    }
}

/// Each token's position, id and text.
fn token_infos(tokens: &[u32], texts: &[String]) -> Vec<TokenInfo> {
    tokens
        .iter()
        .zip(texts)
        .enumerate()
        .map(|(pos, (&id, t))| TokenInfo {
            pos,
            id,
            text: t.clone(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn punctuation_is_unicodes_p_categories() {
        for p in [
            ".", ",", "!", "?", "'", "\"", "-", "(", "]", "@", "#", "%", "_", "…", "—", "«", "。",
            "、", "¿", "...",
        ] {
            assert!(is_punctuation(p), "{p}");
        }
        for s in [
            "$", "+", "<", "=", "^", "`", "|", "~", "a", "##s", "[SEP]", "", "a.", "⁄", "€",
        ] {
            assert!(!is_punctuation(s), "{s}");
        }
    }

    #[test]
    fn shares_sum_each_key_set_over_heads_and_queries() {
        // 2 heads, 3 tokens: [CLS] x [SEP]; by hand: cls share = mean of column 0, and so on
        let mut c = SharesCollector {
            n: 3,
            query: 1,
            kinds: vec![
                (true, false, false),
                (false, false, true),
                (false, true, false),
            ],
            sums: vec![[0.0; 3]],
            rows: vec![Vec::new()],
        };
        #[rustfmt::skip]
        let data = [
            0.5, 0.25, 0.25,   0.2, 0.2, 0.6,   1.0, 0.0, 0.0,   // head 0
            0.1, 0.8, 0.1,     0.3, 0.3, 0.4,   0.0, 0.5, 0.5,   // head 1
        ];
        c.attention_block(0, Hook::Pattern, 0, [2, 3, 3], &data);
        let per = 6.0;
        assert!((c.sums[0][0] / per - (0.5 + 0.2 + 1.0 + 0.1 + 0.3) / 6.0).abs() < 1e-7);
        assert!((c.sums[0][1] / per - (0.25 + 0.6 + 0.1 + 0.4 + 0.5) / 6.0).abs() < 1e-7);
        assert!((c.sums[0][2] / per - (0.25 + 0.2 + 0.8 + 0.3 + 0.5) / 6.0).abs() < 1e-7);
        assert_eq!(c.rows[0], vec![0.2, 0.2, 0.6, 0.3, 0.3, 0.4]);
    }
}
