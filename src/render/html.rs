//! The self-contained HTML attention view: one file, data, script and style inline, no network.
//! The patterns are embedded as the lower triangle of each `[n, n]` map, quantized to 16 bits
//! (8 bits above 256 tokens) and base64-encoded; the page decodes one layer when it is shown.

use serde::Serialize;

const TEMPLATE: &str = include_str!("../../assets/view.html");

/// What the page shows. `patterns[l]` holds `[heads, n, n]` f32 of layer `l`.
#[derive(Serialize)]
pub struct ViewData<'a> {
    pub title: String,
    pub model: serde_json::Value,
    pub tokens: &'a [String],
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub sink_query: Vec<f32>,
    pub sink_all: Vec<f32>,
    pub faithfulness: Option<serde_json::Value>,
    /// `attnscope ablate`'s report (every head ablated), for the ablation panel
    pub ablation: Option<serde_json::Value>,
    /// "u16" or "u8" (every weight, `patterns`), or "topk" (`sparse`)
    pub encoding: &'static str,
    pub patterns: Vec<String>,
    /// The bounded encoding of a long text (see `sparse`).
    pub sparse: Option<SparseLayers>,
    /// Per layer, the value norms `‖W_Oʰ vⱼ‖` (see `sparse::encode_value_norms`), for
    /// the norm-based shading; absent when the page was made from weights alone.
    pub vnorms: Option<Vec<String>>,
    /// What a view of an encoder adds (absent for a decoder's page).
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub encoder: Option<EncoderView>,
}

/// An encoder's page (`kind: "encoder"`): bidirectional maps, each stored whole
/// ([`encode_layer_full`]); no next token, so no prediction panel.
#[derive(Serialize)]
pub struct EncoderView {
    /// "encoder".
    pub kind: &'static str,
    /// Each token's type: 0, or 1 for the second text of a pair.
    pub token_types: Vec<u32>,
    /// The first position of a pair's second text (BertViz's `sentence_b_start`), if a pair.
    pub sentence_b_start: Option<usize>,
    /// The head view's selection shown first for a pair (`AB`, `BA`, `AA`, `BB`; absent: all).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pair: Option<&'static str>,
    /// Per layer, the share of attention on \[CLS\], \[SEP\] and punctuation (as `inspect`).
    pub special_shares: crate::analysis::encoder::SpecialShares,
}

/// What a `topk` page holds per layer.
#[derive(Serialize)]
pub struct SparseLayers {
    pub k_head: usize,
    pub k_mean: usize,
    pub layers: Vec<String>,
}

