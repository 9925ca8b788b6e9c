//! Fine-tuning from a Hugging Face model directory on a text corpus (`llama --model DIR
//! --train-file ...`): on 2 ranks with accumulation it ends where one process with the global
//! batch ends; its --output-dir loads back as a model directory, tokenizer included; a token file
//! from `accelerate-tokenize` trains exactly as the corpus it was made from; bad combinations are
//! refused by name. The model (tests/fixtures/llama-dir, sharded) and the tokenizer
//! (tests/fixtures/text/tokenizer, a BPE whose ids transformers checked) are fixtures written by
//! Python; nothing here runs Python.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use accelerate_tests::{load_flat, max_abs_diff_flat, output_text as text, summary_value, Job};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn model_dir() -> PathBuf {
    repo("fixtures/llama-dir")
}

fn corpus() -> [PathBuf; 2] {
    [
        repo("fixtures/text/corpus.jsonl"),
        repo("fixtures/text/chat.jsonl"),
    ]
}

fn llama() -> Job {
    Job::example("llama")
        .env("RAYON_NUM_THREADS", "1")
        .limit(Duration::from_secs(240))
}

/// The flags of a fine-tune of the fixture model on `train` for 4 steps of 8 rows of 32 tokens.
fn fine_tune(train: &[PathBuf], batch: usize, out: &Path) -> Vec<String> {
    let mut args: Vec<String> = ["--model", model_dir().to_str().unwrap(), "--train-file"]
        .map(String::from)
        .into();
    args.extend(train.iter().map(|p| p.to_str().unwrap().to_string()));
    args.extend(
        [
            "--block-size",
            "32",
            "--batch-size",
            &batch.to_string(),
            "--max-steps",
            "4",
            "--lr",
            "0.01",
            "--output-dir",
            out.to_str().unwrap(),
        ]
        .map(String::from),
    );
    args
}

/// `args` with `flag`'s value replaced.
fn with(mut args: Vec<String>, flag: &str, value: &str) -> Vec<String> {
    let at = args
        .iter()
        .position(|a| a == flag)
        .expect("the flag is set")
        + 1;
    args[at] = value.to_string();
    args
}

/// The weights of a model directory, whether one file or shards.
fn weights(dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let mut all = BTreeMap::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_str().unwrap();
        // Weights only: model.safetensors or model-0000i-of-0000n.safetensors (the fixture
        // directory also holds transformers' reference tensors).
        if name.starts_with("model") && name.ends_with(".safetensors") {
            all.extend(load_flat(&path));
        }
    }
    assert!(!all.is_empty(), "no weights in {}", dir.display());
    all
}

