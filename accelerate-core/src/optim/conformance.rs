//! The tests every update rule passes, written once: each rule's test module implements
//! [`Conformance`] (its configurations, the published formula in f64, its invalid settings) and
//! invokes [`suite!`] to get one `#[test]` per check.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use super::test_util::{assert_close, buffers, named, pseudo_random, values};
use super::{ElementwiseOptimizer, Optimizer, OptimizerState, ParamGroup, UpdateRule};

/// What the suite needs to know about a rule.
pub(crate) trait Conformance: UpdateRule + Default + PartialEq {
    /// How close the f32 paths come to the f64 formula (relative, or absolute below 1).
    const F32_TOLERANCE: f64;
    /// How close the f64 tensor-op path comes to the f64 formula.
    const F64_TOLERANCE: f64;

    /// Named configurations that together take every branch of the update.
    fn configs() -> Vec<(&'static str, Self)>;

    /// A configuration that keeps state for every parameter, with a learning rate other than the
    /// default (the state tests need something to save).
    fn stateful() -> Self;

    /// Configurations `new` refuses, each with a word the error must contain.
    fn invalid_configs() -> Vec<(Self, &'static str)>;

    /// The rule as published, one scalar at a time in f64, for one parameter starting at `p`:
    /// each call takes a gradient and returns the parameter after that update.
    fn reference(c: Self, p: Vec<f64>) -> Reference;
}

/// A hand-written change to a rule's default configuration.
pub(crate) type Edit<R> = fn(&mut R);

/// The rule's default configuration as one hand-written edit leaves it.
pub(crate) fn with<R: Default>(edit: Edit<R>) -> R {
    let mut config = R::default();
    edit(&mut config);
    config
}

/// A rule's named configurations, each the default as one hand-written edit leaves it (the table
/// of [`Conformance::configs`]).
pub(crate) fn variants<R: Default>(edits: &[(&'static str, Edit<R>)]) -> Vec<(&'static str, R)> {
    edits
        .iter()
        .map(|&(what, edit)| (what, with(edit)))
        .collect()
}

/// Configurations `new` must refuse, each the default with one hand-written edit, and the word its
/// error must contain (the table of [`Conformance::invalid_configs`]).
pub(crate) fn refused<R: Default>(edits: &[(Edit<R>, &'static str)]) -> Vec<(R, &'static str)> {
    edits
        .iter()
        .map(|&(edit, word)| (with(edit), word))
        .collect()
}

/// The published formula for one parameter: each call takes a gradient and returns the parameter
/// after that update.
pub(crate) type Reference = Box<dyn FnMut(&[f64]) -> Vec<f64>>;

const A0: [f64; 5] = [0.5, -1.25, 2.0, 0.0, -0.3];
const B0: [f64; 3] = [1.0, -2.0, 0.75];

/// Gradients of "a" and "b" at step `s`: they change every step, signs and scale included.
fn grads_at(s: usize) -> (Vec<f64>, Vec<f64>) {
    let a = pseudo_random(A0.len(), 10 + s as u32);
    let b = pseudo_random(B0.len(), 100 + s as u32)
        .iter()
        .map(|x| x * 3.0)
        .collect();
    (a, b)
}

/// An optimizer over "a" and "b" (given out of order: `new` sorts by name).
fn optimizer<R: Conformance>(config: R, dtype: DType) -> ElementwiseOptimizer<R> {
    ElementwiseOptimizer::new(named(&[("b", &B0), ("a", &A0)], dtype), config).unwrap()
}

fn run<R: Conformance>(opt: &mut ElementwiseOptimizer<R>, steps: std::ops::Range<usize>) {
    for s in steps {
        let (ga, gb) = grads_at(s);
        opt.step(buffers(opt.params(), &[("a", &ga), ("b", &gb)]).gradients())
            .unwrap();
    }
}

/// Tensors (widened to f64, exactly) and scalars of a state.
type Contents = (BTreeMap<String, Vec<f64>>, BTreeMap<String, f64>);

fn contents(s: &OptimizerState) -> Contents {
    let tensors = s
        .tensors
        .iter()
        .map(|(k, t)| {
            let v = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
            (k.clone(), v.to_vec1().unwrap())
        })
        .collect();
    (tensors, s.scalars.clone())
}

/// Four updates of every configuration, compared with the formula after each.
fn check_against_reference<R: Conformance>(dtype: DType, force_fallback: bool, tolerance: f64) {
    for (what, config) in R::configs() {
        let mut opt = optimizer(config.clone(), dtype);
        opt.force_fallback = force_fallback;
        let (mut ra, mut rb) = (
            R::reference(config.clone(), A0.to_vec()),
            R::reference(config.clone(), B0.to_vec()),
        );
        for s in 0..4 {
            run(&mut opt, s..s + 1);
            let (ga, gb) = grads_at(s);
            let (a, b) = (ra(&ga), rb(&gb));
            let label = |p| format!("{}, {what}: {p} after update {s}", R::NAME);
            assert_close(&values(&opt.params()[0].1), &a, tolerance, &label("a"));
            assert_close(&values(&opt.params()[1].1), &b, tolerance, &label("b"));
        }
        let fused = dtype == DType::F32 && !force_fallback;
        let expected_fallbacks = if fused { 0 } else { 8 };
        assert_eq!(opt.fallback_updates, expected_fallbacks, "{what}");
    }
}

pub(crate) fn the_fused_path_matches_the_formula<R: Conformance>() {
    check_against_reference::<R>(DType::F32, false, R::F32_TOLERANCE);
}

pub(crate) fn the_tensor_op_path_matches_the_formula<R: Conformance>() {
    check_against_reference::<R>(DType::F64, false, R::F64_TOLERANCE);
    check_against_reference::<R>(DType::F32, true, R::F32_TOLERANCE);
}

pub(crate) fn the_fused_and_tensor_op_paths_agree_on_f32<R: Conformance>() {
    for (what, config) in R::configs() {
        let mut fused = optimizer(config.clone(), DType::F32);
        let mut ops = optimizer(config, DType::F32);
        ops.force_fallback = true;
        run(&mut fused, 0..5);
        run(&mut ops, 0..5);
        assert_eq!((fused.fallback_updates, ops.fallback_updates), (0, 10));
        for i in 0..2 {
            let f = values(&fused.params()[i].1);
            assert_close(&values(&ops.params()[i].1), &f, 1e-6, what);
        }
        let (f, o) = (
            contents(&fused.state().unwrap()),
            contents(&ops.state().unwrap()),
        );
        assert_eq!(f.1, o.1, "{what}: scalars");
        assert_eq!(
            f.0.keys().collect::<Vec<_>>(),
            o.0.keys().collect::<Vec<_>>()
        );
        for (k, t) in &f.0 {
            assert_close(&o.0[k], t, 1e-6, &format!("{what}: {k}"));
        }
    }
}

pub(crate) fn a_parameter_split_over_threads_equals_the_unsplit_update<R: Conformance>() {
    let n = 3001;
    let p0 = pseudo_random(n, 7);
    let make = || ElementwiseOptimizer::new(named(&[("w", &p0)], DType::F32), R::stateful());
    let (mut whole, mut split) = (make().unwrap(), make().unwrap());
    split.parallel_min_elems = 100;
    for s in 0..3 {
        let g = pseudo_random(n, 20 + s);
        whole
            .step(buffers(whole.params(), &[("w", &g)]).gradients())
            .unwrap();
        split
            .step(buffers(split.params(), &[("w", &g)]).gradients())
            .unwrap();
    }
    assert_eq!(values(&whole.params()[0].1), values(&split.params()[0].1));
    assert_eq!(
        contents(&whole.state().unwrap()),
        contents(&split.state().unwrap())
    );
    assert_ne!(values(&whole.params()[0].1), p0, "the parameter did move");
}

pub(crate) fn a_parameter_without_gradient_is_untouched_and_gets_no_state<R: Conformance>() {
    let config = R::stateful();
    let mut opt = optimizer(config.clone(), DType::F32);
    let mut ra = R::reference(config.clone(), A0.to_vec());
    for s in 0..3 {
        let (ga, _) = grads_at(s);
        opt.step(buffers(opt.params(), &[("a", &ga)]).gradients())
            .unwrap();
        ra(&ga);
    }
    // Not even weight decay reached "b".
    assert_eq!(
        values(&opt.params()[1].1),
        B0.map(|x| x as f32 as f64).to_vec(),
        "bit for bit, as stored in f32"
    );
    let state = opt.state().unwrap();
    let of = |p: &str| -> Vec<String> {
        let keys = state.tensors.keys().chain(state.scalars.keys());
        keys.filter(|k| k.ends_with(p)).cloned().collect()
    };
    assert!(of(".b").is_empty(), "{:?}", of(".b"));
    assert_eq!(
        of(".a").len(),
        config.state_names().len() + usize::from(R::COUNTS_STEPS)
    );
    if R::COUNTS_STEPS {
        assert_eq!(state.scalars["step.a"], 3.0);
    }
    // Its first gradient is its first update (fresh state), while "a" continues.
    let mut rb = R::reference(config.clone(), B0.to_vec());
    let (ga, gb) = grads_at(3);
    opt.step(buffers(opt.params(), &[("a", &ga), ("b", &gb)]).gradients())
        .unwrap();
    let tolerance = R::F32_TOLERANCE;
    assert_close(&values(&opt.params()[0].1), &ra(&ga), tolerance, "a");
    assert_close(&values(&opt.params()[1].1), &rb(&gb), tolerance, "b");
    if R::COUNTS_STEPS {
        let state = opt.state().unwrap();
        assert_eq!(
            (state.scalars["step.a"], state.scalars["step.b"]),
            (4.0, 1.0)
        );
    }
}

pub(crate) fn the_learning_rate_is_read_at_every_step<R: Conformance>() {
    for (what, config) in R::configs() {
        let mut opt = optimizer(config, DType::F32);
        let before: Vec<_> = opt.params().iter().map(|(_, v)| values(v)).collect();
        opt.learning_rate().clone().set(0.0);
        run(&mut opt, 0..2);
        let after: Vec<_> = opt.params().iter().map(|(_, v)| values(v)).collect();
        assert_eq!(after, before, "{what}: lr 0 moves nothing");
        assert_eq!(opt.config().lr(), 0.0);
    }
}

pub(crate) fn a_bad_learning_rate_or_gradient_is_refused<R: Conformance>() {
    let mut opt = optimizer(R::stateful(), DType::F32);
    let before: Vec<_> = opt.params().iter().map(|(_, v)| values(v)).collect();
    let handle = opt.learning_rate().clone();
    for bad in [f64::NAN, -1e-3, f64::INFINITY] {
        handle.set(bad);
        let (ga, gb) = grads_at(0);
        let err = opt
            .step(buffers(opt.params(), &[("a", &ga), ("b", &gb)]).gradients())
            .unwrap_err()
            .to_string();
        assert!(err.contains("learning rate is"), "{err}");
    }
    handle.set(0.1);
    // Gradient buffers built for a parameter "a" of 3 elements where the optimizer's has 5.
    let other = named(&[("a", &[1.0, 2.0, 3.0])], DType::F32);
    let err = opt
        .step(buffers(&other, &[("a", &[1.0, 1.0, 1.0])]).gradients())
        .unwrap_err()
        .to_string();
    assert!(err.contains("[3]") && err.contains("[5]"), "{err}");
    let after: Vec<_> = opt.params().iter().map(|(_, v)| values(v)).collect();
    assert_eq!(after, before, "refused steps change nothing");
    assert!(opt.state().unwrap().tensors.is_empty());
}

pub(crate) fn invalid_hyper_parameters_and_parameter_lists_are_refused<R: Conformance>() {
    let params = || named(&[("w", &[1.0])], DType::F32);
    for (config, word) in R::invalid_configs() {
        let err = ElementwiseOptimizer::new(params(), config)
            .unwrap_err()
            .to_string();
        assert!(err.contains(word), "{err}");
    }
    let dup = vec![params().remove(0), params().remove(0)];
    let err = ElementwiseOptimizer::new(dup, R::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"w\"") && err.contains("twice"), "{err}");
    let err = ElementwiseOptimizer::new(vec![], R::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("empty") && err.contains(R::NAME), "{err}");
}

pub(crate) fn a_state_round_trip_continues_identically<R: Conformance>() {
    let config = R::stateful();
    let mut straight = optimizer(config.clone(), DType::F32);
    run(&mut straight, 0..5);

    let mut first = optimizer(config.clone(), DType::F32);
    run(&mut first, 0..2);
    let saved = first.state().unwrap();
    let saved_contents = contents(&saved);
    assert!(!saved.tensors.is_empty() || config.state_names().is_empty());
    // Moving on does not reach the saved copy.
    run(&mut first, 2..3);
    assert_eq!(contents(&saved), saved_contents, "state() is a deep copy");

    // A fresh optimizer with default hyper-parameters over parameters holding the values at the
    // time of saving.
    let mut resumed =
        ElementwiseOptimizer::new(named(&[("a", &A0), ("b", &B0)], DType::F32), R::default())
            .unwrap();
    let mut at_save = optimizer(config.clone(), DType::F32);
    run(&mut at_save, 0..2);
    for ((_, dst), (_, src)) in resumed.params().iter().zip(at_save.params()) {
        dst.set(src.as_tensor()).unwrap();
    }
    resumed.load_state(&saved).unwrap();
    assert!(
        resumed.config() == config,
        "hyper-parameters come from the state: {:?}",
        resumed.config()
    );
    assert_eq!(resumed.learning_rate().get(), config.lr());
    run(&mut resumed, 2..5);
    assert_eq!(
        contents(&saved),
        saved_contents,
        "load_state copies the tensors"
    );
    for i in 0..2 {
        assert_eq!(
            values(&resumed.params()[i].1),
            values(&straight.params()[i].1)
        );
    }
    assert_eq!(
        contents(&resumed.state().unwrap()),
        contents(&straight.state().unwrap())
    );
}

/// Two groups over "a" and "b" with the first two configurations of the rule (other rates, weight
/// decay, betas or momentum), given in the order (b's group, a's group): group 0 holds "b".
fn two_groups<R: Conformance>(dtype: DType) -> (ElementwiseOptimizer<R>, R, R) {
    let configs = R::configs();
    let (ca, cb) = (configs[1].1.clone(), configs[configs.len() - 1].1.clone());
    assert!(ca != cb, "the suite needs two different configurations");
    let opt = ElementwiseOptimizer::with_groups(vec![
        ParamGroup::new(named(&[("b", &B0)], dtype), cb.clone()),
        ParamGroup::new(named(&[("a", &A0)], dtype), ca.clone()),
    ])
    .unwrap();
    (opt, ca, cb)
}

pub(crate) fn each_group_follows_the_formula_with_its_own_hyper_parameters<R: Conformance>() {
    for (dtype, force_fallback, tolerance) in [
        (DType::F32, false, R::F32_TOLERANCE),
        (DType::F32, true, R::F32_TOLERANCE),
        (DType::F64, false, R::F64_TOLERANCE),
    ] {
        let (mut opt, ca, cb) = two_groups::<R>(dtype);
        opt.force_fallback = force_fallback;
        assert_eq!(opt.learning_rate().get_all(), vec![cb.lr(), ca.lr()]);
        assert_eq!(opt.group_params(), vec![vec!["b"], vec!["a"]]);
        assert!(opt.group_configs() == vec![cb.clone(), ca.clone()]);
        let (mut ra, mut rb) = (
            R::reference(ca.clone(), A0.to_vec()),
            R::reference(cb.clone(), B0.to_vec()),
        );
        for s in 0..4 {
            run(&mut opt, s..s + 1);
            let (ga, gb) = grads_at(s);
            let label = |p| format!("{} groups ({dtype:?}): {p} after update {s}", R::NAME);
            assert_close(
                &values(&opt.params()[0].1),
                &ra(&ga),
                tolerance,
                &label("a"),
            );
            assert_close(
                &values(&opt.params()[1].1),
                &rb(&gb),
                tolerance,
                &label("b"),
            );
        }
    }
}

pub(crate) fn a_parameter_in_two_groups_is_refused_by_name<R: Conformance>() {
    let err = ElementwiseOptimizer::with_groups(vec![
        ParamGroup::new(named(&[("a", &A0), ("b", &B0)], DType::F32), R::stateful()),
        ParamGroup::new(named(&[("b", &B0)], DType::F32), R::default()),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("\"b\"") && err.contains("groups 0 and 1"),
        "{err}"
    );
    let err = ElementwiseOptimizer::<R>::with_groups(vec![])
        .unwrap_err()
        .to_string();
    assert!(err.contains("no parameter groups"), "{err}");
    let err = ElementwiseOptimizer::with_groups(vec![
        ParamGroup::new(named(&[("a", &A0)], DType::F32), R::stateful()),
        ParamGroup::new(
            named(&[("b", &B0)], DType::F32),
            R::invalid_configs()[0].0.clone(),
        ),
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("parameter group 1"), "{err}");
}

pub(crate) fn a_state_of_two_groups_round_trips_and_other_groups_are_refused<R: Conformance>() {
    let (mut straight, ca, cb) = two_groups::<R>(DType::F32);
    run(&mut straight, 0..2);
    let (mut first, _, _) = two_groups::<R>(DType::F32);
    run(&mut first, 0..2);
    // A scheduler-style change of one group's rate is saved too.
    let rates = vec![cb.lr() * 0.5, ca.lr() * 0.25];
    first.learning_rate().set_all(&rates).unwrap();
    straight.learning_rate().set_all(&rates).unwrap();
    let saved = first.state().unwrap();
    assert_eq!(saved.scalars["param_groups"], 2.0);
    assert_eq!(
        (
            saved.scalars["param_group.a"],
            saved.scalars["param_group.b"]
        ),
        (1.0, 0.0)
    );
    assert_eq!(saved.scalars["param_groups.1.lr"], ca.lr() * 0.25);

    // Fresh groups with default hyper-parameters over the values at the time of saving.
    let at_save: Vec<Tensor> = first
        .params()
        .iter()
        .map(|(_, v)| v.as_tensor().copy().unwrap())
        .collect();
    let fresh = |a_group: usize| {
        let mut groups = vec![
            ParamGroup::new(vec![], R::default()),
            ParamGroup::new(vec![], R::default()),
        ];
        groups[1 - a_group].params = named(&[("b", &B0)], DType::F32);
        groups[a_group].params = named(&[("a", &A0)], DType::F32);
        let opt = ElementwiseOptimizer::with_groups(groups).unwrap();
        for ((_, dst), src) in opt.params().iter().zip(&at_save) {
            dst.set(src).unwrap();
        }
        opt
    };
    let mut resumed = fresh(1);
    resumed.load_state(&saved).unwrap();
    assert_eq!(resumed.learning_rate().get_all(), rates);
    let mut expected = vec![cb.clone(), ca.clone()];
    expected[0].set_lr(rates[0]);
    expected[1].set_lr(rates[1]);
    assert!(
        resumed.group_configs() == expected,
        "{:?}",
        resumed.group_configs()
    );
    for opt in [&mut straight, &mut first, &mut resumed] {
        run(opt, 2..5);
    }
    for i in 0..2 {
        assert_eq!(values(&resumed.params()[i].1), values(&first.params()[i].1));
        assert_close(
            &values(&resumed.params()[i].1),
            &values(&straight.params()[i].1),
            0.0,
            "resumed = uninterrupted",
        );
    }

    // Other membership, other group counts: refused by name, nothing loaded.
    let mut swapped = fresh(0);
    let before = contents(&swapped.state().unwrap());
    let err = swapped.load_state(&saved).unwrap_err().to_string();
    assert!(
        err.contains("\"a\" (saved in group 1, here in group 0)") && err.contains("\"b\""),
        "{err}"
    );
    assert_eq!(contents(&swapped.state().unwrap()), before);
    let mut one_group = optimizer(R::stateful(), DType::F32);
    let before = contents(&one_group.state().unwrap());
    let err = one_group.load_state(&saved).unwrap_err().to_string();
    assert!(
        err.contains("2 parameter group(s)") && err.contains("has 1"),
        "{err}"
    );
    assert_eq!(contents(&one_group.state().unwrap()), before);
    let mut single = optimizer(R::stateful(), DType::F32);
    run(&mut single, 0..1);
    let err = fresh(1)
        .load_state(&single.state().unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("1 parameter group(s)") && err.contains("has 2"),
        "{err}"
    );
}

pub(crate) fn mismatched_states_are_refused_and_nothing_is_loaded<R: Conformance>() {
    let config = R::stateful();
    let mut source = optimizer(config.clone(), DType::F32);
    run(&mut source, 0..2);
    let good = source.state().unwrap();

    let mut other = config.clone();
    other.set_lr(config.lr() * 5.0);
    let mut target = optimizer(other, DType::F32);
    run(&mut target, 0..1);
    let before = contents(&target.state().unwrap());
    let mut refused = Vec::new();

    // The model's "b" is called "c" in the state.
    let mut renamed = OptimizerState::new(good.kind.clone());
    for (k, t) in &good.tensors {
        renamed.tensors.insert(k.replace(".b", ".c"), t.clone());
    }
    for (k, v) in &good.scalars {
        renamed.scalars.insert(k.replace(".b", ".c"), *v);
    }
    refused.push((renamed, vec![".c", "parameter names"]));

    let mut unknown = good.clone();
    unknown.scalars.insert("step.z".into(), 1.0);
    refused.push((unknown, vec!["step.z", "parameter names"]));

    if let Some(k) = good.tensors.keys().find(|k| k.ends_with(".a")) {
        let mut reshaped = good.clone();
        let t = Tensor::zeros(4, DType::F32, &candle_core::Device::Cpu).unwrap();
        reshaped.tensors.insert(k.clone(), t);
        refused.push((reshaped, vec![k.as_str(), "[4]", "[5]"]));
    }
    // The same number of elements as "b" (3), in another shape.
    if let Some(k) = good.tensors.keys().find(|k| k.ends_with(".b")) {
        let mut reshaped = good.clone();
        let t = Tensor::zeros((3, 1), DType::F32, &candle_core::Device::Cpu).unwrap();
        reshaped.tensors.insert(k.clone(), t);
        refused.push((reshaped, vec![k.as_str(), "[3, 1]"]));
    }

    // A parameter with several entries that lacks one of them.
    let entries_of_b = config.state_names().len() + usize::from(R::COUNTS_STEPS);
    let last_of_b = good.tensors.keys().rev().find(|k| k.ends_with(".b"));
    let mut incomplete = good.clone();
    let missing = last_of_b.map(|k| format!("{k:?} missing"));
    if let (true, Some(k)) = (entries_of_b > 1, last_of_b) {
        incomplete.tensors.remove(k);
        refused.push((incomplete, vec![missing.as_deref().unwrap(), "incomplete"]));
    }

    let mut wrong_kind = good.clone();
    wrong_kind.kind = "another".into();
    let expected_kind = format!("{:?}", R::KIND);
    refused.push((wrong_kind, vec!["\"another\"", expected_kind.as_str()]));

    let names: Vec<&str> = config.hyper_parameters().iter().map(|(n, _)| *n).collect();
    for name in &names {
        let mut lacking = good.clone();
        lacking.scalars.remove(*name);
        refused.push((lacking, vec![name]));
    }
    for (invalid, word) in R::invalid_configs() {
        let mut bad = good.clone();
        for (k, v) in invalid.hyper_parameters() {
            bad.scalars.insert(k.to_string(), v);
        }
        refused.push((bad, vec![word]));
    }

    for (state, words) in &refused {
        let err = target.load_state(state).unwrap_err().to_string();
        for word in words {
            assert!(err.contains(word), "expected {word:?} in: {err}");
        }
        assert_eq!(
            contents(&target.state().unwrap()),
            before,
            "a refused load changes nothing ({err})"
        );
        assert_eq!(target.learning_rate().get(), config.lr() * 5.0);
    }
    target.load_state(&good).unwrap();
    assert_eq!(contents(&target.state().unwrap()), contents(&good));
    assert_eq!(
        target.learning_rate().get(),
        config.lr(),
        "the learning rate comes from the state, as in PyTorch"
    );
}

/// The bits of a tensor of any float dtype, in order (f32 as u32, bf16/f16 as u16 widened), so
/// that comparisons are exact, NaN and the sign of zero included.
pub(crate) fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|x| x.to_bits())
            .collect(),
        DType::BF16 => t
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        DType::F16 => t
            .to_vec1::<half::f16>()
            .unwrap()
            .iter()
            .map(|x| u32::from(x.to_bits()))
            .collect(),
        d => panic!("bits of a {d:?} tensor"),
    }
}

/// Zeroed compute copies of `params` in `dtype`: a step that writes them leaves no zero behind
/// (the values are random), one that does not leaves them zero.
fn zero_copies(params: &[(String, Var)], dtype: DType) -> Vec<(String, Var)> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), Var::zeros(v.shape(), dtype, v.device()).unwrap()))
        .collect()
}

