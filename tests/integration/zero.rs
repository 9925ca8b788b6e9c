//! ZeRO stages 1 and 2 against plain data parallel (stage 0) and against one process training on
//! the whole global batch with PyTorch's update rules written out (`ReferenceOptimizer`).
//!
//! Ranks are threads of this process (`ranks_as_threads`), over the CPU communicator.

use std::sync::atomic::{AtomicU8, Ordering};

use accelerate_core::optim::{AdamW, AdamWConfig, CandleOptimizer, Sgd, SgdConfig};
use accelerate_core::{Accelerator, ProcessState};
use accelerate_tests::{
    bits, global_batch_reference, max_diff, named_vars, prepared_step, ranks_as_threads, snapshot,
    tiny_data, tiny_mlp, Opt,
};
use candle_core::{Device, Tensor};

const BATCH: usize = 3;
const STEPS: usize = 4;

/// What one run gives: each rank's parameters after training, and the norms `clip_grad_norm`
/// reported at each optimizer step.
type RankResult = (Vec<Vec<f32>>, Vec<f64>);

/// Trains the tiny MLP for `STEPS` optimizer steps on `n` ranks, K micro-batches of `BATCH`, under
/// `stage`; rank r's micro-step j of step s takes samples `s·G + (j·n + r)·BATCH ..` of the global
/// batch of `G = n·K·BATCH`. With `clip`, gradients are clipped to that norm.
fn train(
    n: usize,
    k: usize,
    stage: u8,
    opt: Opt,
    bucket_cap: usize,
    clip: Option<f64>,
) -> Vec<RankResult> {
    let global = n * k * BATCH;
    let (x, y) = tiny_data(global * STEPS, 5).unwrap();
    ranks_as_threads(
        n,
        || {
            Accelerator::builder()
                .gradient_accumulation_steps(k)
                .zero_stage(stage)
                .bucket_cap_bytes(bucket_cap)
        },
        |mut acc| {
            let (varmap, model) = tiny_mlp(3).unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let mut step = prepared_step(&mut acc, params.clone(), opt);
            let rank = acc.process_index();
            let mut norms = Vec::new();
            for s in 0..STEPS {
                for j in 0..k {
                    let start = s * global + (j * n + rank) * BATCH;
                    let _m = acc.accumulate();
                    let logits = model.forward(&x.narrow(0, start, BATCH).unwrap()).unwrap();
                    let loss = candle_nn::loss::cross_entropy(
                        &logits,
                        &y.narrow(0, start, BATCH).unwrap(),
                    )
                    .unwrap();
                    acc.backward(&loss).unwrap();
                    if let Some(max) = clip {
                        if let Some(norm) = acc.clip_grad_norm(max).unwrap() {
                            norms.push(norm);
                        }
                    }
                    step();
                }
            }
            (snapshot(&params), norms)
        },
    )
}

/// One process, the whole global batch per step, PyTorch's rules (`ReferenceOptimizer`).
fn reference(n: usize, k: usize, opt: Opt) -> Vec<Vec<f32>> {
    global_batch_reference(n, k, BATCH, STEPS, opt)
}

