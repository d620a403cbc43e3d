//! What a caller asked for, checked against the model and the text: index lists (`0-3`,
//! `0,12,23`, `all`), single indices, and the error that says the request was wrong
//! ([`UsageError`]: exit 2 from the CLI, `ValueError` in Python) rather than the program.

/// A request that cannot be met as given (a value out of range, two options that exclude each
/// other, a file that is not what it should be): the caller's mistake, exit 2.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A [`UsageError`] with this message.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    anyhow::Error::new(UsageError(msg.into()))
}

/// Whether an error was caused by the caller's input (exit 2, Python's `ValueError`) rather
/// than by the program: a [`UsageError`] or a model error that is bad input, anywhere in its
/// chain.
pub fn is_bad_input(err: &anyhow::Error) -> bool {
    err.chain().any(|c| {
        c.downcast_ref::<crate::model::Error>()
            .is_some_and(|e| e.is_bad_input())
            || c.downcast_ref::<UsageError>().is_some()
    })
}

/// Parses `all`, `3`, `0-3`, `0,12,23` (and mixes such as `0-2,7`) into indices `< count`.
pub fn parse_index_list(spec: &str, count: usize, what: &str) -> anyhow::Result<Vec<usize>> {
    let range = || {
        format!(
            "{what} must be in 0..={} (or `all`)",
            count.saturating_sub(1)
        )
    };
    if spec.trim() == "all" {
        return Ok((0..count).collect());
    }
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim) {
        if part.starts_with('-') && part[1..].trim().parse::<usize>().is_ok() {
            return Err(usage(format!(
                "{what} {part} is out of range: {}; indices count from 0 (a negative one does not count from the end)",
                range()
            )));
        }
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let parse = |s: &str| {
            s.parse::<usize>().map_err(|_| {
                usage(format!(
                    "`{spec}` is not a valid {what} list; write e.g. 0-3, 0,12,23 or all"
                ))
            })
        };
        let (a, b) = (parse(a)?, parse(b)?);
        if a > b {
            return Err(usage(format!("{what} range {a}-{b} is backwards")));
        }
        if b >= count {
            return Err(usage(format!("{what} {b} is out of range: {}", range())));
        }
        for i in a..=b {
            if !out.contains(&i) {
                out.push(i);
            }
        }
    }
    if out.is_empty() {
        return Err(usage(format!("no {what} given")));
    }
    Ok(out)
}

/// A threshold on attention weights (`--epsilon`: a head counts as a sink head when its
/// first-token weight exceeds it) read from text: a number in [0, 1]. NaN is refused (every
/// comparison with it is false, so no head would count and the tables would print NaN), and so
/// are numbers outside [0, 1], which no weight crosses.
pub fn weight_threshold<T>(s: &str) -> Result<T, String>
where
    T: std::str::FromStr + Into<f64> + Copy,
    T::Err: std::fmt::Display,
{
    let v: T = s.trim().parse().map_err(|e| format!("{e}"))?;
    check_weight_threshold(v.into()).map(|_| v)
}

/// Refuses a weight threshold that is NaN or outside [0, 1] (see [`weight_threshold`]).
pub fn check_weight_threshold(v: f64) -> Result<(), String> {
    if (0.0..=1.0).contains(&v) {
        Ok(())
    } else {
        Err(format!(
            "{v} is not an attention weight: give a number from 0 to 1"
        ))
    }
}

/// An amount read from text that may be 0 or more (`--capture-limit-gib`; infinity allowed: no
/// limit): NaN and negative numbers are refused (a NaN limit compares false with everything, so
/// the limit would silently skip every capture).
pub fn non_negative(s: &str) -> Result<f64, String> {
    let v: f64 = s.trim().parse().map_err(|e| format!("{e}"))?;
    if v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{v}: give a number 0 or more"))
    }
}

/// A count that 0 makes meaningless, read from text: 1 or more (`dla --top 0` printed an empty
/// table, `sinks --gu-len 0` left Gu et al.'s metric out unsaid).
pub fn at_least_one(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>().map_err(|e| format!("{e}"))? {
        0 => Err("0 leaves nothing to compute or print; give 1 or more".into()),
        n => Ok(n),
    }
}

/// Checks one index against its count, with a message naming the valid range.
pub fn check_index(value: usize, count: usize, what: &str) -> anyhow::Result<usize> {
    if value >= count {
        return Err(usage(format!(
            "{what} {value} is out of range: valid {what}s are 0..={}",
            count.saturating_sub(1)
        )));
    }
    Ok(value)
}

/// An index the CLI read with its sign (`--layer -1`), as a `usize` once it is not negative;
/// a negative one is refused naming the valid range (`count` of them, `of` saying whose): no
/// index counts from the end in attnscope's CLI. The upper bound is checked where the index is
/// used.
pub fn unsigned_index(value: i64, what: &str, count: usize, of: &str) -> anyhow::Result<usize> {
    usize::try_from(value).map_err(|_| {
        let range = match count {
            0 => String::new(),
            n => format!(" {of} {what}s 0-{}", n - 1),
        };
        usage(format!(
            "{what} {value} is out of range:{range}; indices count from 0 (a negative one does not count from the end)"
        ))
    })
}

/// [`unsigned_index`] of an optional index.
pub fn unsigned_opt(
    v: Option<i64>,
    what: &str,
    count: usize,
    of: &str,
) -> anyhow::Result<Option<usize>> {
    v.map(|v| unsigned_index(v, what, count, of)).transpose()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_lists() {
        assert_eq!(
            parse_index_list("0-3", 14, "head").unwrap(),
            vec![0, 1, 2, 3]
        );
        assert_eq!(
            parse_index_list("0,12,23", 24, "layer").unwrap(),
            vec![0, 12, 23]
        );
        assert_eq!(parse_index_list("all", 3, "head").unwrap(), vec![0, 1, 2]);
        let e = parse_index_list("0-14", 14, "head").unwrap_err();
        assert!(is_bad_input(&e));
        let e = e.to_string();
        assert!(
            e.contains("head 14 is out of range") && e.contains("0..=13"),
            "{e}"
        );
        assert!(parse_index_list("x", 3, "layer").is_err());
        assert!(parse_index_list("3-1", 5, "layer")
            .unwrap_err()
            .to_string()
            .contains("backwards"));
    }

    #[test]
    fn one_index_names_its_range() {
        assert_eq!(check_index(2, 3, "layer").unwrap(), 2);
        let e = check_index(3, 3, "query position").unwrap_err();
        assert!(is_bad_input(&e));
        assert_eq!(
            e.to_string(),
            "query position 3 is out of range: valid query positions are 0..=2"
        );
    }
}
