//! The `llama` workload against Hugging Face transformers: on a tiny LlamaForCausalLM whose
//! weights, tokens, loss, logits, gradients and weights after one SGD step transformers wrote into
//! tests/fixtures/llama (tests/python/make_llama_fixture.py), our model computes the same values,
//! and the `llama` example takes transformers' SGD step and saves it under transformers' names.
//! Two ranks with item-weighted accumulation equal one process with the global batch, and bad
//! input is refused with messages that name the problem.
//!
//! Tolerance of the model comparison: every tensor's largest difference relative to its largest
//! value is at most 2e-5. Both sides compute in f32 with reductions in different orders (candle's
//! and PyTorch's matrix products, softmax and mean), which leaves differences of a few f32 ulps
//! (~1e-7 relative) per op, grown by the ~20 ops from the embedding to the loss and back; a model
//! with a wrong rotary base, norm or head grouping is off by 1e-2 or more (checked below).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use accelerate_examples::llama::{self, LlamaConfig};
use accelerate_tests::{
    load_flat, max_abs_diff_flat, named_vars, output_text as text, small_llama_args, summary_value,
    Job, JobOutput,
};
use candle_core::{DType, Device, Tensor, Var};

const LIMIT: Duration = Duration::from_secs(240);
/// Largest |ours - transformers'| / max |transformers'| accepted per tensor (see the module docs).
const RELATIVE_TOLERANCE: f32 = 2e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/llama")
        .join(name)
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("reference.safetensors"), &Device::Cpu).unwrap()
}

/// The `llama` example on one compute thread (tests run side by side), alone unless given
/// [`Job::ranks`].
fn llama_job() -> Job {
    Job::example("llama")
        .env("RAYON_NUM_THREADS", "1")
        .limit(LIMIT)
}

/// The example alone, bounded in time.
fn run_llama(args: &[&str]) -> JobOutput {
    llama_job().args(args).run()
}

/// `max |a - b| / max |b|`.
fn relative_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale
}

/// Our model of `config`, with the fixture's weights, and its parameters by name.
fn fixture_model(config: LlamaConfig) -> (llama::Llama, Vec<(String, Var)>) {
    let (varmap, model) = llama::build_in(config, 0, &Device::Cpu, DType::F32).unwrap();
    let params = named_vars(&varmap);
    accelerate_core::load_into_vars(fixture("model.safetensors"), &params).unwrap();
    (model, params)
}

fn fixture_tokens() -> Tensor {
    let t = candle_core::safetensors::load(fixture("tokens.safetensors"), &Device::Cpu).unwrap();
    t["input_ids"].to_dtype(DType::U32).unwrap()
}

#[test]
fn both_config_layouts_read_as_the_fixture_model() {
    let v5 = LlamaConfig::from_file(&fixture("config.json")).unwrap();
    let v4 = LlamaConfig::from_file(&fixture("config_v4.json")).unwrap();
    assert_eq!(v5, v4);
    assert_eq!(v5.rope_theta, 500.0);
    assert_eq!((v5.num_attention_heads, v5.num_key_value_heads), (4, 2));
    assert_eq!(v5.head_dim, 8);
    assert_eq!(v5.rms_norm_eps, 1e-5);
}

#[test]
fn loss_logits_and_every_gradient_equal_transformers() {
    let config = LlamaConfig::from_file(&fixture("config.json")).unwrap();
    let (model, params) = fixture_model(config);
    let reference = reference();
    let input_ids = fixture_tokens();
    let (b, t) = input_ids.dims2().unwrap();

    let logits = model.forward(&input_ids).unwrap();
    let d = relative_diff(&logits, &reference["logits"]);
    assert!(d <= RELATIVE_TOLERANCE, "logits: relative difference {d}");

    let summed = llama::causal_lm_loss_sum(&logits, &input_ids).unwrap();
    let loss = (summed / (b * (t - 1)) as f64).unwrap();
    let ours = loss.to_scalar::<f32>().unwrap();
    let theirs = reference["loss"].to_scalar::<f32>().unwrap();
    assert!(
        (ours - theirs).abs() <= RELATIVE_TOLERANCE * theirs,
        "loss {ours} vs transformers' {theirs}"
    );

    let grads = loss.backward().unwrap();
    assert_eq!(params.len(), 3 + 2 * 9);
    for (name, var) in &params {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient reached {name}"));
        let d = relative_diff(g, &reference[&format!("grad.{name}")]);
        assert!(d <= RELATIVE_TOLERANCE, "{name}: relative difference {d}");
    }
}