/// Two parameter groups (the rule's `config` and its stateful configuration) over "a", "b", a
/// parameter of several tiles with a partial last one ("big"), and one that gets no gradient
/// ("idle").
fn copy_groups<R: Conformance>(config: R, big: &[f64]) -> ElementwiseOptimizer<R> {
    let f32 = DType::F32;
    ElementwiseOptimizer::with_groups(vec![
        ParamGroup::new(named(&[("a", &A0), ("big", big)], f32), config),
        ParamGroup::new(
            named(&[("b", &B0), ("idle", &[0.25, -4.0])], f32),
            R::stateful(),
        ),
    ])
    .unwrap()
}

/// The gradients of step `s` for [`copy_groups`] ("idle" has none).
fn two_group_grads(s: usize, big: usize) -> Vec<(&'static str, Vec<f64>)> {
    let (ga, gb) = grads_at(s);
    let g_big = pseudo_random(big, 50 + s as u32);
    vec![("a", ga), ("b", gb), ("big", g_big)]
}

/// Steps `plain` and `fused` (one that writes compute copies) with the same gradients and
/// asserts they end the step with bitwise the same masters and state.
fn step_alike<R: Conformance>(
    plain: &mut ElementwiseOptimizer<R>,
    fused: &mut ElementwiseOptimizer<R>,
    grads: &[(&str, &[f64])],
    label: &str,
) {
    plain
        .step(buffers(plain.params(), grads).gradients())
        .unwrap();
    fused
        .step(buffers(fused.params(), grads).gradients())
        .unwrap();
    for ((name, want), (_, got)) in plain.params().iter().zip(fused.params()) {
        assert_eq!(bits(got), bits(want), "{label}: master {name}");
    }
    assert_eq!(
        contents(&fused.state().unwrap()),
        contents(&plain.state().unwrap()),
        "{label}: state"
    );
}

