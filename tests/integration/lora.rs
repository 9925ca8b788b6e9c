//! The `lora` example: LoRA adapters over a frozen `llama` base. Training leaves the base bitwise
//! unchanged and moves only the adapters; two ranks with two micro-batches equal one process with
//! the global batch; the saved adapter has PEFT's names, shapes and config keys, and loaded back
//! computes the logits of the merged model `W + (alpha / r) · B A` (PEFT's `merge_and_unload`,
//! written out here with plain candle products); bad adapter flags are refused by name.
//!
//! PEFT is not in the Python environment the fixtures are made with, so the reference for the
//! loaded adapter is that formula rather than PEFT's own logits.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;

use accelerate_core::Model;
use accelerate_examples::llama::{self, LlamaArgs, LlamaConfig, LlamaRun};
use accelerate_examples::lora::{self, LoraConfig, LoraTarget};
use accelerate_tests::{
    load_flat, max_abs_diff_flat, output_text as text, small_llama_args, summary_value, Job,
    JobOutput,
};
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;

const LIMIT: Duration = Duration::from_secs(240);

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/llama")
        .join(name)
}

fn fixture_str(name: &str) -> String {
    fixture(name).to_str().unwrap().to_string()
}

/// The `lora` example on one compute thread (tests run side by side), alone unless given
/// [`Job::ranks`].
fn lora_job() -> Job {
    Job::example("lora")
        .env("RAYON_NUM_THREADS", "1")
        .limit(LIMIT)
}

fn run_lora<S: AsRef<str>>(args: &[S]) -> JobOutput {
    lora_job().args(args.iter().map(|s| s.as_ref())).run()
}

/// Flags of a run on the transformers fixture (2 layers, hidden 32, 4 rows of 12 tokens).
fn fixture_args() -> Vec<String> {
    [
        "--config",
        &fixture_str("config.json"),
        "--init-weights",
        &fixture_str("model.safetensors"),
        "--data",
        &fixture_str("tokens.safetensors"),
        "--no-shuffle",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// `max |a - b| / max |b|`.
fn relative_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let scale = b.abs().unwrap().max_all().unwrap();
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap()
}

fn named(varmap: &candle_nn::VarMap) -> BTreeMap<String, Var> {
    varmap
        .data()
        .lock()
        .unwrap()
        .iter()
        .map(|(n, v)| (n.clone(), v.clone()))
        .collect()
}

fn values(v: &Var) -> Vec<u32> {
    let t = v
        .as_tensor()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    t.iter().map(|x| x.to_bits()).collect()
}

/// llama's flags alone, as the examples take them.
#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    llama: LlamaArgs,
}

#[test]
fn training_moves_only_the_adapters_and_leaves_the_base_bitwise_unchanged() {
    let mut argv = vec!["lora".to_string()];
    argv.extend(fixture_args());
    argv.extend(["--batch-size", "2", "--max-steps", "3", "--lr", "0.01"].map(String::from));
    let flags = Flags::parse_from(argv);
    // The example's own steps: base built and loaded, adapters attached, base frozen.
    let mut session = LlamaRun::start(&flags.llama).unwrap();
    let (varmap, base) = llama::build_in(session.config, 0, &Device::Cpu, DType::F32).unwrap();
    let base_params: Vec<(String, Var)> = named(&varmap).into_iter().collect();
    accelerate_core::load_into_vars(fixture("model.safetensors"), &base_params).unwrap();
    let config = LoraConfig {
        r: 4,
        alpha: 8.0,
        targets: vec![LoraTarget::QProj, LoraTarget::VProj, LoraTarget::UpProj],
        ..LoraConfig::default()
    };
    let model = lora::with_adapters(&base, &config, &varmap, 0).unwrap();
    let before: BTreeMap<String, Vec<u32>> = named(&varmap)
        .iter()
        .map(|(n, v)| (n.clone(), values(v)))
        .collect();
    let prepared = session
        .acc
        .prepare(Model::from_varmap(&varmap).freeze(|n| !lora::is_adapter_parameter(n)))
        .unwrap();
    assert_eq!(prepared.parameters().len(), 2 * 3 * 2);
    assert_eq!(prepared.frozen_parameters().len(), 3 + 2 * 9);
    let params = prepared.parameters().to_vec();
    let acc = session.train(&model, params).unwrap();
    assert_eq!(acc.optimizer_steps(), 3);

    for (name, var) in named(&varmap) {
        let same = values(&var) == before[&name];
        if lora::is_adapter_parameter(&name) {
            assert!(!same, "{name} did not train");
        } else {
            assert!(same, "frozen {name} changed");
        }
    }
}