#[test]
fn the_comparison_would_catch_a_wrong_rotary_base() {
    // The default theta instead of the config's 500 moves the logits far beyond the tolerance.
    let config = LlamaConfig::from_file(&fixture("config.json")).unwrap();
    let (model, _) = fixture_model(LlamaConfig {
        rope_theta: 10_000.0,
        ..config
    });
    let logits = model.forward(&fixture_tokens()).unwrap();
    let d = relative_diff(&logits, &reference()["logits"]);
    assert!(d > 100.0 * RELATIVE_TOLERANCE, "{d}");
}

#[test]
fn one_sgd_step_of_the_example_gives_transformers_weights_under_their_names() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.safetensors");
    let o = run_llama(&[
        "--config",
        fixture("config.json").to_str().unwrap(),
        "--init-weights",
        fixture("model.safetensors").to_str().unwrap(),
        "--data",
        fixture("tokens.safetensors").to_str().unwrap(),
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--lr",
        "0.1",
        "--max-steps",
        "1",
        "--batch-size",
        "4",
        "--no-shuffle",
        "--save-model",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(summary_value::<f64>(&o, "steps"), 1.0);
    // The loss of the step is transformers' loss of the batch.
    let theirs = reference()["loss"].to_scalar::<f32>().unwrap() as f64;
    let loss = summary_value::<f64>(&o, "final_loss");
    assert!((loss - theirs).abs() < 1e-4, "{loss} vs {theirs}");

    let saved = load_flat(&out);
    let expected: BTreeMap<String, Vec<f32>> = reference()
        .into_iter()
        .filter_map(|(n, t)| {
            let name = n.strip_prefix("after_sgd.")?.to_string();
            Some((name, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        })
        .collect();
    // Same names (max_abs_diff_flat asserts it) and the same values.
    let d = max_abs_diff_flat(&saved, &expected);
    assert!(d < 1e-5, "max |Δθ| against transformers' SGD step: {d}");
    // The step moved the weights far more than that.
    let before = load_flat(&fixture("model.safetensors"));
    assert!(max_abs_diff_flat(&before, &expected) > 1e-3);

    // config.json beside the weights describes the same model.
    let written = LlamaConfig::from_file(&dir.path().join("config.json")).unwrap();
    assert_eq!(
        written,
        LlamaConfig::from_file(&fixture("config.json")).unwrap()
    );
}

fn small_model_args(out: &Path, batch: usize, steps: u64) -> Vec<String> {
    let mut args = small_llama_args(batch, steps);
    args.extend([
        "--save-model".to_string(),
        out.to_str().unwrap().to_string(),
    ]);
    args
}

#[test]
fn two_ranks_with_two_micro_batches_equal_one_process_with_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir(dir.path().join("dist")).unwrap();
    std::fs::create_dir(dir.path().join("single")).unwrap();
    let dist = dir.path().join("dist/model.safetensors");
    let mut args = small_model_args(&dist, 4, 8);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let d = llama_job().ranks(2).args(&args).run();
    assert!(d.status.success(), "{}", text(&d));
    assert_eq!(summary_value::<f64>(&d, "steps"), 8.0, "{}", text(&d));
    assert_eq!(
        summary_value::<f64>(&d, "micro_steps"),
        16.0,
        "{}",
        text(&d)
    );

    // One process, one micro-batch holding the same 2 x 2 x 4 rows per step.
    let single = dir.path().join("single/model.safetensors");
    let s = run_llama(
        &small_model_args(&single, 16, 8)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(s.status.success(), "{}", text(&s));
    let (a, b) = (load_flat(&dist), load_flat(&single));
    assert!(a.contains_key("model.layers.0.self_attn.k_proj.weight"));
    let diff = max_abs_diff_flat(&a, &b);
    assert!(
        diff < 1e-4,
        "max |Δθ| between 2 ranks x K=2 and 1 process = {diff}"
    );
    let (ld, ls) = (
        summary_value::<f64>(&d, "final_loss"),
        summary_value::<f64>(&s, "final_loss"),
    );
    assert!((ld - ls).abs() < 1e-4, "final loss {ld} vs {ls}");

    // The comparison could have failed: training moved the weights far more than the tolerance.
    let init = dir.path().join("init.safetensors");
    let i = run_llama(
        &small_model_args(&init, 16, 0)
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(i.status.success(), "{}", text(&i));
    assert!(max_abs_diff_flat(&load_flat(&init), &b) > 0.01);
}

/// Runs the example with `args`, expects failure, and returns its stderr.
fn refused(args: &[&str]) -> String {
    let o = run_llama(args);
    assert!(!o.status.success(), "accepted {args:?}:\n{}", text(&o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_weights_data_and_configs_are_refused_with_the_problem_named() {
    let dir = tempfile::tempdir().unwrap();
    let config = fixture("config.json");
    let config = config.to_str().unwrap();
    let weights = fixture("model.safetensors");
    let data = fixture("tokens.safetensors");

    // Weights without lm_head.weight.
    let mut tensors = candle_core::safetensors::load(&weights, &Device::Cpu).unwrap();
    tensors.remove("lm_head.weight");
    let partial = dir.path().join("partial.safetensors");
    candle_core::safetensors::save(&tensors, &partial).unwrap();
    let e = refused(&[
        "--config",
        config,
        "--init-weights",
        partial.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
    ]);
    assert!(
        e.contains("--init-weights") && e.contains("missing \"lm_head.weight\""),
        "{e}"
    );

    // input_ids as float.
    let ids = candle_core::safetensors::load(&data, &Device::Cpu).unwrap()["input_ids"]
        .to_dtype(DType::F32)
        .unwrap();
    let float_ids = dir.path().join("float_ids.safetensors");
    candle_core::safetensors::save(&HashMap::from([("input_ids".to_string(), ids)]), &float_ids)
        .unwrap();
    let e = refused(&["--config", config, "--data", float_ids.to_str().unwrap()]);
    assert!(
        e.contains("--data") && e.contains("input_ids") && e.contains("int64"),
        "{e}"
    );

    // A token outside the config's vocabulary.
    let big = Tensor::new(&[[1i64, 2, 3], [4, 32, 6]], &Device::Cpu).unwrap();
    let big_ids = dir.path().join("big_ids.safetensors");
    candle_core::safetensors::save(&HashMap::from([("input_ids".to_string(), big)]), &big_ids)
        .unwrap();
    let e = refused(&["--config", config, "--data", big_ids.to_str().unwrap()]);
    assert!(e.contains("[1, 1] is 32") && e.contains("vocab"), "{e}");

    // Tied embeddings.
    let mut tied: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("config.json")).unwrap()).unwrap();
    tied["tie_word_embeddings"] = true.into();
    let tied_path = dir.path().join("tied.json");
    std::fs::write(&tied_path, tied.to_string()).unwrap();
    let e = refused(&["--config", tied_path.to_str().unwrap()]);
    assert!(
        e.contains("--config") && e.contains("tie_word_embeddings") && e.contains("false"),
        "{e}"
    );

    let e = refused(&["--heads", "4", "--kv-heads", "3"]);
    assert!(e.contains("--kv-heads 3") && e.contains("--heads 4"), "{e}");
    let e = refused(&["--width", "30", "--heads", "4"]);
    assert!(e.contains("--width 30"), "{e}");
    // The weights cannot take the name of the config.json written beside them.
    let clash = dir.path().join("config.json");
    let e = refused(&["--save-model", clash.to_str().unwrap(), "--max-steps", "1"]);
    assert!(
        e.contains("config.json") && e.contains("model.safetensors"),
        "{e}"
    );
    assert!(!clash.exists(), "nothing was written");
}

/// `-Σ p ln p` over the characters of the built-in text, in nats: the loss of a model that
/// ignores context.
fn sonnets_unigram_entropy_and_vocabulary() -> (f64, usize) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/data/sonnets.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut counts: HashMap<char, f64> = HashMap::new();
    for c in text.chars() {
        *counts.entry(c).or_default() += 1.0;
    }
    let n: f64 = counts.values().sum();
    let entropy = counts.values().map(|&c| -(c / n) * (c / n).ln()).sum();
    (entropy, counts.len())
}

fn mean_of_last_10(path: &Path) -> (f64, f64) {
    let l = accelerate_tests::metric_losses(path);
    (l[0], l[l.len() - 10..].iter().sum::<f64>() / 10.0)
}

#[test]
fn it_learns_the_built_in_text_well_below_its_unigram_entropy_in_f32_and_bf16() {
    let (entropy, vocab) = sonnets_unigram_entropy_and_vocabulary();
    for (precision, margin) in [("no", 0.5), ("bf16", 0.3)] {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        let o = run_llama(&[
            "--context",
            "32",
            "--epochs",
            "2",
            "--max-steps",
            "120",
            "--mixed-precision",
            precision,
            "--metrics",
            metrics.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stdout).contains(&format!("mixed_precision={precision}"))
        );
        let (first, end) = mean_of_last_10(&metrics);
        // Small initial weights predict near-uniformly: the first loss per token is about
        // ln(vocabulary), which also shows the loss is normalized per predicted token.
        let uniform = (vocab as f64).ln();
        assert!((first - uniform).abs() < 0.1, "{first} vs ln V = {uniform}");
        assert!(
            end < entropy - margin,
            "{precision}: mean loss of the last 10 steps {end:.4}, unigram entropy {entropy:.4}"
        );
    }
}

#[test]
fn a_run_resumed_from_a_checkpoint_ends_bitwise_like_an_uninterrupted_one() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let c = ckpt.to_str().unwrap();
    let with = |out: &Path, steps: u64, more: &[&str]| {
        let mut a = small_model_args(out, 4, steps);
        a.extend(
            ["--grad-accum", "2"]
                .iter()
                .chain(more)
                .map(|s| s.to_string()),
        );
        let o = run_llama(&a.iter().map(String::as_str).collect::<Vec<_>>());
        assert!(o.status.success(), "{}", text(&o));
        o
    };
    let whole = dir.path().join("whole.safetensors");
    with(&whole, 10, &[]);
    let part = dir.path().join("part.safetensors");
    with(
        &part,
        5,
        &["--checkpoint-every", "5", "--checkpoint-dir", c],
    );
    let resumed = dir.path().join("resumed.safetensors");
    let o = with(&resumed, 10, &["--resume", "--checkpoint-dir", c]);
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("resumed from"),
        "{}",
        text(&o)
    );
    assert_eq!(
        summary_value::<f64>(&o, "micro_steps"),
        10.0,
        "5 windows of 2 after the resume"
    );
    let whole = load_flat(&whole);
    assert_eq!(max_abs_diff_flat(&whole, &load_flat(&resumed)), 0.0);
    assert!(max_abs_diff_flat(&whole, &load_flat(&part)) > 0.0);
}

#[test]
fn max_steps_runs_all_its_steps_over_as_many_epochs_as_they_take() {
    // 43 KB of text in rows of 16 make about 21 batches of 128: 30 steps need a second epoch.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.safetensors");
    let mut a = small_model_args(&out, 128, 30);
    let o = run_llama(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(summary_value::<f64>(&o, "steps"), 30.0, "{}", text(&o));
    // --max-steps overrides an explicit --epochs too, as transformers' max_steps overrides
    // num_train_epochs.
    a.extend(["--epochs", "1"].iter().map(|s| s.to_string()));
    let o = run_llama(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(summary_value::<f64>(&o, "steps"), 30.0, "{}", text(&o));
}

/// A trained model saved by the example, loaded by transformers' `from_pretrained` from its
/// directory (the weights and the config.json beside them), gives the loss our model gives on the
/// fixture's tokens. Skipped (saying so) without python3 with torch and transformers; the other
/// tests need no Python.
/// The causal-LM loss of `input_ids` per predicted token, as transformers reports it.
fn mean_causal_lm_loss(model: &llama::Llama, input_ids: &Tensor) -> f32 {
    let (b, t) = input_ids.dims2().unwrap();
    let summed = model.summed_causal_lm_loss(input_ids).unwrap();
    summed.to_scalar::<f32>().unwrap() / (b * (t - 1)) as f32
}

/// Runs `tests/python/<script> <paths...> <ours>` (a check against transformers) and expects it to
/// succeed printing `ok`.
fn python_check(script: &str, paths: &[&std::ffi::OsStr], ours: f32) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("python")
        .join(script);
    let o = Job::new("python3")
        .arg(&script)
        .args(paths)
        .arg(ours.to_string())
        .limit(Duration::from_secs(120))
        .run();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stdout).contains("ok"),
        "{}",
        text(&o)
    );
}

/// Whether python3 with torch, transformers and safetensors is installed; says SKIPPED if not.
fn python_with_transformers() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "import torch, transformers, safetensors"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        eprintln!(
            "SKIPPED: python3 with torch, transformers and safetensors is not installed \
             (pip install torch transformers safetensors)"
        );
    }
    ok
}

