//! Which products a decode step takes, counted (`matvec::block_products`): `generate`'s steps
//! multiply from the file's blocks (the default), whichever of rayon's threads runs the step, and
//! a forward outside `generate` never does, even of one row. A binary of its own, so that no other
//! test's products run in this process while it counts.

mod common;
use attnscope::model::capture::NoCapture;
use attnscope::model::forward::RunOptions;
use attnscope::model::generate::GenOptions;
use attnscope::model::weights::matvec::block_products;

#[test]
fn generate_steps_multiply_from_the_blocks_and_nothing_else_does() {
    let model = common::real_model("qwen2.5-coder-0.5b");
    let ids = model
        .encode(
            "Hà Nội là thủ đô của Việt Nam. Thành phố này nằm ở miền Bắc.",
            false,
        )
        .unwrap();
    // a forward of one token and one of the sentence, outside generate: the panels
    let before = block_products();
    for tokens in [&ids[..1], &ids[..]] {
        let opts = RunOptions::last_logits(tokens.len());
        model.forward(tokens, &opts, &mut NoCapture).unwrap();
    }
    assert_eq!(
        block_products(),
        before,
        "a forward outside generate multiplied from the blocks"
    );
    // generate: up to 6 new tokens, so up to 5 KV-cache steps of one row, each with 24 layers' q|k|v, o,
    // gate|up and down and the output head from the blocks (the prompt's last layer too)
    let o = GenOptions {
        max_new_tokens: 6,
        ..Default::default()
    };
    let g = model.generate(&ids, &o, |_| {}).unwrap();
    // (an end-of-text token could stop it early: every step still counts)
    let steps = g.generated.len() as u64 - 1;
    assert!(steps >= 3, "{} new tokens", g.generated.len());
    let per_step = 24 * 4 + 1;
    let got = block_products() - before;
    assert!(
        got >= steps * per_step,
        "generate multiplied {got} products from the blocks; its {steps} steps alone have {}",
        steps * per_step
    );
}
