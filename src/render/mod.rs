//! Renderers: they format what the analyses computed; no maths here.
pub mod compare_page;
pub mod direct;
pub mod gen_attribute;
pub mod heatmap;
pub mod html;
pub mod npy;
pub mod patch_page;
pub mod report;
pub mod sparse;
pub mod table;
pub mod tensorfile;
