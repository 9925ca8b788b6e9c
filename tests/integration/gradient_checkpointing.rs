//! Activation checkpointing in the `gpt` and `llama` models (`--gradient-checkpointing`), against
//! the same models without it: the loss and every parameter's gradient are bitwise equal, dropout
//! draws the same masks in the recomputation as in the forward pass (the generator ends where it
//! ends without checkpointing), two AdamW steps through the `Accelerator` leave bitwise equal
//! parameters, and the `gpt` example on two ranks ends at the same loss and weights.

use std::time::Duration;

use accelerate_core::optim::{AdamW, AdamWConfig};
use accelerate_core::{Accelerator, ProcessState, RankRng};
use accelerate_examples::gpt::{self, Dropout, GptConfig};
use accelerate_examples::llama::{self, LlamaConfig};
use accelerate_tests::{load_flat, named_vars, output_text as text, summary_value, Job};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::VarMap;

/// Every parameter's values (or gradients) as bits, by name.
type Bits = Vec<(String, Vec<u32>)>;

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|v| v.to_bits())
        .collect()
}

/// The loss's bits, every parameter's gradient as bits, and the number of nodes of the loss's
/// graph after the forward pass.
struct Pass {
    loss: u32,
    grads: Bits,
    graph_nodes: usize,
}

fn pass(varmap: &VarMap, loss: Tensor) -> Pass {
    let graph_nodes = loss.sorted_nodes().len();
    let grads = loss.backward().unwrap();
    Pass {
        loss: loss.to_scalar::<f32>().unwrap().to_bits(),
        grads: named_vars(varmap)
            .iter()
            .map(|(n, v)| {
                let g = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{n} has no gradient"));
                (n.clone(), bits(g))
            })
            .collect(),
        graph_nodes,
    }
}

fn assert_same_gradients(plain: &Pass, checkpointed: &Pass) {
    assert_eq!(checkpointed.loss, plain.loss, "the loss differs");
    assert_eq!(plain.grads.len(), checkpointed.grads.len());
    for ((name, a), (_, b)) in plain.grads.iter().zip(&checkpointed.grads) {
        assert!(a == b, "{name}: the gradient differs with checkpointing");
    }
    // Checkpointing did act: the graph kept after the forward pass is smaller.
    assert!(
        checkpointed.graph_nodes < plain.graph_nodes,
        "{} nodes with checkpointing, {} without",
        checkpointed.graph_nodes,
        plain.graph_nodes
    );
}

const GPT: GptConfig = GptConfig {
    vocab: 11,
    context: 8,
    width: 16,
    heads: 4,
    layers: 2,
};

const GPT_DROPOUT: f64 = 0.1;

fn gpt_batch(device: &Device) -> (Tensor, Tensor, Tensor) {
    let x = Tensor::new(&[[1u32, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 1]], device).unwrap();
    let y = Tensor::new(&[[2u32, 3, 4, 5, 6, 7], [8, 9, 10, 0, 1, 2]], device).unwrap();
    let mask = Tensor::new(
        &[[1f32, 1., 1., 1., 1., 1.], [1., 1., 1., 1., 0., 0.]],
        device,
    )
    .unwrap();
    (x, y, mask)
}

/// One forward and backward pass of the tiny gpt with dropout drawn from `RankRng(seed, 0)`,
/// and the generator's next draw afterwards.
fn gpt_pass(checkpointing: bool, dropout_seed: u64) -> (Pass, u64) {
    let (varmap, mut model) = gpt::build_in(GPT, 3, &Device::Cpu, DType::F32).unwrap();
    model.set_gradient_checkpointing(checkpointing);
    let rng = RankRng::new(dropout_seed, 0);
    let dropout = Dropout {
        rng: rng.clone(),
        p: GPT_DROPOUT,
    };
    let (x, y, mask) = gpt_batch(&Device::Cpu);
    let logits = model.forward_with(&x, Some(&dropout)).unwrap();
    let loss = gpt::summed_token_loss(&logits, &y, &mask).unwrap();
    let pass = pass(&varmap, loss);
    (pass, rng.next_u64())
}

#[test]
fn gpt_with_dropout_has_bitwise_the_gradients_of_the_plain_model() {
    let (plain, plain_next) = gpt_pass(false, 9);
    let (checkpointed, checkpointed_next) = gpt_pass(true, 9);
    assert_same_gradients(&plain, &checkpointed);
    assert_eq!(
        checkpointed_next, plain_next,
        "the generator did not end where the plain model's did"
    );
    // The masks matter: other masks give other gradients, so equal masks were drawn above.
    let (other_masks, _) = gpt_pass(false, 10);
    assert_ne!(other_masks.grads, plain.grads);
}

fn llama_config() -> LlamaConfig {
    LlamaConfig::from_flags(13, 2, 16, 4, 2, 24, 8).unwrap()
}

fn llama_ids(device: &Device) -> Tensor {
    Tensor::new(
        &[[1u32, 5, 2, 7, 3, 12, 4], [6, 0, 9, 11, 8, 10, 2]],
        device,
    )
    .unwrap()
}

fn llama_pass(checkpointing: bool) -> Pass {
    let (varmap, mut model) = llama::build_in(llama_config(), 4, &Device::Cpu, DType::F32).unwrap();
    model.set_gradient_checkpointing(checkpointing);
    let loss = model
        .summed_causal_lm_loss(&llama_ids(&Device::Cpu))
        .unwrap();
    pass(&varmap, loss)
}

