//! Overlap of gradient reduction with bucket preparation, through the real launcher: the
//! parameters are bitwise the same with and without overlap, and N ranks × K micro-batches with
//! overlap still equal one process with an N·K times larger batch.

use std::path::Path;
use std::time::Duration;

use accelerate_tests::{
    load_flat, max_abs_diff_flat, output_text, small_mlp_args, summary_value, Job, JobOutput,
};

const LIMIT: Duration = Duration::from_secs(240);

/// A cap of 1 KiB splits the H=16 MLP into five buckets: [l1.bias], [l1.weight], [l2.bias],
/// [l2.weight], [l3.bias, l3.weight].
const SMALL_CAP_MB: f64 = 1.0 / 1024.0;
const BUCKETS_AT_SMALL_CAP: f64 = 5.0;

/// Arguments of a small, shuffled MLP run with K = `k` that saves its weights to `out`.
fn mlp_args(samples: usize, batch: usize, optimizer: &str, k: usize, out: &Path) -> Vec<String> {
    let mut args = small_mlp_args(samples, batch, optimizer, 5, out);
    args.extend(["--grad-accum".to_string(), k.to_string()]);
    args
}

/// Runs the mlp example on `n` CPU ranks through the launcher with the small bucket cap and
/// overlap switched as asked (by the environment variable, which the launcher passes on).
fn launch(n: usize, overlap: bool, args: &[String]) -> JobOutput {
    let o = Job::example("mlp")
        .ranks(n)
        .args(args)
        .env("ACCELERATE_BUCKET_CAP_MB", SMALL_CAP_MB.to_string())
        .env(
            "ACCELERATE_OVERLAP_GRADIENT_REDUCTION",
            if overlap { "1" } else { "0" },
        )
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", output_text(&o));
    assert_eq!(
        summary_value::<f64>(&o, "overlap"),
        f64::from(u8::from(overlap))
    );
    assert_eq!(summary_value::<f64>(&o, "buckets"), BUCKETS_AT_SMALL_CAP);
    o
}

/// One process, no launcher, batch `batch`, default bucket cap.
fn single(args: &[String]) -> JobOutput {
    let o = Job::mlp(1).args(args).limit(LIMIT).run();
    assert!(o.status.success(), "{}", output_text(&o));
    o
}

fn bits(params: &std::collections::BTreeMap<String, Vec<f32>>) -> Vec<(String, Vec<u32>)> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), v.iter().map(|x| x.to_bits()).collect()))
        .collect()
}

#[test]
fn overlap_on_and_off_give_bitwise_identical_parameters_on_two_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (n, k, b) = (2, 2, 4);
    let samples = 5 * n * k * b;
    for optimizer in ["adamw", "sgd"] {
        let mut trained = Vec::new();
        for overlap in [false, true] {
            let out = dir
                .path()
                .join(format!("{optimizer}_{overlap}.safetensors"));
            let o = launch(n, overlap, &mlp_args(samples, b, optimizer, k, &out));
            assert_eq!(
                summary_value::<f64>(&o, "steps"),
                10.0,
                "{}",
                output_text(&o)
            );
            assert_eq!(
                summary_value::<f64>(&o, "grad_all_reduces"),
                10.0 * BUCKETS_AT_SMALL_CAP
            );
            trained.push(load_flat(&out));
        }
        assert!(
            bits(&trained[0]) == bits(&trained[1]),
            "{optimizer}: overlap changed the parameters, max |Δθ| = {}",
            max_abs_diff_flat(&trained[0], &trained[1])
        );
        // The runs did train: equal parameters are not equal initial ones.
        let init = dir.path().join(format!("{optimizer}_init.safetensors"));
        let mut a = mlp_args(samples, b, optimizer, k, &init);
        a.extend(["--max-steps".into(), "0".into()]);
        single(&a);
        assert!(max_abs_diff_flat(&load_flat(&init), &trained[1]) > 1e-3);
    }
}

#[test]
fn n_ranks_times_k_micro_batches_with_overlap_equal_one_large_batch() {
    let dir = tempfile::tempdir().unwrap();
    let b = 4;
    for (n, k, optimizer, tolerance) in [
        (2, 2, "adamw", 1e-4f32),
        (3, 2, "sgd", 2e-5),
        (2, 4, "sgd", 2e-5),
    ] {
        let samples = 5 * n * k * b;
        let dist = dir.path().join(format!("dist_{n}_{k}.safetensors"));
        let o = launch(n, true, &mlp_args(samples, b, optimizer, k, &dist));
        assert_eq!(
            summary_value::<f64>(&o, "steps"),
            10.0,
            "{}",
            output_text(&o)
        );
        let one = dir.path().join(format!("single_{n}_{k}.safetensors"));
        let s = single(&mlp_args(samples, n * k * b, optimizer, 1, &one));
        assert_eq!(summary_value::<f64>(&s, "steps"), 10.0);
        let d = max_abs_diff_flat(&load_flat(&dist), &load_flat(&one));
        assert!(
            d < tolerance,
            "{n} ranks, K={k}, {optimizer}, overlap: max |Δθ| = {d}"
        );
    }
}