/// Mixed precision: an optimizer that writes the compute copies in its update's pass ends every
/// step with bitwise the masters and state of one that does not, and with copies bitwise equal
/// to casting those masters with candle's `to_dtype` (what the runtime did after every step):
/// every configuration, two parameter groups, bf16 and f16, the fused path whole and split over
/// threads, and the tensor-op path.
pub(crate) fn the_compute_copy_is_the_cast_of_the_updated_master<R: Conformance>() {
    let big = pseudo_random(2 * super::kernels::TILE + 37, 3);
    for (what, config) in R::configs() {
        for dtype in [DType::BF16, DType::F16] {
            for (fallback, parallel_min) in [(false, usize::MAX), (false, 500), (true, usize::MAX)]
            {
                let label = format!("{}, {what}, {dtype:?}, fallback {fallback}", R::NAME);
                let mut plain = copy_groups(config.clone(), &big);
                let mut fused = copy_groups(config.clone(), &big);
                for o in [&mut plain, &mut fused] {
                    o.force_fallback = fallback;
                    o.parallel_min_elems = parallel_min;
                }
                let copies = zero_copies(fused.params(), dtype);
                fused.set_compute_copies(&copies).unwrap();
                for s in 0..4 {
                    let grads = two_group_grads(s, big.len());
                    let grads: Vec<(&str, &[f64])> =
                        grads.iter().map(|(n, g)| (*n, g.as_slice())).collect();
                    step_alike(
                        &mut plain,
                        &mut fused,
                        &grads,
                        &format!("{label}, step {s}"),
                    );
                    for ((name, master), (_, copy)) in plain.params().iter().zip(&copies) {
                        if name == "idle" {
                            assert!(bits(copy).iter().all(|&b| b == 0), "{label}: idle");
                            assert!(!fused.wrote_compute_copy(name), "{label}");
                            continue;
                        }
                        let cast = master.as_tensor().to_dtype(dtype).unwrap();
                        assert_eq!(bits(copy), bits(&cast), "{label}: copy {name}, step {s}");
                        assert!(fused.wrote_compute_copy(name), "{label}: {name}");
                    }
                }
                let fallbacks = if fallback { 12 } else { 0 };
                assert_eq!(fused.fallback_updates, fallbacks, "{label}");
            }
        }
    }
}