#[test]
fn llama_has_bitwise_the_gradients_of_the_plain_model() {
    assert_same_gradients(&llama_pass(false), &llama_pass(true));
}

/// The parameters' bits after two AdamW steps of a model through a single-process Accelerator,
/// and their bits before.
fn two_steps(
    build: impl FnOnce(&Accelerator) -> VarMap,
    loss: impl Fn(&Accelerator) -> Tensor,
) -> (Bits, Bits) {
    let mut acc = Accelerator::builder()
        .process_state(ProcessState::single())
        .seed(21)
        .build()
        .unwrap();
    let varmap = build(&acc);
    let params = acc.prepare(&varmap).unwrap();
    let snapshot = |params: &[(String, Var)]| -> Bits {
        let mut v: Bits = params
            .iter()
            .map(|(n, p)| (n.clone(), bits(p.as_tensor())))
            .collect();
        v.sort();
        v
    };
    let before = snapshot(&params);
    let config = AdamWConfig {
        lr: 1e-2,
        ..AdamWConfig::default()
    };
    let mut opt = acc
        .prepare(AdamW::new(params.clone(), config).unwrap())
        .unwrap();
    for _ in 0..2 {
        let _step = acc.accumulate();
        acc.backward(&loss(&acc)).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
    }
    (before, snapshot(&params))
}

fn gpt_two_steps(checkpointing: bool) -> (Bits, Bits) {
    let model = std::cell::OnceCell::new();
    two_steps(
        |acc| {
            let (varmap, mut m) = gpt::build_in(GPT, 3, acc.device(), DType::F32).unwrap();
            m.set_gradient_checkpointing(checkpointing);
            model.set(m).unwrap();
            varmap
        },
        |acc| {
            let dropout = Dropout {
                rng: acc.rng().clone(),
                p: GPT_DROPOUT,
            };
            let (x, y, mask) = gpt_batch(acc.device());
            let logits = model
                .get()
                .unwrap()
                .forward_with(&x, Some(&dropout))
                .unwrap();
            gpt::summed_token_loss(&logits, &y, &mask).unwrap()
        },
    )
}

fn llama_two_steps(checkpointing: bool) -> (Bits, Bits) {
    let model = std::cell::OnceCell::new();
    two_steps(
        |acc| {
            let (varmap, mut m) =
                llama::build_in(llama_config(), 4, acc.device(), DType::F32).unwrap();
            m.set_gradient_checkpointing(checkpointing);
            model.set(m).unwrap();
            varmap
        },
        |acc| {
            model
                .get()
                .unwrap()
                .summed_causal_lm_loss(&llama_ids(acc.device()))
                .unwrap()
        },
    )
}

fn assert_same_parameters(plain: (Bits, Bits), checkpointed: (Bits, Bits)) {
    let ((before, after), (_, after_checkpointed)) = (plain, checkpointed);
    // The steps moved every matrix: the comparison below could fail.
    assert_ne!(before, after);
    for ((name, a), (_, b)) in after.iter().zip(&after_checkpointed) {
        assert!(a == b, "{name} differs after two steps with checkpointing");
    }
}

#[test]
fn two_adamw_steps_of_gpt_leave_bitwise_the_parameters_of_the_plain_model() {
    assert_same_parameters(gpt_two_steps(false), gpt_two_steps(true));
}

#[test]
fn two_adamw_steps_of_llama_leave_bitwise_the_parameters_of_the_plain_model() {
    assert_same_parameters(llama_two_steps(false), llama_two_steps(true));
}

#[test]
fn the_gpt_example_on_two_ranks_ends_at_the_loss_and_weights_of_the_run_without() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, more: &[&str]| {
        let weights = dir.path().join(name);
        let mut args = vec![
            "--layers",
            "2",
            "--width",
            "16",
            "--heads",
            "2",
            "--context",
            "16",
            "--batch-size",
            "4",
            "--max-steps",
            "6",
            "--dropout",
            "0.1",
            "--save-model",
            weights.to_str().unwrap(),
        ];
        args.extend(more);
        let o = Job::example("gpt")
            .limit(Duration::from_secs(240))
            .ranks(2)
            .args(&args)
            .env("RAYON_NUM_THREADS", "1")
            .run();
        assert!(o.status.success(), "{}", text(&o));
        (o, load_flat(&weights))
    };
    let (plain, plain_weights) = run("plain.safetensors", &[]);
    let (checkpointed, checkpointed_weights) =
        run("checkpointed.safetensors", &["--gradient-checkpointing"]);
    assert!(
        text(&checkpointed).contains("gradient checkpointing on"),
        "{}",
        text(&checkpointed)
    );
    assert!(text(&plain).contains("gradient checkpointing off"));
    assert_eq!(
        summary_value::<f64>(&checkpointed, "final_loss"),
        summary_value::<f64>(&plain, "final_loss")
    );
    assert_eq!(plain_weights.len(), checkpointed_weights.len());
    for (name, values) in &plain_weights {
        let a: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        let b: Vec<u32> = checkpointed_weights[name]
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert!(a == b, "{name} differs after training with checkpointing");
    }
}
