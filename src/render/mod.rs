//! Renderers: they format what the analyses computed; no maths here.
pub mod npy;