/// ZeRO: an optimizer that updates only pieces of its parameters writes only those pieces of the
/// compute copies (bitwise the cast of the updated masters there, the copy untouched elsewhere),
/// and reports a copy as written only where its piece is the whole parameter.
pub(crate) fn a_zero_piece_writes_only_its_piece_of_the_compute_copy<R: Conformance>() {
    let big = pseudo_random(3000, 5);
    let params = || named(&[("a", &A0), ("b", &B0), ("big", &big)], DType::F32);
    let pieces: BTreeMap<String, std::ops::Range<usize>> = [
        ("a".to_string(), 0..A0.len()),
        ("big".to_string(), 1000..2500),
    ]
    .into();
    let mut plain = ElementwiseOptimizer::new(params(), R::stateful()).unwrap();
    let mut fused = ElementwiseOptimizer::new(params(), R::stateful()).unwrap();
    plain.shard(&pieces).unwrap();
    fused.shard(&pieces).unwrap();
    // As MasterWeights makes them: the cast of the initial masters.
    let copies: Vec<(String, Var)> = fused
        .params()
        .iter()
        .map(|(n, v)| {
            let c = v.as_tensor().to_dtype(DType::BF16).unwrap();
            (n.clone(), Var::from_tensor(&c).unwrap())
        })
        .collect();
    let initial: Vec<Vec<u32>> = copies.iter().map(|(_, c)| bits(c)).collect();
    fused.set_compute_copies(&copies).unwrap();
    for s in 0..3 {
        let (ga, gb) = grads_at(s);
        let g_big = pseudo_random(big.len(), 60 + s as u32);
        let grads = [("a", &ga[..]), ("b", &gb[..]), ("big", &g_big[..])];
        step_alike(&mut plain, &mut fused, &grads, &format!("step {s}"));
    }
    let cast = |i: usize| {
        bits(
            &plain.params()[i]
                .1
                .as_tensor()
                .to_dtype(DType::BF16)
                .unwrap(),
        )
    };
    // "a": its piece is the whole parameter.
    assert_eq!(bits(&copies[0].1), cast(0));
    assert!(fused.wrote_compute_copy("a"));
    // "b": no piece on this rank; neither it nor its copy moved.
    assert_eq!(bits(&copies[1].1), initial[1]);
    assert!(!fused.wrote_compute_copy("b"));
    // "big": the piece took the new values, the rest kept the initial ones.
    let (got, new) = (bits(&copies[2].1), cast(2));
    assert_eq!(got[1000..2500], new[1000..2500]);
    assert_eq!(got[..1000], initial[2][..1000]);
    assert_eq!(got[2500..], initial[2][2500..]);
    assert_ne!(
        new[1000..2500],
        initial[2][1000..2500],
        "the piece did move"
    );
    assert!(!fused.wrote_compute_copy("big"), "only a piece of it");
}

