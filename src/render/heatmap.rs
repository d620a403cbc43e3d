//! One attention map as an image: SVG (token labels as text, weights in tooltips) or PNG
//! (cells, a colour scale, position labels in a built-in 3×5 digit font; no font files needed).

use super::html::html_escape;
use super::tensorfile::crc32;

/// White → dark blue, with a square-root scale so small weights stay visible.
pub fn colour(v: f32) -> [u8; 3] {
    let t = v.clamp(0.0, 1.0).sqrt();
    [(255.0 - 220.0 * t) as u8, (255.0 - 180.0 * t) as u8, (255.0 - 80.0 * t) as u8]
}

/// `map` is `[rows, cols]`; labels name the rows (queries) and columns (keys).
pub fn svg(map: &[f32], rows: &[String], cols: &[String], title: &str) -> String {
    let (nr, nc) = (rows.len(), cols.len());
    let cell = (600 / nr.max(nc).max(1)).clamp(6, 28);
    let m = 160;
    let (w, h) = (m + nc * cell + 80, m + nr * cell + 30);
    let mut s = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"{}\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n<text x=\"4\" y=\"16\" font-size=\"13\">{}</text>\n", cell.min(12), html_escape(title));
    for i in 0..nr {
        for j in 0..nc {
            let v = map[i * nc + j];
            let [r, g, b] = colour(v);
            s += &format!(
                "<rect x=\"{}\" y=\"{}\" width=\"{cell}\" height=\"{cell}\" fill=\"rgb({r},{g},{b})\"><title>{} → {}: {v:.4}</title></rect>\n",
                m + j * cell,
                m + i * cell,
                html_escape(&rows[i]),
                html_escape(&cols[j])
            );
        }
    }
    for (i, r) in rows.iter().enumerate() {
        s += &format!("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", m - 4, m + i * cell + cell / 2 + 4, html_escape(r));
    }
    for (j, c) in cols.iter().enumerate() {
        s += &format!("<text transform=\"translate({},{}) rotate(-90)\">{}</text>\n", m + j * cell + cell / 2 + 4, m - 4, html_escape(c));
    }
    let x0 = m + nc * cell + 20;
    for k in 0..=10 {
        let [r, g, b] = colour(k as f32 / 10.0);
        s += &format!("<rect x=\"{x0}\" y=\"{}\" width=\"14\" height=\"12\" fill=\"rgb({r},{g},{b})\"/>\n", m + (10 - k) * 12);
    }
    s += &format!("<text x=\"{}\" y=\"{}\">1</text><text x=\"{}\" y=\"{}\">0</text>\n</svg>\n", x0 + 18, m + 10, x0 + 18, m + 130);
    s
}

const DIGITS: [[u8; 5]; 10] = [
    [0b111, 0b101, 0b101, 0b101, 0b111],
    [0b010, 0b110, 0b010, 0b010, 0b111],
    [0b111, 0b001, 0b111, 0b100, 0b111],
    [0b111, 0b001, 0b111, 0b001, 0b111],
    [0b101, 0b101, 0b111, 0b001, 0b001],
    [0b111, 0b100, 0b111, 0b001, 0b111],
    [0b111, 0b100, 0b111, 0b101, 0b111],
    [0b111, 0b001, 0b001, 0b001, 0b001],
    [0b111, 0b101, 0b111, 0b101, 0b111],
    [0b111, 0b101, 0b111, 0b001, 0b111],
];

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Canvas {
    fn rect(&mut self, x: usize, y: usize, w: usize, h: usize, c: [u8; 3]) {
        for yy in y..(y + h).min(self.h) {
            for xx in x..(x + w).min(self.w) {
                self.px[(yy * self.w + xx) * 3..][..3].copy_from_slice(&c);
            }
        }
    }
    /// A number in the digit font, scale 2 (each digit 6×10 px plus a gap).
    fn number(&mut self, x: usize, y: usize, v: usize) {
        for (k, ch) in v.to_string().bytes().enumerate() {
            let g = DIGITS[(ch - b'0') as usize];
            for (r, bits) in g.iter().enumerate() {
                for c in 0..3 {
                    if bits >> (2 - c) & 1 == 1 {
                        self.rect(x + k * 8 + c * 2, y + r * 2, 2, 2, [40, 40, 40]);
                    }
                }
            }
        }
    }
}

