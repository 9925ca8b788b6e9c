//! The examples' evaluation on their held-out split and their trackers: the eval loss and accuracy
//! that `mlp` and `gpt` print on 2 and 3 ranks (a split whose size leaves the last round short, so
//! `gather_for_metrics` must drop the repeated samples) equal a single-process evaluation computed
//! here from the saved weights; `--report-to` writes `train/*` and `eval/*` at the steps that
//! `--logging-steps` and `--eval-steps` give, from rank 0 only; bad flags are refused by name.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use accelerate_core::data::Dataset;
use accelerate_examples::gpt::{self, CharVocab, GptConfig, TextWindows};
use accelerate_examples::{mlp, run};
use accelerate_tests::{load_flat, named_vars, Job, JobOutput};
use candle_core::{DType, Device};

const LIMIT: Duration = Duration::from_secs(240);

/// The value of `key=` in the last line of stdout that holds `prefix` (after the launcher's
/// `[rank 0] `).
fn field(o: &JobOutput, prefix: &str, key: &str) -> f64 {
    let out = o.stdout_text();
    let line = out
        .lines()
        .rfind(|l| l.contains(prefix))
        .unwrap_or_else(|| panic!("no line starting with {prefix:?}:\n{}", o.text()));
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{key}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

/// Mean cross-entropy per sample and the number classified right, of the `mlp` with the weights
/// at `weights` on the samples `indices` of its synthetic data: plain f64 arithmetic over every
/// sample at once, no loader and no collective.
pub(crate) fn mlp_reference(
    weights: &Path,
    samples: usize,
    seed: u64,
    indices: &[usize],
) -> (f64, usize) {
    let w = load_flat(weights);
    let (x, y) = mlp::synthetic_data(samples, seed).unwrap();
    let x = x.to_vec2::<f32>().unwrap();
    let y = y.to_vec1::<u32>().unwrap();
    let layer = |name: &str, input: &[f64], relu: bool| -> Vec<f64> {
        let (wt, b) = (&w[&format!("{name}.weight")], &w[&format!("{name}.bias")]);
        let fan_in = input.len();
        (0..b.len())
            .map(|o| {
                let z = b[o] as f64
                    + (0..fan_in)
                        .map(|i| wt[o * fan_in + i] as f64 * input[i])
                        .sum::<f64>();
                if relu {
                    z.max(0.0)
                } else {
                    z
                }
            })
            .collect()
    };
    let (mut loss, mut correct) = (0.0, 0);
    for &i in indices {
        let input: Vec<f64> = x[i].iter().map(|&v| v as f64).collect();
        let logits = layer("l3", &layer("l2", &layer("l1", &input, true), true), false);
        let max = logits.iter().cloned().fold(f64::MIN, f64::max);
        let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f64>().ln();
        loss += lse - logits[y[i] as usize];
        let predicted = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap();
        correct += usize::from(predicted == y[i] as usize);
    }
    (loss / indices.len() as f64, correct)
}

/// `mlp` on `ranks` processes, 410 samples of which 41 are held out, batch 8: a round of 2 ranks
/// holds 16 samples and one of 3 ranks 24, so the split's last round is short either way.
fn mlp_eval_matches_one_process(ranks: usize) {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("m.safetensors");
    let (samples, seed) = (410, 4);
    let o = Job::mlp(ranks)
        .args([
            "--hidden",
            "16",
            "--samples",
            "410",
            "--batch-size",
            "8",
            "--seed",
            "4",
            "--lr",
            "0.01",
            "--max-steps",
            "12",
            "--eval-steps",
            "6",
            "--save-model",
            weights.to_str().unwrap(),
        ])
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", o.text());
    let (_, eval) = run::split_indices(samples, 0.1, seed, "samples").unwrap();
    assert_eq!(eval.len(), 41);
    assert!(!41usize.is_multiple_of(8 * ranks));
    let (loss, correct) = mlp_reference(&weights, samples, seed, &eval);
    // Each held-out sample counted once, whatever the ranks repeated to fill the last round.
    assert_eq!(field(&o, "eval step=12 ", "samples"), 41.0, "{}", o.text());
    let printed = field(&o, "eval step=12 ", "loss");
    assert!(
        (printed - loss).abs() < 2e-5,
        "{ranks} ranks: eval loss {printed} vs one process {loss}\n{}",
        o.text()
    );
    let accuracy = field(&o, "eval step=12 ", "accuracy");
    assert!(
        (accuracy - correct as f64 / 41.0).abs() < 1e-6,
        "{ranks} ranks: accuracy {accuracy} vs {correct}/41"
    );
    // The end of the run evaluated at step 12 already: the summary repeats that result.
    assert_eq!(o.summary::<f64>("eval_loss"), printed);
    assert_eq!(o.summary::<f64>("eval_accuracy"), accuracy);
}

#[test]
fn mlp_eval_on_two_ranks_is_a_single_process_evaluation_of_the_split() {
    mlp_eval_matches_one_process(2);
}

#[test]
fn mlp_eval_on_three_ranks_is_a_single_process_evaluation_of_the_split() {
    mlp_eval_matches_one_process(3);
}

/// The token-weighted loss of the `gpt` with the weights at `weights` over the windows `indices`:
/// the model's summed token loss (the training loss, a fused kernel) batch by batch, added in
/// f64 and divided by all their tokens; one process, no loader.
fn gpt_reference(
    weights: &Path,
    config: GptConfig,
    windows: &TextWindows,
    indices: &[usize],
) -> f64 {
    let (varmap, model) = gpt::build_in(config, 0, &Device::Cpu, DType::F32).unwrap();
    accelerate_core::load_into_vars(weights, &named_vars(&varmap)).unwrap();
    let (mut sum, mut tokens) = (0.0, 0usize);
    for chunk in indices.chunks(64) {
        let batch = windows.get_batch(chunk).unwrap();
        let logits = model.forward(&batch.inputs).unwrap();
        let loss = gpt::summed_token_loss(&logits, &batch.targets, &batch.mask).unwrap();
        sum += loss
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        tokens += batch.tokens;
    }
    sum / tokens as f64
}

#[test]
fn gpt_eval_on_two_ranks_is_the_token_weighted_loss_of_the_split() {
    let dir = tempfile::tempdir().unwrap();
    let weights = dir.path().join("g.safetensors");
    let (context, seed) = (16, 3);
    let o = Job::example("gpt")
        .ranks(2)
        .args([
            "--context",
            "16",
            "--batch-size",
            "8",
            "--seed",
            "3",
            "--max-steps",
            "8",
            "--eval-steps",
            "4",
            "--save-model",
            weights.to_str().unwrap(),
        ])
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", o.text());
    let text = gpt::DEFAULT_TEXT;
    let vocab = CharVocab::from_text(text);
    let windows = TextWindows::tiled(vocab.encode(text).unwrap(), context, seed).unwrap();
    let (_, eval) = run::split_indices(windows.len(), 0.1, seed, "windows").unwrap();
    assert!(!eval.len().is_multiple_of(16), "{} windows", eval.len());
    let config = GptConfig {
        vocab: vocab.len(),
        context,
        width: 64,
        heads: 4,
        layers: 2,
    };
    let loss = gpt_reference(&weights, config, &windows, &eval);
    let tokens: usize = eval.iter().map(|&i| windows.window(i).1).sum();
    assert_eq!(field(&o, "eval step=8 ", "windows"), eval.len() as f64);
    assert_eq!(field(&o, "eval step=8 ", "tokens"), tokens as f64);
    let printed = o.summary::<f64>("eval_loss");
    assert!(
        (printed - loss).abs() < 2e-5,
        "eval loss {printed} vs one process {loss}\n{}",
        o.text()
    );
}

/// The rows of a `metrics.jsonl`: step and the names logged with it, in order.
fn jsonl_rows(path: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let mut m: BTreeMap<String, f64> = BTreeMap::new();
            for (k, x) in v.as_object().unwrap() {
                if k != "step" {
                    m.insert(k.clone(), x.as_f64().unwrap());
                }
            }
            (v["step"].as_u64().unwrap(), m)
        })
        .collect()
}