/// Flags of a small shuffled run (1 layer, hidden 32, SGD) with adapters on three projections.
fn small_model_args(out: &Path, batch: usize, steps: u64) -> Vec<String> {
    let mut args = small_llama_args(batch, steps);
    let lora = [
        "--lora-r",
        "4",
        "--lora-alpha",
        "8",
        "--lora-targets",
        "q_proj,v_proj,down_proj",
    ];
    args.extend(lora.map(String::from));
    args.extend([
        "--save-adapter".to_string(),
        out.to_str().unwrap().to_string(),
    ]);
    args
}

#[test]
fn two_ranks_with_two_micro_batches_equal_one_process_with_the_global_batch() {
    let dir = tempfile::tempdir().unwrap();
    let dist = dir.path().join("dist");
    let mut args = small_model_args(&dist, 4, 6);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let d = lora_job().ranks(2).args(&args).run();
    assert!(d.status.success(), "{}", text(&d));
    assert_eq!(summary_value::<f64>(&d, "steps"), 6.0, "{}", text(&d));
    assert_eq!(
        summary_value::<f64>(&d, "micro_steps"),
        12.0,
        "{}",
        text(&d)
    );

    // One process, one micro-batch holding the same 2 x 2 x 4 rows per step.
    let single = dir.path().join("single");
    let s = run_lora(&small_model_args(&single, 16, 6));
    assert!(s.status.success(), "{}", text(&s));
    let weights = |d: &Path| load_flat(&d.join(lora::ADAPTER_WEIGHTS));
    let (a, b) = (weights(&dist), weights(&single));
    assert_eq!(a.len(), 6);
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

    // The comparison could have failed: training moved lora_B (zero at the start) far more
    // than the tolerance.
    let moved = b
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .flat_map(|(_, v)| v.iter().map(|x| x.abs()))
        .fold(0.0, f32::max);
    assert!(moved > 0.01, "{moved}");
}

/// The fixture's model with every adapted projection merged: `W + (alpha / r) · B A` from the
/// adapter file, computed with plain candle products.
fn merged_model(adapter: &HashMap<String, Tensor>, config: &LoraConfig) -> llama::Llama {
    let llama_config = LlamaConfig::from_file(&fixture("config.json")).unwrap();
    let (varmap, model) = llama::build_in(llama_config, 0, &Device::Cpu, DType::F32).unwrap();
    let params: Vec<(String, Var)> = named(&varmap).into_iter().collect();
    accelerate_core::load_into_vars(fixture("model.safetensors"), &params).unwrap();
    let scale = config.alpha / config.r as f64;
    for (name, var) in &params {
        let Some(module) = name.strip_suffix(".weight") else {
            continue;
        };
        let key = |m: &str| format!("base_model.model.{module}.{m}.weight");
        if let (Some(a), Some(b)) = (adapter.get(&key("lora_A")), adapter.get(&key("lora_B"))) {
            let delta = (b.matmul(a).unwrap() * scale).unwrap();
            var.set(&(var.as_tensor() + delta).unwrap()).unwrap();
        }
    }
    model
}

