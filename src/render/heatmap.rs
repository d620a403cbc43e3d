//! One attention map as an image: SVG (token labels as text, weights in tooltips) or PNG
//! (cells, a colour scale, position labels in a built-in 3×5 digit font; no font files needed).

use super::html::html_escape;

/// White → dark blue, with a square-root scale so small weights stay visible.
pub fn colour(v: f32) -> [u8; 3] {
    let t = v.clamp(0.0, 1.0).sqrt();
    [
        (255.0 - 220.0 * t) as u8,
        (255.0 - 180.0 * t) as u8,
        (255.0 - 80.0 * t) as u8,
    ]
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
        s += &format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            m - 4,
            m + i * cell + cell / 2 + 4,
            html_escape(r)
        );
    }
    for (j, c) in cols.iter().enumerate() {
        s += &format!(
            "<text transform=\"translate({},{}) rotate(-90)\">{}</text>\n",
            m + j * cell + cell / 2 + 4,
            m - 4,
            html_escape(c)
        );
    }
    let x0 = m + nc * cell + 20;
    for k in 0..=10 {
        let [r, g, b] = colour(k as f32 / 10.0);
        s += &format!(
            "<rect x=\"{x0}\" y=\"{}\" width=\"14\" height=\"12\" fill=\"rgb({r},{g},{b})\"/>\n",
            m + (10 - k) * 12
        );
    }
    s += &format!(
        "<text x=\"{}\" y=\"{}\">1</text><text x=\"{}\" y=\"{}\">0</text>\n</svg>\n",
        x0 + 18,
        m + 10,
        x0 + 18,
        m + 130
    );
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

/// RGB pixels (`w · h · 3` bytes, row-major) as a PNG file, deflated by the `png` crate.
fn encode_png(w: usize, h: usize, rgb: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut enc = png::Encoder::new(&mut out, w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.set_compression(png::Compression::Balanced);
    let mut writer = enc.write_header().expect("writing a PNG header to memory");
    writer
        .write_image_data(rgb)
        .expect("w·h·3 bytes of RGB, written to memory");
    writer.finish().expect("writing to memory");
    out
}

/// The map as a PNG: cells, query/key positions along the edges, a colour scale on the right.
pub fn png(map: &[f32], nr: usize, nc: usize) -> Vec<u8> {
    let cell = (640 / nr.max(nc).max(1)).clamp(2, 32);
    let m = 40;
    let (w, h) = (m + nc * cell + 50, m + nr * cell + 10);
    let mut cv = Canvas {
        w,
        h,
        px: vec![255; w * h * 3],
    };
    for i in 0..nr {
        for j in 0..nc {
            cv.rect(
                m + j * cell,
                m + i * cell,
                cell,
                cell,
                colour(map[i * nc + j]),
            );
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
    fn png_decodes_back_to_the_drawn_pixels() {
        let map = [1.0, 0.0, 0.5, 0.5];
        let p = png(&map, 2, 2);
        assert_eq!(&p[..8], b"\x89PNG\r\n\x1a\n");
        // decoded by the png crate's reader, not by anything of ours
        let mut reader = png::Decoder::new(std::io::Cursor::new(&p))
            .read_info()
            .unwrap();
        let mut buf = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut buf).unwrap();
        assert_eq!(
            (info.color_type, info.bit_depth),
            (png::ColorType::Rgb, png::BitDepth::Eight)
        );
        let (w, cell, m) = (info.width as usize, 32usize, 40usize); // cells of 32 px (at most) after a 40 px margin
        let px =
            |x: usize, y: usize| -> [u8; 3] { buf[(y * w + x) * 3..][..3].try_into().unwrap() };
        // the centre of each cell has the colour of its weight
        for i in 0..2 {
            for j in 0..2 {
                assert_eq!(
                    px(m + j * cell + cell / 2, m + i * cell + cell / 2),
                    colour(map[i * 2 + j]),
                    "cell {i},{j}"
                );
            }
        }
        assert_ne!(colour(1.0), colour(0.0));
    }

    #[test]
    fn png_is_deflated() {
        // a 200 x 200 map: stored blocks would take ~1.3 MB of raw pixels
        let n = 200;
        let map: Vec<f32> = (0..n * n).map(|k| (k % n) as f32 / n as f32).collect();
        let p = png(&map, n, n);
        let (w, h) = (40 + n * 3 + 50, 40 + n * 3 + 10);
        assert!(
            p.len() * 10 < w * h * 3,
            "{} bytes for {} raw",
            p.len(),
            w * h * 3
        );
    }

    #[test]
    fn svg_has_labels_cells_and_escapes_text() {
        let s = svg(
            &[1.0, 0.0, 0.25, 0.75],
            &["0 <a>".into(), "1 b".into()],
            &["0 <a>".into(), "1 b".into()],
            "L0 H0",
        );
        assert_eq!(s.matches("<rect x=").count(), 4 + 11);
        assert!(s.contains("0 &lt;a&gt; → 1 b: 0.0000"));
        assert!(s.contains("1 b → 1 b: 0.7500"));
    }
}