#[test]
fn transformers_loads_the_saved_model_unchanged() {
    if !python_with_transformers() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("model.safetensors");
    // Three AdamW steps from the fixture's weights, so the saved weights are the example's own.
    let o = run_llama(&[
        "--config",
        fixture("config_v4.json").to_str().unwrap(),
        "--init-weights",
        fixture("model.safetensors").to_str().unwrap(),
        "--data",
        fixture("tokens.safetensors").to_str().unwrap(),
        "--batch-size",
        "2",
        "--max-steps",
        "3",
        "--save-model",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let config = LlamaConfig::from_file(&dir.path().join("config.json")).unwrap();
    let (varmap, model) = llama::build_in(config, 0, &Device::Cpu, DType::F32).unwrap();
    let params = named_vars(&varmap);
    accelerate_core::load_into_vars(&out, &params).unwrap();
    let input_ids = fixture_tokens();
    let (b, t) = input_ids.dims2().unwrap();
    let ours = (model.summed_causal_lm_loss(&input_ids).unwrap() / (b * (t - 1)) as f64)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    python_check(
        "check_llama_save.py",
        &[dir.path().as_ref(), fixture("tokens.safetensors").as_ref()],
        ours,
    );
}

// --- Hugging Face model directories (`--model`, `--output-dir`) and packed rows, on
// tests/fixtures/llama-dir (tests/python/make_llama_dir_fixture.py): a model transformers saved in
// four shards with an index, and what transformers computes with it.

fn dir_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama-dir")
}

fn dir_reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(dir_fixture().join("reference.safetensors"), &Device::Cpu)
        .unwrap()
}

