//! The `attnscope compare` page: both sides' data inline in `assets/compare.html`, no network.

use crate::analysis::compare::CompareReport;

const TEMPLATE: &str = include_str!("../../assets/compare.html");

/// The compare page: both sides' data inline, no network.
pub fn page(r: &CompareReport) -> String {
    let round = |rows: &Vec<Vec<Vec<f32>>>| -> serde_json::Value {
        serde_json::to_value(
            rows.iter()
                .map(|l| {
                    l.iter()
                        .map(|h| h.iter().map(|&x| (x * 1e5).round() / 1e5).collect())
                        .collect()
                })
                .collect::<Vec<Vec<Vec<f32>>>>(),
        )
        .expect("rows serialize")
    };
    let mut v = serde_json::to_value(r).expect("report serializes");
    v["a"]["rows"] = round(&r.a.rows);
    v["b"]["rows"] = round(&r.b.rows);
    let json = v.to_string().replace('<', "\\u003c");
    TEMPLATE.replace("/*ATTNSCOPE_DATA*/null", &json).replace(
        "<!--TITLE-->",
        &crate::render::html::html_escape(&format!("attnscope compare: {}", r.mode)),
    )
}