#[test]
fn report_to_writes_train_and_eval_metrics_at_their_steps_from_rank_0_only() {
    let tmp = tempfile::tempdir().unwrap();
    let logs = tmp.path().join("logs");
    let o = Job::mlp(2)
        .args([
            "--hidden",
            "16",
            "--samples",
            "400",
            "--batch-size",
            "8",
            "--max-steps",
            "7",
            "--logging-steps",
            "2",
            "--eval-steps",
            "3",
            "--max-grad-norm",
            "1.0",
            "--report-to",
            "tensorboard,csv,jsonl",
            "--logging-dir",
            logs.to_str().unwrap(),
        ])
        .limit(LIMIT)
        .run();
    assert!(o.status.success(), "{}", o.text());
    let mut names: Vec<String> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    // One event file (rank 1 writing would add its own), the two tables and the curves.
    assert_eq!(names.len(), 4, "{names:?}");
    assert!(names[0].starts_with("events.out.tfevents."), "{names:?}");
    assert!(std::fs::metadata(logs.join(&names[0])).unwrap().len() > 0);
    assert_eq!(
        names[1..],
        ["metrics.csv", "metrics.jsonl", "training_curves.png"]
    );

    // Train metrics every 2 steps and at the last (7); eval every 3 and at the end.
    let rows = jsonl_rows(&logs.join("metrics.jsonl"));
    let steps_with = |name: &str| -> Vec<u64> {
        rows.iter()
            .filter(|(_, m)| m.contains_key(name))
            .map(|(s, _)| *s)
            .collect()
    };
    assert_eq!(steps_with("train/loss"), [2, 4, 6, 7], "{rows:?}");
    assert_eq!(steps_with("train/learning_rate"), [2, 4, 6, 7]);
    assert_eq!(steps_with("train/grad_norm"), [2, 4, 6, 7]);
    assert_eq!(steps_with("eval/loss"), [3, 6, 7], "{rows:?}");
    assert_eq!(steps_with("eval/accuracy"), [3, 6, 7]);
    for (step, m) in &rows {
        if let Some(lr) = m.get("train/learning_rate") {
            assert_eq!(*lr, 1e-3, "step {step}");
        }
    }
    // The logged eval loss is the printed one.
    let printed = field(&o, "eval step=6 ", "loss");
    let logged = rows
        .iter()
        .find(|(s, m)| *s == 6 && m.contains_key("eval/loss"))
        .unwrap()
        .1["eval/loss"];
    assert!((logged - printed).abs() < 5e-7, "{logged} vs {printed}");

    let csv = std::fs::read_to_string(logs.join("metrics.csv")).unwrap();
    let mut lines = csv.lines();
    assert_eq!(
        lines.next().unwrap(),
        "step,train/loss,train/learning_rate,train/grad_norm,eval/loss,eval/accuracy"
    );
    let csv_steps: Vec<u64> = lines
        .map(|l| l.split(',').next().unwrap().parse().unwrap())
        .collect();
    assert_eq!(csv_steps, rows.iter().map(|(s, _)| *s).collect::<Vec<_>>());
}