#[test]
fn two_ranks_fine_tuning_from_a_model_dir_on_jsonl_equal_one_process_and_the_output_loads_back() {
    let dir = tempfile::tempdir().unwrap();
    let (dist, single) = (dir.path().join("dist"), dir.path().join("single"));
    let mut args = fine_tune(&corpus(), 2, &dist);
    args.extend(["--grad-accum".to_string(), "2".to_string()]);
    let d = llama().ranks(2).args(&args).run();
    assert!(d.status.success(), "{}", text(&d));
    assert_eq!(summary_value::<f64>(&d, "micro_steps"), 8.0, "{}", text(&d));
    // One process, one micro-batch holding the same 2 ranks x 2 micro-steps x 2 rows.
    let s = llama().args(fine_tune(&corpus(), 8, &single)).run();
    assert!(s.status.success(), "{}", text(&s));

    let (a, b) = (weights(&dist), weights(&single));
    assert!(a.contains_key("model.layers.0.self_attn.q_proj.weight"));
    let diff = max_abs_diff_flat(&a, &b);
    assert!(
        diff < 1e-5,
        "max |Δθ| between 2 ranks x K=2 and 1 process = {diff}"
    );
    let (ld, ls) = (
        summary_value::<f64>(&d, "final_loss"),
        summary_value::<f64>(&s, "final_loss"),
    );
    assert!((ld - ls).abs() < 1e-5, "final loss {ld} vs {ls}");
    // The comparison could fail: 4 steps moved the weights far beyond the tolerance.
    assert!(max_abs_diff_flat(&weights(&model_dir()), &b) > 1e-3);

    // The tokenizer trained with travels with the model, byte for byte: --tokenizer's when given.
    let other = dir.path().join("other-tokenizer");
    let legacy = repo("fixtures/text/tokenizer_legacy");
    let o = llama()
        .args(with(fine_tune(&corpus(), 8, &other), "--max-steps", "1"))
        .args(["--tokenizer", legacy.to_str().unwrap()])
        .run();
    assert!(o.status.success(), "{}", text(&o));
    assert_eq!(
        std::fs::read(other.join("tokenizer_config.json")).unwrap(),
        std::fs::read(legacy.join("tokenizer_config.json")).unwrap()
    );
    // The fixture model's tokenizer travels with the model, byte for byte.
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ] {
        assert_eq!(
            std::fs::read(single.join(file)).unwrap(),
            std::fs::read(repo("fixtures/text/tokenizer").join(file)).unwrap(),
            "{file}"
        );
    }
    // The output is a model directory: zero steps from it (its own tokenizer, no --tokenizer)
    // write back exactly its weights.
    let again = dir.path().join("again");
    let args = fine_tune(&corpus(), 8, &again);
    let args = with(
        with(args, "--model", single.to_str().unwrap()),
        "--max-steps",
        "0",
    );
    let r = llama().args(&args).run();
    assert!(r.status.success(), "{}", text(&r));
    assert_eq!(max_abs_diff_flat(&weights(&again), &b), 0.0);
}

#[test]
fn a_token_file_trains_exactly_as_its_corpus_and_another_tokenizers_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("corpus.tokens");
    let tokenize = Job::new(accelerate_tests::built_binary("accelerate-tokenize"))
        .args(["--tokenizer", model_dir().to_str().unwrap(), "--output"])
        .arg(&tokens)
        .args(corpus())
        .run();
    assert!(tokenize.status.success(), "{}", text(&tokenize));

    let (from_file, from_corpus) = (dir.path().join("file"), dir.path().join("corpus"));
    let f = llama()
        .args(fine_tune(std::slice::from_ref(&tokens), 8, &from_file))
        .run();
    assert!(f.status.success(), "{}", text(&f));
    let c = llama().args(fine_tune(&corpus(), 8, &from_corpus)).run();
    assert!(c.status.success(), "{}", text(&c));
    assert_eq!(
        max_abs_diff_flat(&weights(&from_file), &weights(&from_corpus)),
        0.0
    );

    // The legacy-layout tokenizer has other files, hence another fingerprint.
    let mut args = fine_tune(&[tokens], 8, &dir.path().join("other"));
    args.extend(
        [
            "--tokenizer",
            repo("fixtures/text/tokenizer_legacy").to_str().unwrap(),
        ]
        .map(String::from),
    );
    let o = llama().args(&args).run();
    assert!(
        !o.status.success(),
        "accepted another tokenizer's token file"
    );
    assert!(
        text(&o).contains("re-run the tokenize command"),
        "{}",
        text(&o)
    );
}

#[test]
fn a_validation_split_and_a_parquet_corpus_train_and_evaluate() {
    let dir = tempfile::tempdir().unwrap();
    let parquet = repo("fixtures/corpus/rows.parquet");
    let mut args = fine_tune(&corpus(), 4, &dir.path().join("out"));
    args.extend(["--validation-split-percentage", "10", "--eval-steps", "2"].map(String::from));
    let o = llama().args(&args).run();
    assert!(o.status.success(), "{}", text(&o));
    let eval_loss: f64 = summary_value(&o, "eval_loss");
    assert!(eval_loss.is_finite() && eval_loss > 0.0, "{}", text(&o));
    assert!(text(&o).contains("evaluation: 4 documents"), "{}", text(&o));

    let args = fine_tune(&[parquet], 2, &dir.path().join("pq"));
    let args = with(with(args, "--block-size", "8"), "--max-steps", "1");
    let p = llama().args(&args).run();
    assert!(p.status.success(), "{}", text(&p));
}

