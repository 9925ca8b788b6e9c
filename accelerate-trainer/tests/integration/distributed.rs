//! The Trainer on 2 ranks (threads of this process) against the equivalent Accelerator loop,
//! written out in `common::reference_loop`, on the same 2 thread-ranks: the same parameters bit
//! for bit.

use crate::common::{dataset, equivalence_args, ranks_as_threads, reference_loop, tiny, values};
use accelerate_trainer::Trainer;

const SEED: u64 = 23;
const RANKS: usize = 2;
/// 50 samples, 25 per rank, batches of 4: 7 batches per rank and epoch, in windows of 3
/// (3, 3, 1), so 3 optimizer steps per epoch, 6 in 2 epochs.
const SAMPLES: usize = 50;
const STEPS: usize = 6;

#[test]
fn on_two_ranks_the_trainer_gives_the_parameters_of_the_accelerator_loop_bitwise() {
    let dir = tempfile::tempdir().unwrap();
    let reference = ranks_as_threads(RANKS, |builder| {
        let args = equivalence_args(&dir.path().join("unused"), SEED);
        reference_loop(builder, &args, SEED, SAMPLES)
    });
    let expected = reference[0].params.clone();
    assert!(
        reference[0].clipped > 0,
        "the settings must make clipping act"
    );
    for run in &reference {
        assert_eq!(
            (run.batches, run.steps),
            (7, STEPS as u64),
            "a batch count per rank that 3 does not divide"
        );
        assert_eq!(run.params, expected, "the ranks hold the same parameters");
    }

    let trained = ranks_as_threads(RANKS, |builder| {
        let mut trainer =
            Trainer::with_accelerator(equivalence_args(&dir.path().join("out"), SEED), builder)
                .unwrap();
        let (varmap, model) = tiny(SEED);
        let before = values(&varmap);
        let out = trainer
            .train(&model, &varmap, dataset(SAMPLES, 1), None)
            .unwrap();
        assert_ne!(values(&varmap), before);
        (out.global_step, values(&varmap))
    });
    for (rank, (steps, params)) in trained.into_iter().enumerate() {
        assert_eq!(steps, STEPS as u64, "rank {rank}");
        assert_eq!(params, expected, "rank {rank}");
    }
}