/// A run of `example` with `flags` that must fail with `message` on stderr.
fn refused(example: &str, flags: &[&str], message: &str) {
    let o = Job::example(example).args(flags).limit(LIMIT).run();
    assert!(!o.status.success(), "{flags:?} ran:\n{}", o.text());
    assert!(o.text().contains(message), "{flags:?}:\n{}", o.text());
}

#[test]
fn bad_evaluation_and_logging_flags_are_refused_by_name() {
    refused(
        "mlp",
        &["--eval-steps", "0"],
        "--eval-steps must be at least 1",
    );
    refused(
        "gpt",
        &["--logging-steps", "0"],
        "--logging-steps must be at least 1",
    );
    refused(
        "llama",
        &["--report-to", "wandb"],
        "unknown tracker \"wandb\" in report_to; expected tensorboard, csv, jsonl, all or none",
    );
    refused(
        "mlp",
        &["--eval-fraction", "1.5"],
        "--eval-fraction must be in [0, 1)",
    );
    refused(
        "mlp",
        &["--eval-steps", "2", "--eval-fraction", "0"],
        "--eval-steps needs an evaluation split",
    );
    refused(
        "mlp",
        &["--samples", "4", "--eval-steps", "2"],
        "--eval-fraction 0.1 of 4 samples holds out none",
    );
    refused(
        "mlp",
        &["--logging-dir", "unused-logs"],
        "no tracker is chosen",
    );
}