/// The fixture directory's model, loaded through `ModelDir`, and its parameters by name.
fn model_from_dir(dir: &Path) -> (llama::Llama, Vec<(String, Var)>) {
    let model_dir = llama::ModelDir::open(dir).unwrap();
    let (varmap, model) = llama::build_in(model_dir.config(), 0, &Device::Cpu, DType::F32).unwrap();
    let params = named_vars(&varmap);
    model_dir.load_into(&params).unwrap();
    (model, params)
}

/// A copy of `from`'s files in `to`.
fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn a_sharded_model_directory_loads_the_weights_transformers_computes_with() {
    let dir = dir_fixture();
    let shards = llama::ModelDir::open(&dir).unwrap().weight_files().count();
    assert!(shards >= 2, "the fixture is sharded ({shards} file)");
    let (model, _) = model_from_dir(&dir);
    let reference = dir_reference();
    let input_ids = candle_core::safetensors::load(dir.join("tokens.safetensors"), &Device::Cpu)
        .unwrap()["input_ids"]
        .to_dtype(DType::U32)
        .unwrap();
    let logits = model.forward(&input_ids).unwrap();
    let d = relative_diff(&logits, &reference["logits"]);
    assert!(d <= RELATIVE_TOLERANCE, "logits: relative difference {d}");
    let ours = mean_causal_lm_loss(&model, &input_ids);
    let theirs = reference["loss"].to_scalar::<f32>().unwrap();
    assert!(
        (ours - theirs).abs() <= RELATIVE_TOLERANCE * theirs,
        "loss {ours} vs transformers' {theirs}"
    );
}

