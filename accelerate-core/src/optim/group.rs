//! Parameter groups, as PyTorch's `param_groups`: parameters of one optimizer that share their own
//! hyper-parameters (learning rate, weight decay, betas or momentum), and the usual split of a
//! transformer's parameters into a group with weight decay and one without.

use candle_core::Var;

/// Parameters that share one configuration (their update rule's hyper-parameters) inside an
/// optimizer built with [`ElementwiseOptimizer::with_groups`](super::ElementwiseOptimizer::with_groups).
#[derive(Debug, Clone)]
pub struct ParamGroup<R> {
    /// The group's parameters, by name; a name may be in only one group of an optimizer.
    pub params: Vec<(String, Var)>,
    /// The group's hyper-parameters (its learning rate is the group's initial rate).
    pub config: R,
}

impl<R> ParamGroup<R> {
    /// The group of `params` with hyper-parameters `config`.
    pub fn new(params: Vec<(String, Var)>, config: R) -> Self {
        Self { params, config }
    }
}

/// Whether the parameter `name` is one that transformer training keeps out of weight decay: a
/// bias or a normalization layer's weight.
///
/// This is Hugging Face Trainer's rule (`Trainer.get_decay_parameter_names`) applied to the
/// lower-cased name: it contains `bias`, `layernorm` or `rmsnorm`, or has a dot-separated segment
/// `norm` or ending in `_norm` (`model.norm.weight`, `layers.0.q_norm.weight`). The Trainer also
/// excludes every parameter of a `torch.nn.LayerNorm` module whatever its name; without module
/// types, we match the names such modules conventionally have: a segment `ln`, starting with
/// `ln_` (GPT-2's `h.0.ln_1.weight`, `ln_f`), or `norm` followed by digits (`norm1`).
pub fn is_no_decay(name: &str) -> bool {
    let name = name.to_lowercase();
    if ["bias", "layernorm", "rmsnorm"]
        .iter()
        .any(|p| name.contains(p))
    {
        return true;
    }
    name.split('.').any(|segment| {
        segment == "norm"
            || segment.ends_with("_norm")
            || segment == "ln"
            || segment.starts_with("ln_")
            || segment
                .strip_prefix("norm")
                .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// Named parameters split by [`split_decay`], each part in the given order; either may be empty.
#[derive(Debug, Clone)]
pub struct DecaySplit {
    /// Parameters that take weight decay (weights of linear layers, embeddings, ...).
    pub decay: Vec<(String, Var)>,
    /// Biases and normalization weights ([`is_no_decay`]).
    pub no_decay: Vec<(String, Var)>,
}

/// Splits named parameters into those that take weight decay and those that do not
/// ([`is_no_decay`]), for two [`ParamGroup`]s.
pub fn split_decay(params: Vec<(String, Var)>) -> DecaySplit {
    let (decay, no_decay) = params.into_iter().partition(|(name, _)| !is_no_decay(name));
    DecaySplit { decay, no_decay }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    #[test]
    fn biases_and_norms_take_no_weight_decay() {
        // Names from Llama, GPT-2, BERT and ViT checkpoints, with what the Trainer decides for
        // them (its patterns, or its LayerNorm type test for GPT-2's ln_* and ViT's norm1).
        let no_decay = [
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.post_attention_layernorm.weight",
            "model.norm.weight",
            "model.layers.3.self_attn.q_norm.weight",
            "transformer.h.0.ln_1.weight",
            "transformer.ln_f.bias",
            "transformer.ln_f.weight",
            "bert.embeddings.LayerNorm.weight",
            "encoder.layer.0.norm1.weight",
            "decoder.final_layer_norm.weight",
            "rmsnorm.scale",
        ];
        let decay = [
            "model.layers.0.self_attn.q_proj.weight",
            "model.embed_tokens.weight",
            "lm_head.weight",
            "transformer.h.0.mlp.c_fc.weight",
            "normalizer.weight",
            "enormous.weight",
            "kiln_1.weight",
        ];
        for name in no_decay {
            assert!(is_no_decay(name), "{name} should take no weight decay");
        }
        for name in decay {
            assert!(!is_no_decay(name), "{name} should take weight decay");
        }
    }

    #[test]
    fn split_keeps_order_and_every_parameter() {
        let var = || Var::zeros(1, DType::F32, &Device::Cpu).unwrap();
        let names = ["l1.weight", "l1.bias", "norm.weight", "l2.weight"];
        let DecaySplit { decay, no_decay } =
            split_decay(names.iter().map(|n| (n.to_string(), var())).collect());
        let names_of = |v: &[(String, Var)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        assert_eq!(names_of(&decay), ["l1.weight", "l2.weight"]);
        assert_eq!(names_of(&no_decay), ["l1.bias", "norm.weight"]);
    }
}

/// Our optimizers against PyTorch's with two groups under LambdaLR: the fixture written by
/// tests/python/make_param_groups_fixture.py.
#[cfg(test)]
mod against_pytorch {
    use std::collections::HashMap;

    use candle_core::{DType, Device, Tensor, Var};

    use super::{split_decay, DecaySplit, ParamGroup};
    use crate::grads::{GradientBuffers, DEFAULT_BUCKET_CAP_BYTES};
    use crate::optim::test_util::{assert_close, values};
    use crate::optim::{
        AdamWConfig, ElementwiseOptimizer, LrScheduler, Optimizer, Schedule, SgdConfig, UpdateRule,
    };

    const DIR: &str = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/param_groups"
    );

    struct Fixture {
        meta: serde_json::Value,
        tensors: HashMap<String, Tensor>,
    }

    fn fixture() -> Fixture {
        let meta = std::fs::read_to_string(format!("{DIR}/groups.json")).unwrap();
        let tensors =
            candle_core::safetensors::load(format!("{DIR}/param_groups.safetensors"), &Device::Cpu)
                .unwrap();
        Fixture {
            meta: serde_json::from_str(&meta).unwrap(),
            tensors,
        }
    }

    fn flat(t: &Tensor) -> Vec<f64> {
        t.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1()
            .unwrap()
    }

    /// Runs the fixture's steps with our optimizer made of `configs` (one per group, from the
    /// JSON) and compares every parameter with PyTorch's after every step.
    fn check<R: UpdateRule>(
        f: &Fixture,
        prefix: &str,
        configs: [R; 2],
        dtype: DType,
        force_fallback: bool,
        tolerance: f64,
    ) {
        let names = ["l1.weight", "l1.bias", "norm.weight"];
        let params: Vec<(String, Var)> = names
            .iter()
            .map(|n| {
                let t = f.tensors[&format!("init.{n}")].to_dtype(dtype).unwrap();
                (n.to_string(), Var::from_tensor(&t).unwrap())
            })
            .collect();
        // The groups come from the helper; the fixture says what the Trainer's rule gives.
        let DecaySplit { decay, no_decay } = split_decay(params);
        let member_names =
            |v: &[(String, Var)]| -> Vec<String> { v.iter().map(|(n, _)| n.clone()).collect() };
        let expected: Vec<Vec<String>> = serde_json::from_value(f.meta["groups"].clone()).unwrap();
        assert_eq!(
            vec![member_names(&decay), member_names(&no_decay)],
            expected
        );
        let [c0, c1] = configs;
        let mut opt = ElementwiseOptimizer::with_groups(vec![
            ParamGroup::new(decay, c0),
            ParamGroup::new(no_decay, c1),
        ])
        .unwrap();
        opt.force_fallback = force_fallback;
        let s = &f.meta["schedule"];
        let schedule = Schedule::LinearWarmupDecay {
            warmup_steps: s["warmup_steps"].as_u64().unwrap() as usize,
            total_steps: s["total_steps"].as_u64().unwrap() as usize,
        };
        let mut scheduler = LrScheduler::new(opt.learning_rate().clone(), schedule).unwrap();
        for step in 0..f.meta["steps"].as_u64().unwrap() {
            let mut grads = GradientBuffers::new(opt.params(), DEFAULT_BUCKET_CAP_BYTES).unwrap();
            for (name, _) in opt.params() {
                let g = &f.tensors[&format!("grad.{step}.{name}")];
                grads
                    .accumulate_one(name, &g.to_dtype(dtype).unwrap(), 1.0)
                    .unwrap();
            }
            opt.step(grads.gradients()).unwrap();
            scheduler.step();
            for (name, var) in opt.params() {
                let torch = flat(&f.tensors[&format!("{prefix}.{step}.{name}")]);
                let what = format!(
                    "{prefix} {dtype:?} fallback {force_fallback}: {name} after step {step}"
                );
                assert_close(&values(var), &torch, tolerance, &what);
            }
        }
    }

    #[test]
    fn sgd_with_two_groups_matches_pytorch() {
        let f = fixture();
        let config = |g: usize| {
            let c = &f.meta["sgd"][g];
            SgdConfig {
                lr: c["lr"].as_f64().unwrap(),
                momentum: c["momentum"].as_f64().unwrap(),
                dampening: c["dampening"].as_f64().unwrap(),
                weight_decay: c["weight_decay"].as_f64().unwrap(),
                nesterov: c["nesterov"].as_bool().unwrap(),
            }
        };
        check(&f, "sgd", [config(0), config(1)], DType::F64, false, 1e-13);
        check(&f, "sgd", [config(0), config(1)], DType::F32, false, 1e-6);
        check(&f, "sgd", [config(0), config(1)], DType::F32, true, 1e-6);
    }

    #[test]
    fn adamw_with_two_groups_matches_pytorch() {
        let f = fixture();
        let config = |g: usize| {
            let c = &f.meta["adamw"][g];
            AdamWConfig {
                lr: c["lr"].as_f64().unwrap(),
                beta1: c["betas"][0].as_f64().unwrap(),
                beta2: c["betas"][1].as_f64().unwrap(),
                eps: c["eps"].as_f64().unwrap(),
                weight_decay: c["weight_decay"].as_f64().unwrap(),
            }
        };
        check(
            &f,
            "adamw",
            [config(0), config(1)],
            DType::F64,
            false,
            1e-13,
        );
        check(&f, "adamw", [config(0), config(1)], DType::F32, false, 2e-6);
        check(&f, "adamw", [config(0), config(1)], DType::F32, true, 2e-6);
    }
}

/// Group settings through `Accelerator::save_state` and `load_state`.
#[cfg(test)]
mod checkpoint {
    use candle_core::{Device, Var};

    use super::ParamGroup;
    use crate::optim::{AdamW, AdamWConfig, LrScheduler, Schedule};
    use crate::{Accelerator, ProcessState};

    const SCHEDULE: Schedule = Schedule::LinearWarmupDecay {
        warmup_steps: 1,
        total_steps: 10,
    };

    /// An accelerator over "w" and "b", with AdamW over `groups` (names per group, one config
    /// each) and a scheduler, all prepared.
    fn setup(
        groups: &[(&[&str], AdamWConfig)],
    ) -> (
        Accelerator,
        crate::PreparedOptimizer<AdamW>,
        crate::PreparedScheduler,
        [Var; 2],
    ) {
        let mut acc = Accelerator::builder()
            .process_state(ProcessState::single())
            .build()
            .unwrap();
        let w = Var::new(&[1.0f32, -1.0], &Device::Cpu).unwrap();
        let b = Var::new(&[0.5f32], &Device::Cpu).unwrap();
        let params = acc
            .prepare(vec![
                ("w".to_string(), w.clone()),
                ("b".to_string(), b.clone()),
            ])
            .unwrap();
        let groups = groups
            .iter()
            .map(|(names, config)| {
                let members = params
                    .iter()
                    .filter(|(n, _)| names.contains(&n.as_str()))
                    .cloned()
                    .collect();
                ParamGroup::new(members, *config)
            })
            .collect();
        let opt = acc.prepare(AdamW::with_groups(groups).unwrap()).unwrap();
        let sched = acc
            .prepare(LrScheduler::new(opt.learning_rate_handle(), SCHEDULE).unwrap())
            .unwrap();
        (acc, opt, sched, [w, b])
    }

    #[test]
    fn group_settings_are_saved_restored_and_other_groups_refused() {
        let decay = AdamWConfig {
            lr: 0.1,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let no_decay = AdamWConfig {
            lr: 0.04,
            beta1: 0.8,
            weight_decay: 0.0,
            ..AdamWConfig::default()
        };
        let (acc, mut opt, mut sched, [w, b]) = setup(&[(&["w"], decay), (&["b"], no_decay)]);
        for _ in 0..3 {
            let _step = acc.accumulate();
            let loss = (w.as_tensor().sum_all().unwrap()
                + b.as_tensor().sqr().unwrap().sum_all().unwrap())
            .unwrap();
            acc.backward(&loss).unwrap();
            opt.step().unwrap();
            sched.step();
            opt.zero_grad();
        }
        // Factor at step 3: (10 - 3) / 9.
        let rates = opt.learning_rate_handle().get_all();
        assert_eq!(rates, [0.1 * 7.0 / 9.0, 0.04 * 7.0 / 9.0]);
        let dir = tempfile::tempdir().unwrap();
        acc.save_state(dir.path()).unwrap();

        // A fresh run whose groups have other settings: the checkpoint's win.
        let d = AdamWConfig::default();
        let (acc2, opt2, sched2, _) = setup(&[(&["w"], d), (&["b"], d)]);
        acc2.load_state(dir.path()).unwrap();
        assert_eq!(opt2.learning_rate_handle().get_all(), rates);
        assert_eq!(sched2.state().base_lrs(), [0.1, 0.04]);
        let mut expected = [decay, no_decay];
        expected[0].lr = rates[0];
        expected[1].lr = rates[1];
        assert_eq!(opt2.with_inner(|o| o.group_configs()).unwrap(), expected);

        // Groups with other members, or one group: refused by name, nothing loaded.
        for groups in [
            vec![(&["b"][..], d), (&["w"][..], d)],
            vec![(&["b", "w"][..], d)],
        ] {
            let (acc3, opt3, _, [w3, _]) = setup(&groups);
            let err = acc3.load_state(dir.path()).unwrap_err().to_string();
            assert!(err.contains("parameter group"), "{err}");
            assert_eq!(
                opt3.learning_rate_handle().get_all()[0],
                d.lr * 0.0,
                "warm-up step 0"
            );
            let w3: Vec<f32> = w3.as_tensor().to_vec1().unwrap();
            assert_eq!(w3, [1.0, -1.0], "parameters untouched");
        }
    }
}