/// Stages 1 and 2 on 2 and 3 ranks, K = 1 and 2, SGD with momentum and AdamW, one bucket for the
/// 83 elements and four (a 64-byte cap gives each parameter a bucket of its own, so the pieces cut
/// parameters and the 3-element bias is padded on 2 ranks): every rank ends with the parameters
/// of one process training on the global batch, and stage 1 with stage 0's bits.
#[test]
fn stages_one_and_two_train_as_one_process_on_the_global_batch() {
    for opt in [Opt::SgdMomentum, Opt::AdamW] {
        for n in [2, 3] {
            for k in [1, 2] {
                let expected = reference(n, k, opt);
                let initial = snapshot(&named_vars(&tiny_mlp(3).unwrap().0));
                assert!(
                    max_diff(&expected, &initial) > 1e-2,
                    "training moved the weights"
                );
                for cap in [64, 1 << 20] {
                    let plain = train(n, k, 0, opt, cap, None);
                    for stage in [1, 2] {
                        let ours = train(n, k, stage, opt, cap, None);
                        for (rank, (got, _)) in ours.iter().enumerate() {
                            let d = max_diff(got, &expected);
                            assert!(
                                d < 1e-5,
                                "{opt:?} n={n} k={k} cap={cap} stage {stage} rank {rank}: \
                                 max |Δ| = {d} against one process"
                            );
                            assert_eq!(bits(got), bits(&ours[0].0), "ranks agree bitwise");
                        }
                        if stage == 1 {
                            assert_eq!(
                                bits(&ours[0].0),
                                bits(&plain[0].0),
                                "{opt:?} n={n} k={k} cap={cap}: stage 1 is stage 0 bit for bit"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// At stage 2 each rank holds 1/N of the gradient; `clip_grad_norm` sums the squares across
/// ranks, so it reports stage 0's norm, and the clipped training matches stage 0's.
#[test]
fn clip_grad_norm_at_stage_two_sees_every_shard() {
    for n in [2, 3] {
        let plain = train(n, 2, 0, Opt::AdamW, 64, Some(0.05));
        let sharded = train(n, 2, 2, Opt::AdamW, 64, Some(0.05));
        let (p_norms, s_norms) = (&plain[0].1, &sharded[0].1);
        assert_eq!(p_norms.len(), STEPS);
        for (p, s) in p_norms.iter().zip(s_norms) {
            assert!(*p > 0.05, "the clip acts: norm {p}");
            assert!(
                ((p - s) / p).abs() < 1e-6,
                "n={n}: norm {s} at stage 2, {p} at stage 0"
            );
        }
        for rank in &sharded {
            assert_eq!(&rank.1, s_norms, "every rank reports the same norm");
            let d = max_diff(&rank.0, &plain[0].0);
            assert!(d < 1e-5, "n={n}: clipped stage 2 vs stage 0: {d}");
        }
    }
}

/// Traffic: non-sync micro-steps send nothing at any stage; a stage-2 optimizer step
/// reduce-scatters each bucket once (the same bytes an all-reduce of it would count) and adds one
/// 8-byte agreement, and reads no whole gradient.
#[test]
fn stage_two_reduce_scatters_each_bucket_once_per_step_and_nothing_in_between() {
    let (x, y) = tiny_data(2 * 2 * BATCH, 1).unwrap();
    let per_rank = ranks_as_threads(
        2,
        || {
            Accelerator::builder()
                .gradient_accumulation_steps(2)
                .zero_stage(2)
                .bucket_cap_bytes(64)
        },
        |mut acc| {
            let (varmap, model) = tiny_mlp(3).unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let mut opt = acc
                .prepare(AdamW::new(params, AdamWConfig::default()).unwrap())
                .unwrap();
            let rank = acc.process_index();
            let mut seen = Vec::new();
            for j in 0..2 {
                let start = (j * 2 + rank) * BATCH;
                let _m = acc.accumulate();
                let logits = model.forward(&x.narrow(0, start, BATCH).unwrap()).unwrap();
                let loss =
                    candle_nn::loss::cross_entropy(&logits, &y.narrow(0, start, BATCH).unwrap())
                        .unwrap();
                let before = acc.comm_stats().bytes_sent;
                acc.backward(&loss).unwrap();
                seen.push((
                    acc.comm_stats().bytes_sent - before,
                    acc.gradient_sync_stats(),
                ));
                if j == 1 {
                    let err = acc.model().gradient("l1.weight").unwrap_err().to_string();
                    assert!(err.contains("zero_stage(1)"), "{err}");
                }
                opt.step().unwrap();
                opt.zero_grad();
            }
            (seen, acc.model().gradient_buckets())
        },
    );
    for (seen, buckets) in per_rank {
        assert_eq!(buckets, 4, "a bucket per parameter under a 64-byte cap");
        assert_eq!(seen[0].0, 0, "the non-sync micro-step sends nothing");
        assert_eq!(seen[0].1.reduce_scatters, 0);
        let stats = seen[1].1;
        assert_eq!(stats.reduce_scatters, 4);
        assert_eq!(stats.all_reduces, 1, "the one agreement");
        // Buckets of 8, 48, 3 and 24 elements, each padded to a multiple of 2 ranks, and the
        // agreement's two f32 flags.
        assert_eq!(stats.bytes, (8 + 48 + 4 + 24) * 4 + 8, "{stats:?}");
        // A ring reduce-scatter sends half of each padded bucket to the peer (the agreement
        // sends its own few bytes).
        assert!(seen[1].0 >= (8 + 48 + 4 + 24) * 4 / 2, "{:?}", seen[1]);
    }
}

/// A candle-nn optimizer keeps its state private: under ZeRO it is refused at `prepare`, naming
/// the optimizers that can be sharded; a stage that does not exist, and ranks on different stages,
/// are refused too.
#[test]
fn what_cannot_be_sharded_is_refused_by_name() {
    let errs = ranks_as_threads(
        1,
        || Accelerator::builder().zero_stage(1),
        |mut acc| {
            let (varmap, _) = tiny_mlp(3).unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let opt = CandleOptimizer::<candle_nn::SGD>::new(params, 0.1).unwrap();
            acc.prepare(opt).err().map(|e| e.to_string())
        },
    );
    let err = errs[0].clone().expect("refused");
    assert!(
        err.contains("zero_stage(1)") && err.contains("AdamW"),
        "{err}"
    );

    let err = Accelerator::builder()
        .zero_stage(4)
        .process_state(ProcessState::single())
        .build()
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("stage 4 does not exist") && err.contains("3 (parameters sharded too)"),
        "{err}"
    );

    // The first rank to build gets stage 0, the other stage 1: both are told at prepare, by name.
    let built = AtomicU8::new(0);
    let errs = ranks_as_threads(
        2,
        || Accelerator::builder().zero_stage(built.fetch_add(1, Ordering::SeqCst).min(1)),
        |mut acc| {
            let (varmap, _) = tiny_mlp(3).unwrap();
            acc.prepare(&varmap).map(|_| ()).unwrap_err().to_string()
        },
    );
    for err in errs {
        assert!(
            err.contains("ZeRO stage") && err.contains("ACCELERATE_ZERO_STAGE"),
            "{err}"
        );
    }
}

/// fp16 at stage 2: only rank 1's gradient overflows, in elements whose averaged gradient only
/// rank 0 keeps. Every rank must still see it and skip the step alike (a rank stepping alone would
/// wait in the parameter all-gather forever), the loss scale halves everywhere, nothing moves;
/// the next, finite step updates every rank alike.
#[test]
fn an_fp16_overflow_in_one_ranks_block_skips_the_step_on_every_rank() {
    use accelerate_core::MixedPrecision;
    use candle_nn::{VarBuilder, VarMap};
    let per_rank = ranks_as_threads(
        2,
        || {
            Accelerator::builder()
                .zero_stage(2)
                .mixed_precision(MixedPrecision::Fp16)
        },
        |mut acc| {
            let varmap = VarMap::new();
            let vb = VarBuilder::from_varmap(&varmap, acc.compute_dtype(), &Device::Cpu);
            let w = vb
                .get_with_hints(8, "w", candle_nn::Init::Const(0.5))
                .unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let cfg = SgdConfig {
                lr: 0.1,
                ..SgdConfig::default()
            };
            let mut opt = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
            let rank = acc.process_index();
            let initial = snapshot(&params);
            let mut train_on = |x: Vec<f32>| {
                let x = Tensor::new(x.as_slice(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(acc.compute_dtype())
                    .unwrap();
                let _m = acc.accumulate();
                let loss = (&w * &x)
                    .unwrap()
                    .to_dtype(candle_core::DType::F32)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                acc.backward(&loss).unwrap();
                opt.step().unwrap();
                opt.zero_grad();
            };
            // Rank 1's gradient of w·x at elements 0..4 (rank 0's block) is 1e4 · 2^16: beyond
            // f16's 65504, so inf in the backward pass; rank 0's is small everywhere.
            let big = if rank == 1 { 1e4f32 } else { 0.5 };
            train_on((0..8).map(|i| if i < 4 { big } else { 0.25 }).collect());
            let skipped = (acc.step_was_skipped(), acc.loss_scale(), snapshot(&params));
            // A finite step: x = 0.25 everywhere on both ranks, so every element moves by -0.025.
            train_on(vec![0.25; 8]);
            (initial, skipped, acc.step_was_skipped(), snapshot(&params))
        },
    );
    for (rank, (initial, (skipped, scale, after_skip), skipped_again, after)) in
        per_rank.into_iter().enumerate()
    {
        assert!(skipped, "rank {rank} skipped the overflowing step");
        assert_eq!(scale, Some(32768.0), "rank {rank}: the scale halved");
        assert_eq!(after_skip, initial, "rank {rank}: nothing moved");
        assert!(!skipped_again);
        for v in after.iter().flatten() {
            assert!((v - (0.5 - 0.1 * 0.25)).abs() < 1e-6, "rank {rank}: {v}");
        }
    }
}

/// A reduced gradient dtype at stage 2: the bucket is reduce-scattered in bf16 and widened into
/// the f32 block, so one SGD step (lr 1) moves each weight by the bf16-rounded mean of the two
/// ranks' gradients, as stage 0's compressed all-reduce does.
#[test]
fn stage_two_reduces_in_the_configured_dtype() {
    use candle_nn::{VarBuilder, VarMap};
    let xs: [Vec<f32>; 2] = [
        (0..300).map(|i| (i as f32 * 0.731).sin() * 3.0).collect(),
        (0..300)
            .map(|i| (i as f32 * 1.377).cos() * 0.01 + 1.0)
            .collect(),
    ];
    let run = |stage: u8, dtype: candle_core::DType| {
        ranks_as_threads(
            2,
            || {
                Accelerator::builder()
                    .zero_stage(stage)
                    .gradient_reduce_dtype(dtype)
            },
            |mut acc| {
                let varmap = VarMap::new();
                let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
                let w = vb
                    .get_with_hints(300, "w", candle_nn::Init::Const(0.0))
                    .unwrap();
                let params = acc.prepare(&varmap).unwrap();
                let cfg = SgdConfig {
                    lr: 1.0,
                    ..SgdConfig::default()
                };
                let mut opt = acc.prepare(Sgd::new(params.clone(), cfg).unwrap()).unwrap();
                let x = Tensor::new(xs[acc.process_index()].as_slice(), &Device::Cpu).unwrap();
                let _m = acc.accumulate();
                acc.backward(&(&w * &x).unwrap().sum_all().unwrap())
                    .unwrap();
                opt.step().unwrap();
                snapshot(&params).concat()
            },
        )
    };
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    let compressed = run(2, candle_core::DType::BF16);
    let exact = run(2, candle_core::DType::F32);
    assert_eq!(compressed[0], compressed[1], "the ranks agree");
    for (i, (&a, &b)) in xs[0].iter().zip(&xs[1]).enumerate() {
        // w = 0 - mean gradient; the gradient of Σ w·x is x.
        assert_eq!(exact[0][i], -((a + b) / 2.0), "f32 mean at {i}");
        let want = -(bf(bf(a) + bf(b)) / 2.0);
        assert!(
            (compressed[0][i] - want).abs() <= want.abs() * 8e-3,
            "bf16 mean at {i}: {} vs {want}",
            compressed[0][i]
        );
    }
    assert_ne!(exact[0], compressed[0], "the rounding is visible");
    assert_eq!(
        compressed,
        run(0, candle_core::DType::BF16),
        "as stage 0 rounds"
    );
}

/// Mixed precision under ZeRO: each rank's optimizer writes the compute copies of its own pieces
/// in the update's pass, and the runtime casts every copy the step did not write whole after the
/// all-gather. Stages 1 and 2 on 2 ranks, bf16, AdamW, a bucket per parameter (pieces cut
/// parameters) and one bucket for all: every rank ends with bitwise the masters and compute
/// copies of the same run whose runtime cast every master after each step.
#[test]
fn under_bf16_the_compute_copies_written_by_the_update_equal_a_cast_after_every_step() {
    use accelerate_core::optim::Optimizer;
    use accelerate_core::MixedPrecision;
    use accelerate_tests::{tensor_bits, CopiesOrCast};
    use candle_nn::{Module, VarBuilder, VarMap};
    let run = |stage: u8, cap: usize, keep_copies: bool| {
        let (x, y) = tiny_data(2 * BATCH * STEPS, 5).unwrap();
        ranks_as_threads(
            2,
            || {
                Accelerator::builder()
                    .zero_stage(stage)
                    .bucket_cap_bytes(cap)
                    .mixed_precision(MixedPrecision::Bf16)
            },
            |mut acc| {
                // The tiny MLP's seeded weights, rounded into a bf16 model.
                let (f32_map, _) = tiny_mlp(3).unwrap();
                let varmap = VarMap::new();
                let vb = VarBuilder::from_varmap(&varmap, acc.compute_dtype(), &Device::Cpu);
                let l1 = candle_nn::linear(6, 8, vb.pp("l1")).unwrap();
                let l2 = candle_nn::linear(8, 3, vb.pp("l2")).unwrap();
                for ((_, from), (_, to)) in named_vars(&f32_map).iter().zip(named_vars(&varmap)) {
                    to.set(&from.as_tensor().to_dtype(to.dtype()).unwrap())
                        .unwrap();
                }
                let params = acc.prepare(&varmap).unwrap();
                let cfg = AdamWConfig {
                    lr: 0.02,
                    weight_decay: 0.1,
                    ..AdamWConfig::default()
                };
                let inner = Box::new(AdamW::new(params.clone(), cfg).unwrap());
                let mut opt = acc.prepare(CopiesOrCast { inner, keep_copies }).unwrap();
                let rank = acc.process_index();
                for s in 0..STEPS {
                    let start = (2 * s + rank) * BATCH;
                    let _m = acc.accumulate();
                    let x = x
                        .narrow(0, start, BATCH)
                        .unwrap()
                        .to_dtype(acc.compute_dtype())
                        .unwrap();
                    let logits = l2
                        .forward(&l1.forward(&x).unwrap().tanh().unwrap())
                        .unwrap();
                    let logits = logits.to_dtype(candle_core::DType::F32).unwrap();
                    let loss = candle_nn::loss::cross_entropy(
                        &logits,
                        &y.narrow(0, start, BATCH).unwrap(),
                    )
                    .unwrap();
                    acc.backward(&loss).unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                }
                // Where this rank's piece is a whole parameter, the update wrote its copy; the
                // others were cast after the all-gather. A bucket per parameter cuts each in
                // two; one bucket of all 83 elements leaves l1.bias whole on rank 0, l2.bias and
                // l2.weight on rank 1.
                let wrote = params
                    .iter()
                    .filter(|(name, _)| opt.with_inner(|o| o.wrote_compute_copy(name)).unwrap())
                    .count();
                let whole = match (keep_copies, cap > 64, rank) {
                    (true, true, 0) => 1,
                    (true, true, _) => 2,
                    _ => 0,
                };
                assert_eq!(wrote, whole, "rank {rank}: copies written whole");
                let bits_of = |vars: &[(String, candle_core::Var)]| {
                    vars.iter().map(|(_, v)| tensor_bits(v)).collect::<Vec<_>>()
                };
                (bits_of(&params), bits_of(&named_vars(&varmap)))
            },
        )
    };
    for stage in [1, 2] {
        for cap in [64, 1 << 20] {
            let cast = run(stage, cap, false);
            let written = run(stage, cap, true);
            let initial: Vec<Vec<u32>> = named_vars(&tiny_mlp(3).unwrap().0)
                .iter()
                .map(|(_, v)| {
                    tensor_bits(&v.as_tensor().to_dtype(candle_core::DType::BF16).unwrap())
                })
                .collect();
            assert_ne!(written[0].1, initial, "training moved the compute copies");
            for (rank, (w, c)) in written.iter().zip(&cast).enumerate() {
                assert_eq!(w, c, "stage {stage}, cap {cap}, rank {rank}");
                assert_eq!(w, &written[0], "ranks agree");
            }
        }
    }
}