/// The packed rows of the fixture: input_ids, segment_ids (u32).
fn packed_rows() -> (Tensor, Tensor) {
    let p = candle_core::safetensors::load(dir_fixture().join("packed.safetensors"), &Device::Cpu)
        .unwrap();
    let u32s = |n: &str| p[n].to_dtype(DType::U32).unwrap();
    (u32s("input_ids"), u32s("segment_ids"))
}

#[test]
fn packed_rows_equal_transformers_with_reset_positions_and_a_document_mask() {
    let (model, params) = model_from_dir(&dir_fixture());
    let reference = dir_reference();
    let (ids, segment_ids) = packed_rows();
    let segments = llama::Segments::new(&segment_ids).unwrap();
    let logits = model.forward_segments(&ids, &segments).unwrap();
    // Compared where a document is (transformers' padding rows attend to themselves; ours are
    // not computed).
    let inside = segment_ids
        .ne(0u32)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .unsqueeze(2)
        .unwrap();
    let masked = |t: &Tensor| t.broadcast_mul(&inside).unwrap();
    let d = relative_diff(&masked(&logits), &masked(&reference["packed_logits"]));
    assert!(
        d <= RELATIVE_TOLERANCE,
        "packed logits: relative difference {d}"
    );

    let token_loss = &reference["packed_token_loss"];
    let per_row = model.segment_loss_per_row(&ids, &segments).unwrap();
    let d = relative_diff(&per_row, &token_loss.sum(1).unwrap());
    assert!(
        d <= RELATIVE_TOLERANCE,
        "per-row losses: relative difference {d}"
    );
    let predicted_by_transformers = token_loss.ne(0f32).unwrap().to_dtype(DType::F32).unwrap();
    let (sum, count) = model.summed_segment_loss(&ids, &segments).unwrap();
    assert_eq!(
        count as f32,
        predicted_by_transformers
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    );
    assert_eq!(count, 4 + 6 + 3 + 9);
    let theirs = token_loss.sum_all().unwrap().to_scalar::<f32>().unwrap();
    let ours = sum.to_scalar::<f32>().unwrap();
    assert!(
        (ours - theirs).abs() <= RELATIVE_TOLERANCE * theirs,
        "packed loss {ours} vs transformers' {theirs}"
    );
    let grads = sum.backward().unwrap();
    for (name, var) in &params {
        let g = grads.get(var.as_tensor()).unwrap();
        let d = relative_diff(g, &reference[&format!("packed_grad.{name}")]);
        assert!(d <= RELATIVE_TOLERANCE, "{name}: relative difference {d}");
    }
}