/// A PNG (8-bit RGB) of raw pixels, zlib-wrapped in stored (uncompressed) deflate blocks.
pub fn encode_png(w: usize, h: usize, rgb: &[u8]) -> Vec<u8> {
    let mut raw = Vec::with_capacity(h * (w * 3 + 1));
    for row in rgb.chunks(w * 3) {
        raw.push(0);
        raw.extend_from_slice(row);
    }
    let mut z = vec![0x78, 0x01];
    for (k, chunk) in raw.chunks(65535).enumerate() {
        let last = (k + 1) * 65535 >= raw.len();
        z.push(last as u8);
        z.extend_from_slice(&(chunk.len() as u16).to_le_bytes());
        z.extend_from_slice(&(!(chunk.len() as u16)).to_le_bytes());
        z.extend_from_slice(chunk);
    }
    let (mut a, mut b) = (1u32, 0u32);
    for &x in &raw {
        a = (a + x as u32) % 65521;
        b = (b + a) % 65521;
    }
    z.extend_from_slice(&((b << 16) | a).to_be_bytes());
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut chunk = |kind: &[u8], data: &[u8]| {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut c = kind.to_vec();
        c.extend_from_slice(data);
        out.extend_from_slice(&c);
        out.extend_from_slice(&crc32(&c).to_be_bytes());
    };
    let mut ihdr = Vec::new();
    ihdr.extend_from_slice(&(w as u32).to_be_bytes());
    ihdr.extend_from_slice(&(h as u32).to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(b"IHDR", &ihdr);
    chunk(b"IDAT", &z);
    chunk(b"IEND", &[]);
    out
}

/// The map as a PNG: cells, query/key positions along the edges, a colour scale on the right.
pub fn png(map: &[f32], nr: usize, nc: usize) -> Vec<u8> {
    let cell = (640 / nr.max(nc).max(1)).clamp(2, 32);
    let m = 40;
    let (w, h) = (m + nc * cell + 50, m + nr * cell + 10);
    let mut cv = Canvas { w, h, px: vec![255; w * h * 3] };
    for i in 0..nr {
        for j in 0..nc {
            cv.rect(m + j * cell, m + i * cell, cell, cell, colour(map[i * nc + j]));
        }
    }
    let every = (12 / cell).max(1);
    for i in (0..nr).step_by(every) {
        cv.number(4, m + i * cell + cell.saturating_sub(10) / 2, i);
    }
    for j in (0..nc).step_by(every.max(2)) {
        cv.number(m + j * cell, 8, j);
    }
    let x0 = m + nc * cell + 16;
    for k in 0..100 {
        cv.rect(x0, m + (99 - k) * 2, 14, 2, colour(k as f32 / 99.0));
    }
    cv.number(x0 + 18, m, 1);
    cv.number(x0 + 18, m + 190, 0);
    encode_png(w, h, &cv.px)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_structure() {
        let p = png(&[1.0, 0.0, 0.5, 0.5], 2, 2);
        assert_eq!(&p[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&p[12..16], b"IHDR");
        assert_eq!(&p[p.len() - 8..p.len() - 4], b"IEND");
        // the IHDR chunk's CRC is right
        let crc = u32::from_be_bytes(p[29..33].try_into().unwrap());
        assert_eq!(crc, crc32(&p[12..29]));
    }

    #[test]
    fn svg_has_labels_cells_and_escapes_text() {
        let s = svg(&[1.0, 0.0, 0.25, 0.75], &["0 <a>".into(), "1 b".into()], &["0 <a>".into(), "1 b".into()], "L0 H0");
        assert_eq!(s.matches("<rect x=").count(), 4 + 11);
        assert!(s.contains("0 &lt;a&gt; → 1 b: 0.0000"));
        assert!(s.contains("1 b → 1 b: 0.7500"));
    }
}
