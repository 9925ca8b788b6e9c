//! The launcher's environment reaches the Trainer (a test binary of its own: it sets a
//! process-wide variable that the other tests must not see).

use accelerate_core::{Accelerator, MixedPrecision};
use accelerate_trainer::{Trainer, TrainingArguments};
use candle_core::DType;

#[test]
fn mixed_precision_left_unset_follows_accelerate_launch() {
    // What `accelerate-launch --mixed-precision bf16` sets for every rank.
    std::env::set_var("ACCELERATE_MIXED_PRECISION", "bf16");
    let dir = tempfile::tempdir().unwrap();
    let args = TrainingArguments {
        output_dir: dir.path().join("out"),
        ..Default::default()
    };
    let unset = Trainer::new(args.clone()).unwrap().compute_dtype();
    let set = Trainer::new(TrainingArguments {
        mixed_precision: Some(MixedPrecision::No),
        ..args
    })
    .unwrap()
    .compute_dtype();
    let plain = Accelerator::builder().build().unwrap().compute_dtype();
    std::env::remove_var("ACCELERATE_MIXED_PRECISION");
    assert_eq!((unset, plain), (DType::BF16, DType::BF16));
    // Set in the arguments, it wins, as the builder's setting does.
    assert_eq!(set, DType::F32);
}
