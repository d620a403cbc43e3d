//! NumPy `.npy` (format 1.0, little-endian f32, C order): write for notebooks, read for tests.

/// The header of a `.npy` file (format 1.0, little-endian f32, C order) of `shape`.
pub fn npy_header(shape: &[usize]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let shape_txt = if shape.len() == 1 {
        format!("({},)", dims[0])
    } else {
        format!("({})", dims.join(", "))
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // magic (6) + version (2) + header length (2) + header, padded with spaces to 64 bytes, '\n'
    let unpadded = 10 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len());
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out
}

/// The bytes of a `.npy` file holding `data` with `shape`.
pub fn to_npy(shape: &[usize], data: &[f32]) -> Vec<u8> {
    assert_eq!(
        shape.iter().product::<usize>(),
        data.len(),
        "npy: shape does not match data"
    );
    let mut out = npy_header(shape);
    out.reserve(data.len() * 4);
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Reads a little-endian f32 `.npy` (version 1 or 2) into `(shape, data)`.
pub fn from_npy(bytes: &[u8]) -> Result<(Vec<usize>, Vec<f32>), String> {
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err("not an .npy file".into());
    }
    let (hlen, start) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
            12,
        ),
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = std::str::from_utf8(bytes.get(start..start + hlen).ok_or("truncated header")?)
        .map_err(|e| e.to_string())?;
    if !header.contains("'descr': '<f4'") || header.contains("'fortran_order': True") {
        return Err(format!(
            "only C-order little-endian f32 arrays are read, header: {header}"
        ));
    }
    let open = header.find("'shape': (").ok_or("no shape")? + 10;
    let close = open + header[open..].find(')').ok_or("bad shape")?;
    let shape: Vec<usize> = header[open..close]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| s.parse::<usize>().map_err(|e| e.to_string()))
        .collect::<Result<_, _>>()?;
    let body = &bytes[start + hlen..];
    let n: usize = shape.iter().product();
    if body.len() != n * 4 {
        return Err(format!(
            "expected {} data bytes, found {}",
            n * 4,
            body.len()
        ));
    }
    Ok((
        shape,
        body.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npy_roundtrip_and_header_alignment() {
        let data = vec![1.0, -2.5, 3.25, 0.0, 5.0, 6.0];
        let bytes = to_npy(&[2, 3], &data);
        assert_eq!(
            (10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize) % 64,
            0
        );
        assert_eq!(from_npy(&bytes).unwrap(), (vec![2, 3], data));
        let one = to_npy(&[3], &[1.0, 2.0, 3.0]);
        assert!(std::str::from_utf8(&one[10..74])
            .unwrap()
            .contains("'shape': (3,)"));
        assert_eq!(from_npy(&one).unwrap().0, vec![3]);
    }
}