/// `--model DIR` and the flags of one-row-per-step SGD on the fixture's tokens.
fn dir_args(model: &Path, steps: &str) -> Vec<String> {
    [
        "--model",
        model.to_str().unwrap(),
        "--data",
        dir_fixture().join("tokens.safetensors").to_str().unwrap(),
        "--optimizer",
        "sgd",
        "--momentum",
        "0",
        "--lr",
        "0.1",
        "--batch-size",
        "4",
        "--no-shuffle",
        "--max-steps",
        steps,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run_llama_strings(args: &[String]) -> JobOutput {
    llama_job().args(args.iter().map(String::as_str)).run()
}

#[test]
fn the_example_trains_from_a_model_directory_and_writes_one_that_reads_back() {
    let tmp = tempfile::tempdir().unwrap();
    // The fixture with tokenizer files, to see them carried along byte for byte.
    let model = tmp.path().join("model");
    copy_dir(&dir_fixture(), &model);
    std::fs::write(
        model.join("tokenizer.json"),
        b"{\"model\": \"a tokenizer\"}",
    )
    .unwrap();
    std::fs::write(model.join("tokenizer_config.json"), b"{\"x\": 1}").unwrap();
    let out = tmp.path().join("out");
    let single = tmp.path().join("single/model.safetensors");
    std::fs::create_dir(tmp.path().join("single")).unwrap();
    let metrics = tmp.path().join("metrics.jsonl");
    let mut args = dir_args(&model, "2");
    args.extend(
        [
            "--output-dir",
            out.to_str().unwrap(),
            "--max-shard-size",
            "30KB",
            "--save-model",
            single.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let o = run_llama_strings(&args);
    assert!(o.status.success(), "{}", text(&o));
    // The first step's loss is transformers' loss of the batch: --model loaded its weights.
    let first = accelerate_tests::metric_losses(&metrics)[0];
    let theirs = dir_reference()["loss"].to_scalar::<f32>().unwrap() as f64;
    assert!((first - theirs).abs() < 1e-4, "{first} vs {theirs}");

    // Shards and an index consistent with them, holding what --save-model wrote.
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    let files: std::collections::BTreeSet<&str> =
        weight_map.values().map(|f| f.as_str().unwrap()).collect();
    assert!(files.len() >= 2, "{files:?}");
    let mut total = 0;
    let mut written = BTreeMap::new();
    for file in &files {
        let held = candle_core::safetensors::load(out.join(file), &Device::Cpu).unwrap();
        assert!(
            file.starts_with("model-")
                && file.ends_with(&format!("-of-{:05}.safetensors", files.len()))
        );
        for (name, t) in held {
            assert_eq!(weight_map[&name], *file, "{name}");
            total += t.elem_count() * 4;
            written.insert(name, t.flatten_all().unwrap().to_vec1::<f32>().unwrap());
        }
    }
    assert_eq!(written.len(), weight_map.len());
    assert_eq!(index["metadata"]["total_size"], total);
    let saved = load_flat(&single);
    assert_eq!(max_abs_diff_flat(&written, &saved), 0.0);
    assert!(
        max_abs_diff_flat(&written, &load_flat_dir(&dir_fixture())) > 1e-3,
        "it trained"
    );
    // config.json describes the model, with the special token ids; the other files came along.
    let config = LlamaConfig::from_file(&out.join("config.json")).unwrap();
    assert_eq!(config, llama::ModelDir::open(&model).unwrap().config());
    let read_json = |dir: &Path| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap()
    };
    let (json, given) = (read_json(&out), read_json(&model));
    for id in ["bos_token_id", "eos_token_id"] {
        assert!(given[id].is_u64(), "the fixture names its {id}");
        assert_eq!(json[id], given[id], "{id}");
    }
    assert_eq!(json["architectures"][0], "LlamaForCausalLM");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(model.join(f)).unwrap(),
            "{f}"
        );
    }
    assert!(
        !out.join("tokens.safetensors").exists(),
        "only the model's files are written"
    );

    // Read back by the example through --model: the same weights (no step taken).
    let again = tmp.path().join("again/model.safetensors");
    std::fs::create_dir(tmp.path().join("again")).unwrap();
    let mut args = dir_args(&out, "0");
    args.extend([
        "--save-model".to_string(),
        again.to_str().unwrap().to_string(),
    ]);
    let o = run_llama_strings(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(max_abs_diff_flat(&load_flat(&again), &saved), 0.0);
}

/// Every weight of a model directory, as `load_flat` reads one file.
fn load_flat_dir(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    llama::model_dir::read_all_weights(dir)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn a_non_empty_output_dir_is_refused_before_training_unless_overwriting() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("notes.txt"), b"keep me").unwrap();
    let mut args = dir_args(&dir_fixture(), "1");
    args.extend([
        "--output-dir".to_string(),
        out.to_str().unwrap().to_string(),
    ]);
    let o = run_llama_strings(&args);
    assert!(!o.status.success(), "{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("--output-dir")
            && e.contains("not empty")
            && e.contains("notes.txt")
            && e.contains("--overwrite-output-dir"),
        "{e}"
    );
    assert!(
        !text(&o).contains("final_loss="),
        "trained first:\n{}",
        text(&o)
    );

    args.push("--overwrite-output-dir".to_string());
    let o = run_llama_strings(&args);
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"keep me");
    assert!(out.join("model.safetensors").exists() && out.join("config.json").exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().collect();
    assert_eq!(left.len(), 1, "no temporary directory is left beside it");
}

#[test]
fn bad_model_directories_and_flag_combinations_are_refused_naming_them() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    copy_dir(&dir_fixture(), &model);
    let index_path = model.join("model.safetensors.index.json");
    let original = std::fs::read_to_string(&index_path).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&original).unwrap();
    index["weight_map"]["lm_head.weight"] = "../../etc/passwd".into();
    std::fs::write(&index_path, index.to_string()).unwrap();
    let o = run_llama_strings(&dir_args(&model, "1"));
    assert!(!o.status.success(), "{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("--model") && e.contains("\"lm_head.weight\"") && e.contains("not a file name"),
        "{e}"
    );

    // A shard the index names is missing.
    std::fs::write(&index_path, &original).unwrap();
    std::fs::remove_file(model.join("model-00002-of-00004.safetensors")).unwrap();
    let o = run_llama_strings(&dir_args(&model, "1"));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && e.contains("model-00002-of-00004.safetensors is missing"),
        "{e}"
    );

    // --model with --config or --init-weights, and a size transformers would not read: each
    // refused naming the flags.
    let config = fixture("config.json");
    let weights = fixture("model.safetensors");
    for (extra, says) in [
        (
            ["--config", config.to_str().unwrap()],
            ["--model", "--config"],
        ),
        (
            ["--init-weights", weights.to_str().unwrap()],
            ["--model", "--init-weights"],
        ),
        (["--max-shard-size", "5XB"], ["--max-shard-size", "500MB"]),
    ] {
        let mut args = dir_args(&dir_fixture(), "1");
        args.extend(extra.map(String::from));
        let o = run_llama_strings(&args);
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(
            !o.status.success() && says.iter().all(|s| e.contains(s)),
            "{extra:?}: {e}"
        );
    }
}

