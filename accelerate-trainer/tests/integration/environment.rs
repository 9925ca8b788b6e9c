//! The launcher's environment reaches the Trainer. The test runs in a child process of the test
//! binary (`rerun_with_env`): the variable it needs is process-wide, and the tests running beside
//! it must not see it.

use accelerate_core::{Accelerator, MixedPrecision};
use accelerate_trainer::{Trainer, TrainingArguments};
use candle_core::DType;

#[test]
fn mixed_precision_left_unset_follows_accelerate_launch() {
    // What `accelerate-launch --mixed-precision bf16` sets for every rank.
    if !accelerate_test_support::rerun_with_env(&[("ACCELERATE_MIXED_PRECISION", "bf16")]) {
        return;
    }
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
    assert_eq!((unset, plain), (DType::BF16, DType::BF16));
    // Set in the arguments, it wins, as the builder's setting does.
    assert_eq!(set, DType::F32);
}
