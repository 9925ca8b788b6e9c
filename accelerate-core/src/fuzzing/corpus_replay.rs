//! Replays the fuzz corpus (`fuzz/corpus/<target>/`) through the decoders in every `cargo test`,
//! without cargo-fuzz: an input that once made a decoder panic, or that reaches deep into one,
//! keeps being checked.

use std::path::{Path, PathBuf};

use super::{seeds, TARGETS};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

#[test]
fn every_decoder_has_a_fuzz_target_and_a_corpus() {
    for (name, _) in TARGETS {
        let target = fuzz_dir().join("fuzz_targets").join(format!("{name}.rs"));
        let source = std::fs::read_to_string(&target)
            .unwrap_or_else(|e| panic!("{}: {e}; add the fuzz target", target.display()));
        assert!(
            source.contains(&format!("fuzzing::{name}(")),
            "{} does not call accelerate_core::fuzzing::{name}",
            target.display()
        );
    }
}

#[test]
fn the_corpus_replays_without_a_panic_and_reaches_past_the_checks() {
    for (name, decode) in TARGETS {
        let dir = fuzz_dir().join("corpus").join(name);
        let entries = std::fs::read_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run the fuzzer (docs/src/testing.md, Fuzzing) and commit its corpus",
                dir.display()
            )
        });
        let (mut inputs, mut accepted) = (0, 0);
        for entry in entries {
            let path = entry.unwrap().path();
            let bytes = std::fs::read(&path).unwrap();
            // A panic here fails the test and names nothing: say which input it was.
            let outcome = std::panic::catch_unwind(|| decode(&bytes));
            let outcome =
                outcome.unwrap_or_else(|_| panic!("{name} panicked on {}", path.display()));
            inputs += 1;
            accepted += usize::from(outcome.is_ok());
        }
        assert!(inputs > 0, "{}: the corpus is empty", dir.display());
        // A corpus of nothing but rejected input would test only the first check of a decoder.
        assert!(
            accepted > 0,
            "{name}: none of its {inputs} corpus inputs decodes"
        );
    }
}

#[test]
fn every_seed_decodes() {
    for (name, decode) in TARGETS {
        let seeds = seeds(name);
        assert!(!seeds.is_empty(), "{name} has no seeds");
        for seed in seeds {
            assert_eq!(decode(&seed), Ok(()), "{name}: seed {seed:?}");
        }
    }
}

/// Writes the seeds into the corpus directories: run once before fuzzing a new target
/// (`cargo test -p accelerate-core fuzzing:: -- --ignored`).
#[test]
#[ignore = "writes into fuzz/corpus; run by hand before fuzzing a new target"]
fn write_seed_corpus() {
    for (name, _) in TARGETS {
        let dir = fuzz_dir().join("corpus").join(name);
        std::fs::create_dir_all(&dir).unwrap();
        for (i, seed) in seeds(name).iter().enumerate() {
            std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
        }
    }
}