/// An output directory of the example, loaded by transformers' `from_pretrained` (and, with
/// tokenizer files, `AutoTokenizer.from_pretrained`), gives the loss our model gives. Skipped
/// (saying so) without python3 with torch and transformers; run by hand with
/// `tests/python/check_llama_output_dir.py`.
#[test]
fn transformers_loads_the_output_directory() {
    if !python_with_transformers() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = dir_args(&dir_fixture(), "2");
    args.extend(
        [
            "--output-dir",
            out.to_str().unwrap(),
            "--max-shard-size",
            "30KB",
        ]
        .map(String::from),
    );
    let o = run_llama_strings(&args);
    assert!(o.status.success(), "{}", text(&o));
    let (model, _) = model_from_dir(&out);
    let tokens = dir_fixture().join("tokens.safetensors");
    let input_ids = candle_core::safetensors::load(&tokens, &Device::Cpu).unwrap()["input_ids"]
        .to_dtype(DType::U32)
        .unwrap();
    let ours = mean_causal_lm_loss(&model, &input_ids);
    python_check(
        "check_llama_output_dir.py",
        &[out.as_ref(), tokens.as_ref()],
        ours,
    );
}

#[test]
fn two_ranks_write_one_output_directory_and_agree_on_a_refusal() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let mut args = dir_args(&dir_fixture(), "2");
    let batch = args.iter().position(|a| a == "--batch-size").unwrap() + 1;
    args[batch] = "2".to_string();
    args.extend([
        "--output-dir".to_string(),
        out.to_str().unwrap().to_string(),
    ]);
    let o = llama_job().ranks(2).args(&args).run();
    assert!(o.status.success(), "{}", text(&o));
    assert!(out.join("model.safetensors").exists() && out.join("config.json").exists());
    let saved = load_flat_dir(&out);
    assert!(
        max_abs_diff_flat(&saved, &load_flat_dir(&dir_fixture())) > 1e-3,
        "it trained"
    );
    // The directory now holds files: both ranks stop before training, with the main process's
    // reason.
    let o = llama_job().ranks(2).args(&args).run();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("not empty") && !text(&o).contains("final_loss="),
        "{}",
        text(&o)
    );
    assert_eq!(load_flat_dir(&out), saved, "left as it was");
}