/// Compute copies that cannot be written from the masters are refused, naming the parameter.
pub(crate) fn compute_copies_that_do_not_fit_are_refused_by_name<R: Conformance>() {
    let mut opt = optimizer(R::stateful(), DType::F32);
    let copy = |shape: usize, dtype| Var::zeros(shape, dtype, &Device::Cpu).unwrap();
    let cases = [
        (("c", copy(5, DType::BF16)), vec!["\"c\"", "no parameter"]),
        (("a", copy(4, DType::BF16)), vec!["\"a\"", "[4]", "[5]"]),
        (
            ("b", copy(3, DType::F32)),
            vec!["\"b\"", "F32", "not BF16 or F16"],
        ),
    ];
    for ((name, var), words) in cases {
        let err = opt
            .set_compute_copies(&[(name.to_string(), var)])
            .unwrap_err()
            .to_string();
        for word in words {
            assert!(err.contains(word), "expected {word:?} in: {err}");
        }
    }
    let mut f64_opt = optimizer(R::stateful(), DType::F64);
    let err = f64_opt
        .set_compute_copies(&[("a".to_string(), copy(5, DType::BF16))])
        .unwrap_err()
        .to_string();
    assert!(err.contains("\"a\"") && err.contains("F64"), "{err}");
    // A parameter that is its own compute copy (kept in f32) needs nothing written.
    let own = opt.params()[0].clone();
    opt.set_compute_copies(&[own]).unwrap();
    run(&mut opt, 0..1);
    assert!(!opt.wrote_compute_copy("a"));
}

