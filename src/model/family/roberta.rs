//! RoBERTa (an encoder): BERT's blocks and names; positions counted from `padding_idx + 1` (a
//! padding token sits at `padding_idx`), usually one token type, a byte-level BPE tokenizer with
//! `<s>`/`</s>` (pairs as `<s> A </s></s> B </s>`).

use super::bert::{checks, hf_tensor, ENCODER, ENCODER_HF};
use super::{Check, Family, Hf, Want};
use crate::model::config::Arch;

pub static FAMILY: Family = Family {
    arch: Arch::Roberta,
    name: "roberta",
    hf_class: "RobertaModel",
    hf: Hf {
        name: hf_tensor,
        position_pad: true,
        base_prefix: Some("roberta."),
        checks: &checks!("roberta"),
        ..ENCODER_HF
    },
    ..ENCODER
};
