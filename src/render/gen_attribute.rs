//! The attribution matrix of a generated answer (`generate --attribute`): shaded in the terminal
//! (a row per position, a column per answer token) and as a self-contained HTML page (prompt and
//! answer; a click on an answer token shades the positions before it by attribution and, beside
//! it, by the attention of the query that produced it).

use super::html::html_escape;
use crate::analysis::gen_attribute::GenAttribution;
use crate::model::tokenize::visible;
use unicode_width::UnicodeWidthStr;

const TEMPLATE: &str = include_str!("../../assets/generate.html");

/// Each column's largest |score| (0 for a column with none).
fn column_max(g: &GenAttribution) -> Vec<f32> {
    (0..g.answer_len())
        .map(|j| {
            g.matrix
                .iter()
                .map(|r| r[j])
                .filter(|v| v.is_finite())
                .fold(0f32, |m, v| m.max(v.abs()))
        })
        .collect()
}

/// One cell, three columns wide: a background shaded by `v / max` (blue positive, red negative)
/// in colour; else a sign and a digit 0-9 of `|v| / max` (`+9` the column's largest). `·` where
/// the position is not in the token's input.
pub fn cell(v: f32, max: f32, colour: bool) -> String {
    if !v.is_finite() {
        return "  ·".into();
    }
    let t = if max > 0.0 {
        (v / max).clamp(-1.0, 1.0)
    } else {
        0.0
    };
    if !colour {
        let d = (t.abs() * 9.0).round() as u32;
        let sign = if d == 0 {
            ' '
        } else if t > 0.0 {
            '+'
        } else {
            '-'
        };
        return format!(" {sign}{d}");
    }
    let level = (255.0 - 200.0 * t.abs()) as u8;
    let (r, g, b) = if t >= 0.0 {
        (level, level, 255)
    } else {
        (255, level, level)
    };
    format!("\x1b[48;2;{r};{g};{b}m   \x1b[0m")
}

/// The matrix as the terminal shows it: a legend of the answer's tokens by column number, then a
/// row per position (its token), each column shaded relative to its largest |score|.
pub fn terminal(g: &GenAttribution, texts: &[String], colour: bool) -> String {
    let (p, a) = (g.prompt_len, g.answer_len());
    let mut s = format!(
        "\nwhy each answer token (columns) came: {} of log p(answer token | prompt + the answer before it), teacher-forced, per position (rows); each column scaled to its largest |score|; {}\n",
        g.method.name(),
        if colour {
            "blue raises log p, red lowers it, · not in the input"
        } else {
            "+9/-9 the column's largest raise/lowering, · not in the input"
        }
    );
    s.push_str("answer tokens: ");
    for j in 0..a {
        s.push_str(&format!("{j}:{} ", visible(&texts[p + j])));
    }
    s.push('\n');
    let label = |i: usize| {
        let mut t = visible(&texts[i]);
        while t.width() > 12 {
            t.pop();
        }
        format!(
            "{:>4} {}{t}{}",
            i,
            if i < p { ' ' } else { '>' },
            " ".repeat(12 - t.width())
        )
    };
    s.push_str(&" ".repeat(18));
    for j in 0..a {
        s.push_str(&format!("{:>3}", j % 1000));
    }
    s.push('\n');
    let max = column_max(g);
    // the last answer token is never an input
    for i in 0..p + a - 1 {
        s.push_str(&label(i));
        s.push(' ');
        for (&v, &m) in g.matrix[i].iter().zip(&max) {
            s.push_str(&cell(v, m, colour));
        }
        s.push('\n');
    }
    s.push_str("(rows marked > are answer tokens: the earlier answer is input to the later)\n");
    s
}

/// The matrix as JSON: method, the prompt's and the answer's token texts, `matrix[i][j]` (row a
/// position, column an answer token; `null` where the position is not in the input), each answer
/// token's teacher-forced log-probability.
pub fn json(g: &GenAttribution, texts: &[String]) -> serde_json::Value {
    let p = g.prompt_len;
    let num = |v: f32| {
        if v.is_finite() {
            serde_json::json!(v)
        } else {
            serde_json::Value::Null
        }
    };
    serde_json::json!({
        "method": g.method.name(),
        "prompt_tokens": &texts[..p],
        "answer_tokens": &texts[p..],
        "matrix": g.matrix.iter().map(|r| r.iter().map(|&v| num(v)).collect::<Vec<_>>()).collect::<Vec<_>>(),
        "logprobs": g.logprobs,
        "steps": g.steps,
    })
}

/// The HTML page: `attention[j]` is the head-and-layer-averaged row of the query that produced
/// answer token `j` (a weight per position before it).
pub fn page(
    g: &GenAttribution,
    texts: &[String],
    attention: &[Vec<f32>],
    title: &str,
    model: &str,
) -> String {
    let data = serde_json::json!({
        "title": title,
        "model": model,
        "attribution": json(g, texts),
        "attention": attention,
    });
    let json = serde_json::to_string(&data)
        .expect("the page's data serializes")
        .replace('<', "\\u003c");
    TEMPLATE
        .replace("/*ATTNSCOPE_DATA*/null", &json)
        .replace("<!--TITLE-->", &html_escape(title))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_without_colour_are_a_sign_and_a_digit() {
        assert_eq!(cell(1.0, 2.0, false), " +5");
        assert_eq!(cell(-2.0, 2.0, false), " -9");
        assert_eq!(cell(0.0, 2.0, false), "  0");
        assert_eq!(cell(f32::NAN, 2.0, false), "  ·");
        assert!(cell(2.0, 2.0, true).starts_with("\x1b[48;2;55;55;255m"));
    }
}