/// The multi-tensor CUDA kernel against the CPU update, bit for bit: every configuration, two
/// parameter groups, a parameter of several chunks, no compute copy, bf16 and f16 copies; one
/// launch per step, with no tensor-op fallback, and the tensor table uploaded once. As in the
/// runtime, every tensor is on one device (one `Device::new_cuda` for the test) and the gradient
/// buffers are made once and zeroed between steps.
#[cfg(feature = "cuda")]
pub(crate) fn the_cuda_kernel_matches_the_cpu_kernel<R: Conformance>() {
    use super::multi_tensor::CHUNK;
    use super::test_util::{cuda_buffers, cuda_device, cuda_refill, on_cuda};
    let cuda = cuda_device();
    let big = pseudo_random(2 * CHUNK as usize + 1001, 3);
    for (what, config) in R::configs() {
        for dtype in [None, Some(DType::BF16), Some(DType::F16)] {
            let label = format!("{}, {what}, copies {dtype:?}", R::NAME);
            let mut cpu = copy_groups(config.clone(), &big);
            let groups: Vec<ParamGroup<R>> = cpu
                .group_params()
                .iter()
                .zip(cpu.group_configs())
                .map(|(names, config)| {
                    let params: Vec<_> = cpu
                        .params()
                        .iter()
                        .filter(|(n, _)| names.contains(&n.as_str()))
                        .cloned()
                        .collect();
                    ParamGroup::new(on_cuda(&params, &cuda), config)
                })
                .collect();
            let mut gpu = ElementwiseOptimizer::with_groups(groups).unwrap();
            assert!(
                gpu.params()
                    .iter()
                    .all(|(_, v)| v.device().same_device(&cuda)),
                "{label}: every parameter on the test's one device"
            );
            let mut gpu_grads = cuda_buffers(gpu.params());
            let copies =
                dtype.map(|d| (zero_copies(cpu.params(), d), zero_copies(gpu.params(), d)));
            if let Some((cpu_copies, gpu_copies)) = &copies {
                cpu.set_compute_copies(cpu_copies).unwrap();
                gpu.set_compute_copies(gpu_copies).unwrap();
            }
            for s in 0..5 {
                let grads = two_group_grads(s, big.len());
                let grads: Vec<(&str, &[f64])> =
                    grads.iter().map(|(n, g)| (*n, g.as_slice())).collect();
                cpu.step(buffers(cpu.params(), &grads).gradients()).unwrap();
                cuda_refill(&mut gpu_grads, gpu.params(), &grads);
                gpu.step(gpu_grads.gradients()).unwrap();
            }
            assert_eq!(
                gpu.fallback_updates, 0,
                "{label}: every update took the kernel"
            );
            assert_eq!(gpu.cuda.launches(), 5, "{label}: one launch per step");
            assert_eq!(gpu.cuda.uploads(), 1, "{label}: the table was reused");
            for ((name, c), (_, g)) in cpu.params().iter().zip(gpu.params()) {
                assert_eq!(bits(g), bits(c), "{label}: master {name}");
            }
            assert_eq!(
                contents(&gpu.state().unwrap()),
                contents(&cpu.state().unwrap()),
                "{label}: state"
            );
            if let Some((cpu_copies, gpu_copies)) = &copies {
                for ((name, c), (_, g)) in cpu_copies.iter().zip(gpu_copies) {
                    assert_eq!(bits(g), bits(c), "{label}: copy {name}");
                    assert_eq!(gpu.wrote_compute_copy(name), name != "idle", "{label}");
                }
            }
        }
    }
}

