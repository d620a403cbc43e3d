//! Plain-text tables and bars for the terminal. Formatting only.

use unicode_width::UnicodeWidthStr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// A table with a header row; columns are sized to their widest cell (display width, so
/// Vietnamese and CJK text line up).
#[derive(Clone, Debug, Default)]
pub struct Table {
    headers: Vec<String>,
    align: Vec<Align>,
    rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new<S: Into<String>>(headers: impl IntoIterator<Item = (S, Align)>) -> Self {
        let (headers, align) = headers.into_iter().map(|(h, a)| (h.into(), a)).unzip();
        Table {
            headers,
            align,
            rows: Vec::new(),
        }
    }

    pub fn row<S: Into<String>>(&mut self, cells: impl IntoIterator<Item = S>) -> &mut Self {
        self.rows.push(cells.into_iter().map(Into::into).collect());
        self
    }

    pub fn render(&self) -> String {
        let ncol = self.headers.len();
        let mut width = vec![0usize; ncol];
        for r in std::iter::once(&self.headers).chain(&self.rows) {
            for (i, c) in r.iter().enumerate().take(ncol) {
                width[i] = width[i].max(c.width());
            }
        }
        let line = |cells: &[String]| -> String {
            let mut s = String::new();
            for (i, w) in width.iter().enumerate() {
                let c = cells.get(i).map(String::as_str).unwrap_or("");
                let pad = " ".repeat(w - c.width().min(*w));
                if i > 0 {
                    s.push_str("  ");
                }
                match self.align.get(i).copied().unwrap_or(Align::Left) {
                    Align::Left => {
                        s.push_str(c);
                        s.push_str(&pad);
                    }
                    Align::Right => {
                        s.push_str(&pad);
                        s.push_str(c);
                    }
                }
            }
            s.trim_end().to_string() + "\n"
        };
        let mut out = line(&self.headers);
        let rule: Vec<String> = width.iter().map(|w| "─".repeat(*w)).collect();
        out.push_str(&line(&rule));
        for r in &self.rows {
            out.push_str(&line(r));
        }
        out
    }
}

/// A horizontal bar of `width` cells for a value in [0, 1], with eighth-block resolution.
/// Indices `0..values.len()` ordered by |value|, largest first (ties by index; NaN sorts as
/// `total_cmp` puts it), for tables that list the strongest effects first.
pub fn order_by_magnitude(values: &[f32]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..values.len()).collect();
    order.sort_by(|&x, &y| values[y].abs().total_cmp(&values[x].abs()).then(x.cmp(&y)));
    order
}

pub fn bar(value: f32, width: usize) -> String {
    const PARTS: [&str; 8] = ["", "▏", "▎", "▍", "▌", "▋", "▊", "▉"];
    let v = value.clamp(0.0, 1.0) * width as f32;
    let full = v.floor() as usize;
    let part = ((v - full as f32) * 8.0).floor() as usize;
    let mut s = "█".repeat(full);
    if full < width {
        s.push_str(PARTS[part.min(7)]);
    }
    s
}

/// One character per value in [0, 1]: `▁▂▃▄▅▆▇█`.
pub fn sparkline(values: &[f32]) -> String {
    const TICKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    values
        .iter()
        .map(|v| TICKS[((v.clamp(0.0, 1.0) * 7.0).round() as usize).min(7)])
        .collect()
}

/// A section title, underlined.
pub fn title(s: &str) -> String {
    format!("{s}\n{}\n", "═".repeat(s.width()))
}

/// The ✓/✗ causal-mask grid: may the query in row i attend to the key in column j?
pub fn mask_grid(labels: &[String]) -> String {
    let mut t = Table::new(
        std::iter::once(("query ↓  key →".to_string(), Align::Left))
            .chain(labels.iter().map(|w| (w.clone(), Align::Left))),
    );
    for i in 0..labels.len() {
        t.row(
            std::iter::once(labels[i].clone())
                .chain((0..labels.len()).map(|j| if j <= i { "✓" } else { "✗" }.to_string())),
        );
    }
    t.render() + "✓ = the row's token may attend to the column's token; ✗ = a later token, hidden by the causal mask (score -inf, weight 0).\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_aligns_by_display_width() {
        let mut t = Table::new([("pos", Align::Right), ("token", Align::Left)]);
        t.row(["0", "Hà"]).row(["12", "日本"]);
        assert_eq!(t.render(), "pos  token\n───  ─────\n  0  Hà\n 12  日本\n");
    }

    #[test]
    fn bars_and_sparklines() {
        assert_eq!(bar(0.5, 4), "██");
        assert_eq!(bar(1.0, 3), "███");
        assert_eq!(bar(0.0, 3), "");
        assert_eq!(bar(0.5625, 2), "█▏");
        assert_eq!(sparkline(&[0.0, 0.5, 1.0]), "▁▅█");
    }
}