#[test]
fn text_flags_without_what_they_need_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = repo("fixtures/text/corpus.jsonl");
    let corpus = corpus.to_str().unwrap();
    let small_config = repo("fixtures/llama/config.json");
    let tokenizer = repo("fixtures/text/tokenizer");
    let model = model_dir();
    let model = model.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--train-file", corpus], "--tokenizer"),
        (vec!["--block-size", "16"], "needs --train-file"),
        (
            vec![
                "--model",
                model,
                "--train-file",
                corpus,
                "--block-size",
                "4096",
            ],
            "max_position_embeddings",
        ),
        (
            vec![
                "--config",
                small_config.to_str().unwrap(),
                "--tokenizer",
                tokenizer.to_str().unwrap(),
                "--train-file",
                corpus,
            ],
            "vocab_size",
        ),
        (
            vec![
                "--model",
                model,
                "--train-file",
                corpus,
                "--validation-split-percentage",
                "100",
            ],
            "between 1 and 99",
        ),
    ];
    for (args, says) in cases {
        let o = llama()
            .args(&args)
            .args(["--output-dir", dir.path().join("never").to_str().unwrap()])
            .run();
        assert!(!o.status.success(), "accepted {args:?}");
        assert!(text(&o).contains(says), "{args:?}: {}", text(&o));
        assert!(!dir.path().join("never").exists());
    }
}

#[test]
fn the_trainer_takes_the_same_packed_rows_and_two_ranks_equal_one_process() {
    let dir = tempfile::tempdir().unwrap();
    let run = |ranks: usize, batch: &str, accumulate: &str, out: &str| {
        let mut job = Job::example("text_trainer")
            .env("RAYON_NUM_THREADS", "1")
            .limit(Duration::from_secs(240))
            .args(["--model", model_dir().to_str().unwrap(), "--train-file"])
            .args(corpus())
            .args([
                "--block-size",
                "32",
                "--max-steps",
                "4",
                "--learning-rate",
                "0.01",
            ])
            .args(["--per-device-train-batch-size", batch])
            .args([
                "--gradient-accumulation-steps",
                accumulate,
                "--disable-tqdm",
            ])
            .args(["--output-dir", dir.path().join(out).to_str().unwrap()]);
        if ranks > 1 {
            job = job.ranks(ranks);
        }
        let o = job.run();
        assert!(o.status.success(), "{}", text(&o));
        (
            summary_value::<f64>(&o, "train_loss"),
            summary_value::<f64>(&o, "steps"),
        )
    };
    let (single, steps) = run(1, "8", "1", "single");
    let (dist, _) = run(2, "2", "2", "dist");
    assert_eq!(steps, 4.0);
    assert!(
        (single - dist).abs() < 1e-5,
        "train_loss {single} (1 process) vs {dist} (2 ranks x K=2)"
    );
    // Both wrote the trained model as a model directory, tokenizer included: the same weights,
    // moved from the fixture's. The sums of 2 ranks x 2 micro-batches are added in another order
    // than one batch's, and AdamW's normalized update (the Trainer's default, with clipping at
    // 1.0) turns those last-bit differences of near-zero gradients into ~1e-5 of the weights;
    // 4 steps of lr 0.01 move them by up to 4e-2.
    let (a, b) = (
        weights(&dir.path().join("dist")),
        weights(&dir.path().join("single")),
    );
    assert!(
        max_abs_diff_flat(&a, &b) < 1e-4,
        "{}",
        max_abs_diff_flat(&a, &b)
    );
    assert!(max_abs_diff_flat(&weights(&model_dir()), &b) > 1e-3);
    for file in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        assert!(dir.path().join("single").join(file).exists(), "{file}");
    }
    // The loss is the packed rows' causal-LM loss of a model that starts from the fixture's
    // weights: near ln(256) = 5.55 for its random init, far from 0.
    assert!(single > 3.0 && single < 9.0, "{single}");
}