/// Standard base64 (RFC 4648) with padding.
pub fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let b = [c[0], *c.get(1).unwrap_or(&0), *c.get(2).unwrap_or(&0)];
        let v = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for k in 0..4 {
            if k <= c.len() {
                out.push(A[(v >> (18 - 6 * k) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The lower triangle (j ≤ i) of every head's map, quantized: `u16` (weight·65535) up to 256
/// tokens, `u8` (weight·255) above, so a 512-token view stays a few tens of MB.
pub fn encode_layer(pattern: &[f32], heads: usize, n: usize) -> (&'static str, String) {
    let wide = n <= 256;
    let mut bytes = Vec::with_capacity(heads * n * (n + 1) / 2 * if wide { 2 } else { 1 });
    for h in 0..heads {
        for i in 0..n {
            for j in 0..=i {
                let w = pattern[(h * n + i) * n + j].clamp(0.0, 1.0);
                if wide {
                    bytes.extend_from_slice(&((w * 65535.0).round() as u16).to_le_bytes());
                } else {
                    bytes.push((w * 255.0).round() as u8);
                }
            }
        }
    }
    (if wide { "u16" } else { "u8" }, base64(&bytes))
}

/// Every weight of every head's map (an encoder's: a query attends to the keys after it too),
/// row by row, quantized as [`encode_layer`] does: `u16` up to 256 tokens, `u8` above.
pub fn encode_layer_full(pattern: &[f32], heads: usize, n: usize) -> (&'static str, String) {
    let wide = n <= 256;
    let mut bytes = Vec::with_capacity(heads * n * n * if wide { 2 } else { 1 });
    for &w in &pattern[..heads * n * n] {
        let w = w.clamp(0.0, 1.0);
        if wide {
            bytes.extend_from_slice(&((w * 65535.0).round() as u16).to_le_bytes());
        } else {
            bytes.push((w * 255.0).round() as u8);
        }
    }
    (if wide { "u16" } else { "u8" }, base64(&bytes))
}

/// The page, with `data` inlined. Every `<` in the JSON (it can only stand inside a string) is
/// written `\u003c`, so no token text can end the script element or open a comment (`<!--`).
pub fn page(data: &ViewData<'_>) -> String {
    let json = serde_json::to_string(data)
        .expect("view data serializes")
        .replace('<', "\\u003c");
    TEMPLATE
        .replace("/*ATTNSCOPE_DATA*/null", &json)
        .replace("<!--TITLE-->", &html_escape(&data.title))
}

pub fn html_escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_known_values() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foobar"), "Zm9vYmFy");
    }

    #[test]
    fn layer_encoding_keeps_the_lower_triangle() {
        // 1 head, 2 tokens: [[1, 0], [0.25, 0.75]] → 1, 0.25, 0.75 as u16
        let (enc, b64) = encode_layer(&[1.0, 0.0, 0.25, 0.75], 1, 2);
        assert_eq!(enc, "u16");
        let mut want = Vec::new();
        for v in [65535u16, 16384, 49151] {
            want.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(b64, base64(&want));
        // an encoder's map is stored whole: [[0.5, 0.5], [0.25, 0.75]]
        let (enc, b64) = encode_layer_full(&[0.5, 0.5, 0.25, 0.75], 1, 2);
        assert_eq!(enc, "u16");
        let mut want = Vec::new();
        for v in [32768u16, 32768, 16384, 49151] {
            want.extend_from_slice(&v.to_le_bytes());
        }
        assert_eq!(b64, base64(&want));
    }

    #[test]
    fn page_has_data_inline_and_no_external_urls() {
        let tokens = vec!["a</script>".to_string(), "<!--b".to_string()];
        let (enc, p) = encode_layer(&[1.0, 0.0, 0.5, 0.5], 1, 2);
        let d = ViewData {
            title: "t".into(),
            model: serde_json::json!({}),
            tokens: &tokens,
            n_layers: 1,
            n_heads: 1,
            n_kv_heads: 1,
            sink_query: vec![0.5],
            sink_all: vec![0.5],
            faithfulness: None,
            ablation: None,
            encoding: enc,
            patterns: vec![p],
            sparse: None,
            vnorms: None,
            encoder: None,
        };
        let html = page(&d);
        assert!(!html.contains("/*ATTNSCOPE_DATA*/null"));
        assert!(
            html.contains("a\\u003c/script>") && html.contains("\\u003c!--b"),
            "token text cannot close the script or open a comment"
        );
        assert!(!html.contains("</script>\",") && !html.contains("<!--b"));
        // the data still reads back as the same text
        let at = html.find("{\"title\"").unwrap();
        let v: serde_json::Value = serde_json::Deserializer::from_str(&html[at..])
            .into_iter()
            .next()
            .unwrap()
            .unwrap();
        assert_eq!(v["tokens"][0], "a</script>");
        assert_eq!(v["tokens"][1], "<!--b");
        // (the SVG namespace `http://www.w3.org/2000/svg` is a name, not a request)
        for bad in [
            "src=\"http",
            "href=\"http",
            "src=\"//",
            "url(http",
            "@import",
            "<link",
            "fetch(",
            "XMLHttpRequest",
            "<script src",
        ] {
            assert!(
                !html.contains(bad),
                "the page must not reach the network ({bad})"
            );
        }
    }
}