/// Implements [`Conformance`] for `$rule` from its tables (each configuration the default as one
/// edit leaves it) and its f64 `reference`, and adds one `#[test]` per check of the suite in a module
/// `conformance` of the caller's.
macro_rules! suite {
    (
        $rule:ident, tolerance: (f32 $f32:expr, f64 $f64:expr), reference: $reference:path,
        configs: [$($configs:tt)*],
        stateful: $stateful:expr,
        refused: [$($refused:tt)*] $(,)?
    ) => {
        impl crate::optim::conformance::Conformance for $rule {
            const F32_TOLERANCE: f64 = $f32;
            const F64_TOLERANCE: f64 = $f64;

            fn configs() -> Vec<(&'static str, Self)> {
                crate::optim::conformance::variants(&[$($configs)*])
            }

            fn stateful() -> Self {
                crate::optim::conformance::with($stateful)
            }

            fn invalid_configs() -> Vec<(Self, &'static str)> {
                crate::optim::conformance::refused(&[$($refused)*])
            }

            fn reference(c: Self, p: Vec<f64>) -> crate::optim::conformance::Reference {
                $reference(c, p)
            }
        }

        crate::optim::conformance::suite!(@tests crate::optim::$rule);
    };
    (@tests $rule:ty) => {
        mod conformance {
            use crate::optim::conformance as suite;

            #[test]
            fn the_fused_path_matches_the_formula() {
                suite::the_fused_path_matches_the_formula::<$rule>();
            }

            #[test]
            fn the_tensor_op_path_matches_the_formula() {
                suite::the_tensor_op_path_matches_the_formula::<$rule>();
            }

            #[test]
            fn the_fused_and_tensor_op_paths_agree_on_f32() {
                suite::the_fused_and_tensor_op_paths_agree_on_f32::<$rule>();
            }

            #[test]
            fn a_parameter_split_over_threads_equals_the_unsplit_update() {
                suite::a_parameter_split_over_threads_equals_the_unsplit_update::<$rule>();
            }

            #[test]
            fn a_parameter_without_gradient_is_untouched_and_gets_no_state() {
                suite::a_parameter_without_gradient_is_untouched_and_gets_no_state::<$rule>();
            }

            #[test]
            fn the_learning_rate_is_read_at_every_step() {
                suite::the_learning_rate_is_read_at_every_step::<$rule>();
            }

            #[test]
            fn a_bad_learning_rate_or_gradient_is_refused() {
                suite::a_bad_learning_rate_or_gradient_is_refused::<$rule>();
            }

            #[test]
            fn invalid_hyper_parameters_and_parameter_lists_are_refused() {
                suite::invalid_hyper_parameters_and_parameter_lists_are_refused::<$rule>();
            }

            #[test]
            fn a_state_round_trip_continues_identically() {
                suite::a_state_round_trip_continues_identically::<$rule>();
            }

            #[test]
            fn each_group_follows_the_formula_with_its_own_hyper_parameters() {
                suite::each_group_follows_the_formula_with_its_own_hyper_parameters::<$rule>();
            }

            #[test]
            fn a_parameter_in_two_groups_is_refused_by_name() {
                suite::a_parameter_in_two_groups_is_refused_by_name::<$rule>();
            }

            #[test]
            fn a_state_of_two_groups_round_trips_and_other_groups_are_refused() {
                suite::a_state_of_two_groups_round_trips_and_other_groups_are_refused::<$rule>();
            }

            #[test]
            fn mismatched_states_are_refused_and_nothing_is_loaded() {
                suite::mismatched_states_are_refused_and_nothing_is_loaded::<$rule>();
            }

            #[test]
            fn the_compute_copy_is_the_cast_of_the_updated_master() {
                suite::the_compute_copy_is_the_cast_of_the_updated_master::<$rule>();
            }

            #[test]
            fn a_zero_piece_writes_only_its_piece_of_the_compute_copy() {
                suite::a_zero_piece_writes_only_its_piece_of_the_compute_copy::<$rule>();
            }

            #[test]
            fn compute_copies_that_do_not_fit_are_refused_by_name() {
                suite::compute_copies_that_do_not_fit_are_refused_by_name::<$rule>();
            }

            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a GPU (scripts/gpu-build.sh build, then run on a GPU machine)"]
            fn the_cuda_kernel_matches_the_cpu_kernel_bitwise_in_one_launch_per_step() {
                suite::the_cuda_kernel_matches_the_cpu_kernel::<$rule>();
            }
        }
    };
}

pub(crate) use suite;