#[test]
fn a_saved_adapter_has_peft_names_and_loads_back_as_the_merged_model() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("adapter");
    let mut args = fixture_args();
    args.extend(
        [
            "--batch-size",
            "2",
            "--max-steps",
            "4",
            "--lr",
            "0.02",
            "--lora-r",
            "4",
            "--lora-alpha",
            "12",
            "--lora-targets",
            "v_proj,q_proj,gate_proj",
            "--base-model-name",
            "org/tiny-llama",
            "--save-adapter",
            saved.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let o = run_lora(&args);
    assert!(o.status.success(), "{}", text(&o));

    // PEFT's names, no adapter name, lora_A [r, in] and lora_B [out, r].
    let adapter =
        candle_core::safetensors::load(saved.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    let mut expected = BTreeMap::new();
    for layer in 0..2 {
        let p = format!("base_model.model.model.layers.{layer}");
        // hidden 32, 4 heads and 2 key/value heads of 8, intermediate 32.
        for (module, out) in [
            ("self_attn.q_proj", 32),
            ("self_attn.v_proj", 16),
            ("mlp.gate_proj", 32),
        ] {
            expected.insert(format!("{p}.{module}.lora_A.weight"), vec![4, 32]);
            expected.insert(format!("{p}.{module}.lora_B.weight"), vec![out, 4]);
        }
    }
    let got: BTreeMap<String, Vec<usize>> = adapter
        .iter()
        .map(|(n, t)| (n.clone(), t.dims().to_vec()))
        .collect();
    assert_eq!(got, expected);
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(saved.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(json["peft_type"], "LORA");
    assert_eq!(json["task_type"], "CAUSAL_LM");
    assert_eq!(json["r"], 4);
    assert_eq!(json["lora_alpha"], 12);
    assert_eq!(json["lora_dropout"], 0.0);
    assert_eq!(json["bias"], "none");
    assert_eq!(json["fan_in_fan_out"], false);
    assert_eq!(json["inference_mode"], true);
    assert_eq!(json["base_model_name_or_path"], "org/tiny-llama");
    let targets: BTreeSet<&str> = json["target_modules"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(targets, BTreeSet::from(["q_proj", "v_proj", "gate_proj"]));

    // Loaded back into the library's model, it computes the merged model's logits.
    let config = lora::read_adapter_config(&saved).unwrap();
    let tokens = candle_core::safetensors::load(fixture("tokens.safetensors"), &Device::Cpu)
        .unwrap()["input_ids"]
        .to_dtype(DType::U32)
        .unwrap();
    let llama_config = LlamaConfig::from_file(&fixture("config.json")).unwrap();
    let (varmap, base) = llama::build_in(llama_config, 9, &Device::Cpu, DType::F32).unwrap();
    let base_params: Vec<(String, Var)> = named(&varmap).into_iter().collect();
    accelerate_core::load_into_vars(fixture("model.safetensors"), &base_params).unwrap();
    let base_logits = base.forward(&tokens).unwrap();
    let model = lora::with_adapters(&base, &config, &varmap, 9).unwrap();
    let adapters: Vec<(String, Var)> = named(&varmap)
        .into_iter()
        .filter(|(n, _)| lora::is_adapter_parameter(n))
        .collect();
    lora::load_adapter(&saved, &adapters).unwrap();
    let logits = model.forward(&tokens).unwrap();
    let merged = merged_model(&adapter, &config);
    let merged_logits = merged.forward(&tokens).unwrap();
    let d = relative_diff(&logits, &merged_logits);
    assert!(d < 1e-5, "LoRA vs merged logits: relative difference {d}");
    // The comparison could have failed: the adapter moved the logits far more than that.
    let moved = relative_diff(&base_logits, &merged_logits);
    assert!(moved > 1e-3, "{moved}");

    // The example loads it too: its first step's loss over all 4 rows is the merged model's.
    let (b, t) = tokens.dims2().unwrap();
    let merged_loss = llama::causal_lm_loss_sum(&merged_logits, &tokens)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap() as f64
        / (b * (t - 1)) as f64;
    let again = dir.path().join("again");
    let mut args = fixture_args();
    args.extend(
        [
            "--batch-size",
            "4",
            "--max-steps",
            "1",
            "--load-adapter",
            saved.to_str().unwrap(),
            "--save-adapter",
            again.to_str().unwrap(),
        ]
        .map(String::from),
    );
    let o = run_lora(&args);
    assert!(o.status.success(), "{}", text(&o));
    let loss = summary_value::<f64>(&o, "final_loss");
    assert!(
        (loss - merged_loss).abs() < 1e-4,
        "{loss} vs the merged model's {merged_loss}"
    );
    // Its settings came from the adapter's config.
    let json2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(again.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        (json2["r"].clone(), json2["lora_alpha"].clone()),
        (4.into(), 12.into())
    );
}

/// Runs the example with `args`, expects failure, and returns its stderr.
fn refused(args: &[&str]) -> String {
    let o = run_lora(args);
    assert!(!o.status.success(), "accepted {args:?}:\n{}", text(&o));
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bad_adapter_flags_are_refused_with_the_problem_named() {
    let e = refused(&["--lora-targets", "q_proj,qkv_proj", "--max-steps", "1"]);
    assert!(
        e.contains("--lora-targets")
            && e.contains("\"qkv_proj\"")
            && e.contains("q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"),
        "{e}"
    );
    let e = refused(&["--lora-r", "0"]);
    assert!(e.contains("--lora-r must be at least 1"), "{e}");
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nowhere");
    let e = refused(&["--load-adapter", missing.to_str().unwrap()]);
    assert!(
        e.contains("--load-adapter") && e.contains("adapter_config.json"),
        "{e}"
    );

    // An adapter, then flags that contradict it.
    let saved = dir.path().join("adapter");
    let o = run_lora(&[
        "--layers",
        "1",
        "--width",
        "16",
        "--max-steps",
        "0",
        "--save-adapter",
        saved.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let e = refused(&[
        "--layers",
        "1",
        "--width",
        "16",
        "--load-adapter",
        saved.to_str().unwrap(),
        "--lora-r",
        "16",
    ]);
    assert!(e.contains("--lora-r differs") && e.contains("r 8"), "{e}");
    // An adapter of another model's size.
    let e = refused(&[
        "--layers",
        "2",
        "--width",
        "16",
        "--load-adapter",
        saved.to_str().unwrap(),
    ]);
    assert!(e.contains("--load-adapter") && e.contains("missing"), "{e}");
}

/// Saves a fresh adapter of a 1-layer model (hidden 16) into `dir` and returns its config.
fn saved_small_adapter(dir: &Path) -> serde_json::Value {
    let o = run_lora(&[
        "--layers",
        "1",
        "--width",
        "16",
        "--max-steps",
        "0",
        "--save-adapter",
        dir.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
        .unwrap()
}

#[test]
fn a_peft_adapter_with_dropout_and_module_paths_loads_and_keeps_its_dropout() {
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("adapter");
    let mut json = saved_small_adapter(&saved);
    // As PEFT writes a LoRA with lora_dropout=0.05 and target_modules="all-linear" (paths).
    json["lora_dropout"] = serde_json::json!(0.05);
    json["target_modules"] = serde_json::json!([
        "model.layers.0.self_attn.v_proj",
        "model.layers.0.self_attn.q_proj"
    ]);
    std::fs::write(
        saved.join("adapter_config.json"),
        serde_json::to_vec(&json).unwrap(),
    )
    .unwrap();
    let again = dir.path().join("again");
    let o = run_lora(&[
        "--layers",
        "1",
        "--width",
        "16",
        "--max-steps",
        "1",
        "--load-adapter",
        saved.to_str().unwrap(),
        "--save-adapter",
        again.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("lora_dropout 0.05; dropout is not applied while training here"),
        "{}",
        text(&o)
    );
    let json2: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(again.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(json2["lora_dropout"], 0.05);
    assert_eq!(
        json2["target_modules"],
        serde_json::json!(["q_proj", "v_proj"])
    );

    // Those paths cover layer 0 only: a 2-layer model is refused, naming the missing layer.
    let e = refused(&[
        "--layers",
        "2",
        "--width",
        "16",
        "--load-adapter",
        saved.to_str().unwrap(),
    ]);
    assert!(
        e.contains("--load-adapter") && e.contains("q_proj in layers {0} only: missing [1]"),
        "{e}"
    );
}

#[test]
fn an_unwritable_save_adapter_directory_fails_before_training() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"").unwrap();
    let o = run_lora(&[
        "--layers",
        "1",
        "--width",
        "16",
        "--max-steps",
        "2",
        "--save-adapter",
        file.join("adapter").to_str().unwrap(),
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("--save-adapter"), "{}", text(&o));
    assert!(
        !text(&o).contains("final_loss="),
        "trained first:\n{}",
        text(&o)
    );
}

#[test]
fn a_resume_with_other_lora_settings_or_another_base_is_refused_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("ckpt");
    let args = |steps: u64, extra: &[&str]| {
        let mut a = small_llama_args(4, steps);
        a.extend(
            [
                "--checkpoint-every",
                "1",
                "--checkpoint-dir",
                ckpt.to_str().unwrap(),
            ]
            .map(String::from),
        );
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let o = run_lora(&args(2, &[]));
    assert!(o.status.success(), "{}", text(&o));

    let o = run_lora(&args(3, &["--resume", "--lora-alpha", "64"]));
    assert!(!o.status.success(), "{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        e.contains("--resume") && e.contains("--lora-alpha 64 (the checkpoint's 16)"),
        "{e}"
    );
    // Another --seed draws another base.
    let mut reseeded = args(3, &["--resume"]);
    let seed = reseeded.iter().position(|a| a == "--seed").unwrap();
    reseeded[seed + 1] = "6".to_string();
    let o = run_lora(&reseeded);
    assert!(!o.status.success(), "{}", text(&o));
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("the base model's weights"), "{e}");

    // The same settings and base resume.
    let o = run_lora(&args(3, &["--resume"]));
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(summary_value::<f64>(&o, "steps"), 3.0, "{}", text(&o));
}

#[test]
fn output_dir_holds_the_peft_adapter_and_the_model_directorys_tokenizer_files() {
    let tmp = tempfile::tempdir().unwrap();
    let fixture_dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/llama-dir");
    // The sharded fixture model with tokenizer files, to see them carried along byte for byte.
    let model = tmp.path().join("model");
    std::fs::create_dir(&model).unwrap();
    for entry in std::fs::read_dir(&fixture_dir).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), model.join(entry.file_name())).unwrap();
    }
    std::fs::write(
        model.join("tokenizer.json"),
        b"{\"model\": \"a tokenizer\"}",
    )
    .unwrap();
    std::fs::write(
        model.join("special_tokens_map.json"),
        b"{\"eos_token\": \"</s>\"}",
    )
    .unwrap();
    let out = tmp.path().join("out");
    let saved = tmp.path().join("saved");
    let metrics = tmp.path().join("metrics.jsonl");
    let o = run_lora(&[
        "--model",
        model.to_str().unwrap(),
        "--data",
        fixture_dir.join("tokens.safetensors").to_str().unwrap(),
        "--no-shuffle",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
        "--lr",
        "0.02",
        "--lora-r",
        "4",
        "--output-dir",
        out.to_str().unwrap(),
        "--save-adapter",
        saved.to_str().unwrap(),
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    // Fresh adapters change nothing: the first loss is transformers' on --model's weights.
    let reference =
        candle_core::safetensors::load(fixture_dir.join("reference.safetensors"), &Device::Cpu)
            .unwrap();
    let theirs = reference["loss"].to_scalar::<f32>().unwrap() as f64;
    let first = accelerate_tests::metric_losses(&metrics)[0];
    assert!((first - theirs).abs() < 1e-4, "{first} vs {theirs}");

    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "adapter_config.json",
            "adapter_model.safetensors",
            "chat_template.jinja",
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json"
        ]
    );
    let weights = |d: &Path| load_flat(&d.join(lora::ADAPTER_WEIGHTS));
    assert_eq!(max_abs_diff_flat(&weights(&out), &weights(&saved)), 0.0);
    let moved = weights(&out)
        .iter()
        .filter(|(n, _)| n.contains("lora_B"))
        .flat_map(|(_, v)| v.iter().map(|x| x.abs()))
        .fold(0.0, f32::max);
    assert!(moved > 0.0, "the adapters trained");
    for f in ["tokenizer.json", "special_tokens_map.json"] {
        assert_eq!(
            std::fs::read(out.join(f)).unwrap(),
            std::fs::read(model.join(f)).unwrap(),
            "{f}"
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        json["base_model_name_or_path"],
        std::fs::canonicalize(&model).unwrap().display().to_string()
    );
    assert_eq!(json["r"], 4);
}
