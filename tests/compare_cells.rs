//! The cell-by-cell comparison every reference check uses (`common::assert_cells`) fails on what
//! a plain maximum would let through: a NaN, an infinity, a missing cell, an extra or repeated
//! cell, and a difference over the bound.
mod common;
use common::{array_cells, assert_cells, Bound};

fn cells(v: &[f64]) -> Vec<((usize, usize), f64)> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| ((i / 2, i % 2), x))
        .collect()
}

fn fails(
    got: Vec<((usize, usize), f64)>,
    want: Vec<((usize, usize), f64)>,
    bound: Bound,
) -> String {
    let r = std::panic::catch_unwind(|| assert_cells("t", got, want, bound));
    let e = r.expect_err("the comparison should have failed");
    e.downcast_ref::<String>().cloned().unwrap_or_default()
}

#[test]
fn equal_cells_pass_and_report_the_worst_difference() {
    let want = cells(&[1.0, 2.0, 3.0, 4.0]);
    let got = cells(&[1.0, 2.05, 3.0, 4.0]);
    let worst = assert_cells("t", got, want, Bound::Abs(0.1));
    assert!((worst - 0.05).abs() < 1e-12, "{worst}");
}

#[test]
fn a_nan_or_an_infinity_fails() {
    let want = cells(&[1.0, 2.0, 3.0, 4.0]);
    let msg = fails(
        cells(&[1.0, f64::NAN, 3.0, 4.0]),
        want.clone(),
        Bound::Abs(1e9),
    );
    assert!(msg.contains("(0, 1)") && msg.contains("NaN"), "{msg}");
    let msg = fails(
        cells(&[1.0, 2.0, f64::INFINITY, 4.0]),
        want.clone(),
        Bound::Abs(1e9),
    );
    assert!(msg.contains("inf"), "{msg}");
    let mut bad_ref = want.clone();
    bad_ref[3].1 = f64::NAN;
    fails(cells(&[1.0, 2.0, 3.0, 4.0]), bad_ref, Bound::Abs(1e9));
}

#[test]
fn a_missing_an_extra_or_a_repeated_cell_fails() {
    let want = cells(&[1.0, 2.0, 3.0, 4.0]);
    let msg = fails(cells(&[1.0, 2.0, 3.0]), want.clone(), Bound::Abs(1.0));
    assert!(msg.contains("missing") && msg.contains("(1, 1)"), "{msg}");
    let msg = fails(
        cells(&[1.0, 2.0, 3.0, 4.0, 5.0]),
        want.clone(),
        Bound::Abs(1.0),
    );
    assert!(
        msg.contains("(2, 0)") && msg.contains("not in the reference"),
        "{msg}"
    );
    let mut twice = cells(&[1.0, 2.0, 3.0, 4.0]);
    twice.push(((0, 0), 1.0));
    let msg = fails(twice, want.clone(), Bound::Abs(1.0));
    assert!(msg.contains("twice"), "{msg}");
    fails(Vec::new(), Vec::new(), Bound::Abs(1.0));
}

#[test]
fn a_difference_over_the_bound_fails_and_names_its_cell() {
    let want = cells(&[1.0, 2.0, 3.0, 40.0]);
    let msg = fails(cells(&[1.0, 2.0, 3.5, 40.0]), want.clone(), Bound::Abs(0.1));
    assert!(msg.contains("(1, 0)") && msg.contains("3.5"), "{msg}");
    // relative to the largest reference value: 0.5 <= 0.02 x 40 passes, 0.01 x 40 does not
    assert_cells(
        "t",
        cells(&[1.0, 2.0, 3.5, 40.0]),
        want.clone(),
        Bound::RelMax(0.02),
    );
    fails(cells(&[1.0, 2.0, 3.5, 40.0]), want, Bound::RelMax(0.01));
}

#[test]
fn arrays_are_keyed_by_their_index() {
    let c = array_cells(&[2, 3], &[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
    assert_eq!(c[4], (vec![1, 1], 4.0));
    assert_eq!(c.len(), 6);
}
