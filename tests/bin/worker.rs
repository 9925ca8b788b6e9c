//! A worker program for the multi-process tests, started by `accelerate-launch`. Its first
//! argument picks a scenario; each checks what it can against values computed in closed form and
//! prints one `result: ...` line (on the main process) or exits non-zero with the reason.

use std::sync::Arc;

use accelerate_core::data::{DataLoader, TensorDataset};
use accelerate_core::{Accelerator, ReduceOp};
use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::{VarBuilder, VarMap};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("gather") => gather(&args[1..]),
        Some("mismatch") => mismatch(),
        Some("collectives") => collectives(),
        Some("allreduce") => allreduce(),
        Some("nosync") => nosync(),
        Some("flaky") => flaky(),
        Some("mixed") => mixed(),
        Some("stall") => stall(),
        Some("busy-first") => busy_first(&args[1..]),
        Some("dead-peer") => dead_peer(&args[1..]),
        Some("tiny_train") => tiny_train(&args[1..]),
        Some("device_stall") => device_stall(),
        Some("loader-mismatch") => loader_mismatch(&args[1..]),
        Some("gather-after-loop") => gather_after_loop(),
        Some("conformance") => conformance(),
        Some("log") => log(&args[1..]),
        other => Err(anyhow!(
            "unknown scenario {other:?}; use gather, mismatch, collectives, allreduce, nosync, \
             flaky, mixed, stall, busy-first, dead-peer, tiny_train, device_stall, \
             loader-mismatch, gather-after-loop, conformance or log"
        )),
    };
    if let Err(e) = result {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn arg(args: &[String], i: usize, default: usize) -> usize {
    args.get(i).and_then(|a| a.parse().ok()).unwrap_or(default)
}

/// Iterates one epoch of a dataset whose samples are their own indices and gathers them.
fn gather(args: &[String]) -> Result<()> {
    let (samples, batch, shuffle) = (arg(args, 0, 10), arg(args, 1, 3), arg(args, 2, 1) == 1);
    let mut acc = Accelerator::new()?;
    let x = Tensor::arange(0f32, samples as f32, &Device::Cpu)?;
    let y = Tensor::zeros(samples, DType::U32, &Device::Cpu)?;
    let dataset = Arc::new(TensorDataset::new(x, y)?);
    let mut loader = acc.prepare(DataLoader::new(dataset, batch).shuffle(shuffle).seed(3))?;
    let mut seen = Vec::new();
    for b in loader.iter() {
        let (x, _) = b?;
        let all = acc.gather_for_metrics(&x)?;
        seen.extend(all.to_vec1::<f32>()?);
    }
    let raw: usize = loader.len() * batch * acc.num_processes();
    acc.print(format!(
        "result: {}",
        serde_json::json!({"gathered": seen, "raw_rows": raw})
    ));
    Ok(())
}

/// Rank 1 builds a layer of another shape than rank 0's: `prepare` must refuse on every rank.
fn mismatch() -> Result<()> {
    let mut acc = Accelerator::new()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let out = if acc.process_index() == 1 { 2 } else { 3 };
    candle_nn::linear(4, out, vb.pp("l1"))?;
    match acc.prepare(&varmap) {
        Ok(_) => Err(anyhow!(
            "prepare accepted different parameters on different ranks"
        )),
        Err(e) => Err(e.into()),
    }
}

/// reduce, gather, pad, split and broadcast of parameters against closed forms.
fn collectives() -> Result<()> {
    let mut acc = Accelerator::new()?;
    let (r, n) = (acc.process_index(), acc.num_processes());
    let check = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(anyhow!("rank {r}: {what}"))
        }
    };

    // reduce: sum of (rank + 1) over ranks is n(n+1)/2; max is n; mean is (n+1)/2.
    let t = Tensor::new(&[(r + 1) as f32, 1.0], &Device::Cpu)?;
    let sum = acc.reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?;
    check(
        sum == vec![(n * (n + 1) / 2) as f32, n as f32],
        "reduce sum",
    )?;
    let max = acc.reduce(&t, ReduceOp::Max)?.to_vec1::<f32>()?;
    check(max[0] == n as f32, "reduce max")?;
    let mean = acc.reduce(&t, ReduceOp::Mean)?.to_vec1::<f32>()?;
    check((mean[0] - (n + 1) as f32 / 2.0).abs() < 1e-6, "reduce mean")?;

    // gather: rank order.
    let g = acc.gather(&Tensor::new(&[r as i64], &Device::Cpu)?)?;
    check(
        g.to_vec1::<i64>()? == (0..n as i64).collect::<Vec<_>>(),
        "gather",
    )?;

    // pad: rank r has r + 1 rows; all end with n rows, padded with -1.
    let rows = Tensor::ones((r + 1, 2), DType::F32, &Device::Cpu)?;
    let padded = acc.pad_across_processes(&rows, 0, -1.0)?;
    check(padded.dims() == [n, 2], "pad shape")?;
    let pv = padded.to_vec2::<f32>()?;
    check(
        pv.iter()
            .enumerate()
            .all(|(i, row)| row.iter().all(|&v| v == if i <= r { 1.0 } else { -1.0 })),
        "pad values",
    )?;

    // split: 10 items over n ranks, contiguous, sizes differ by at most one, all covered.
    let items: Vec<usize> = (0..10).collect();
    let mine = acc.split_between_processes(&items);
    let counts = acc
        .gather(
            &Tensor::new(
                &[mine.len() as i64, *mine.first().unwrap_or(&0) as i64],
                &Device::Cpu,
            )?
            .unsqueeze(0)?,
        )?
        .to_vec2::<i64>()?;
    let total: i64 = counts.iter().map(|c| c[0]).sum();
    check(total == 10, "split covers every item once")?;
    check(
        counts.windows(2).all(|w| w[1][1] == w[0][1] + w[0][0]),
        "split is contiguous in rank order",
    )?;

    // prepare: every rank starts from rank 0's parameters.
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    candle_nn::linear(3, 2, vb.pp("l"))?;
    {
        let data = varmap.data().lock().unwrap();
        for (name, var) in data.iter() {
            let fill = if name.ends_with("weight") {
                r as f32 + 1.0
            } else {
                -(r as f32) - 1.0
            };
            var.set(&(var.ones_like()? * fill as f64)?)?;
        }
    }
    let params = acc.prepare(&varmap)?;
    for (name, var) in &params {
        let want = if name.ends_with("weight") { 1.0 } else { -1.0 };
        let v = var.flatten_all()?.to_vec1::<f32>()?;
        check(
            v.iter().all(|&x| x == want),
            "parameters broadcast from rank 0",
        )?;
    }
    // main_process_first: rank 0 creates a marker file; every other rank must already see it.
    let marker = std::env::temp_dir().join(format!(
        "accelerate-test-main-first-{}",
        std::env::var("ACCELERATE_JOB_TOKEN").unwrap_or_default()
    ));
    let seen = acc.main_process_first(|| {
        if r == 0 {
            std::fs::write(&marker, b"first").is_ok()
        } else {
            marker.exists()
        }
    })?;
    check(seen, "main_process_first ran the main process first")?;
    acc.wait_for_everyone()?;
    if r == 0 {
        let _ = std::fs::remove_file(&marker);
    }
    acc.print("result: ok");
    Ok(())
}

/// All-reduce of values given by a formula of (rank, index), against the formula's sum, mean and
/// max over ranks computed directly; lengths 0, 1, one not divisible by the world size, and one
/// larger than a transport chunk (512 KiB).
fn allreduce() -> Result<()> {
    let acc = Accelerator::new()?;
    let (r, n) = (acc.process_index(), acc.num_processes());
    let value = |rank: usize, i: usize| ((rank * 7 + i * 3) % 11) as i64 - 5;
    for len in [0usize, 1, 2 * n + 1, 300_007] {
        let mine: Vec<i64> = (0..len).map(|i| value(r, i)).collect();
        let sum: Vec<i64> = (0..len)
            .map(|i| (0..n).map(|k| value(k, i)).sum())
            .collect();
        let max: Vec<i64> = (0..len)
            .map(|i| (0..n).map(|k| value(k, i)).max().unwrap())
            .collect();
        // i64 exactly; f64 and f32 hold these small integers exactly too. Built and cast on the
        // host, then moved to the accelerator's device (under `--num-gpus` this exercises NCCL):
        // candle's CUDA kernels and allocations refuse empty tensors, so the empty case stays on
        // the host, which the collectives take on every backend.
        let host = Tensor::new(mine.as_slice(), &Device::Cpu)?;
        let on_device = |t: &Tensor| {
            if len == 0 {
                Ok(t.clone())
            } else {
                t.to_device(acc.device())
            }
        };
        let back = |t: Tensor| -> Result<Vec<f64>> {
            Ok(t.to_device(&Device::Cpu)?
                .to_dtype(DType::F64)?
                .to_vec1::<f64>()?)
        };
        let got = acc
            .reduce(&on_device(&host)?, ReduceOp::Sum)?
            .to_device(&Device::Cpu)?
            .to_vec1::<i64>()?;
        if got != sum {
            bail!("rank {r}: i64 sum of length {len} differs");
        }
        for dtype in [DType::F32, DType::F64] {
            let t = on_device(&host.to_dtype(dtype)?)?;
            let got = back(acc.reduce(&t, ReduceOp::Sum)?)?;
            if got.iter().zip(&sum).any(|(g, w)| *g != *w as f64) {
                bail!("rank {r}: {dtype:?} sum of length {len} differs");
            }
            let got = back(acc.reduce(&t, ReduceOp::Max)?)?;
            if got.iter().zip(&max).any(|(g, w)| *g != *w as f64) {
                bail!("rank {r}: {dtype:?} max of length {len} differs");
            }
            let got = back(acc.reduce(&t, ReduceOp::Mean)?)?;
            if got
                .iter()
                .zip(&sum)
                .any(|(g, w)| (*g - *w as f64 / n as f64).abs() > 1e-6)
            {
                bail!("rank {r}: {dtype:?} mean of length {len} differs");
            }
        }
    }
    acc.print("result: ok");
    Ok(())
}

/// Traffic observed around every micro-step with K = 4: nothing is sent on micro-steps that do not
/// sync, gradients are reduced on those that do.
fn nosync() -> Result<()> {
    use accelerate_core::optim::{Sgd, SgdConfig};
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(4)
        .build()?;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu);
    let layer = candle_nn::linear(4, 2, vb.pp("l"))?;
    let params = acc.prepare(&varmap)?;
    let mut opt = acc.prepare(Sgd::new(params, SgdConfig::default())?)?;
    let n = 16 * acc.num_processes();
    let x = Tensor::arange(0f32, (n * 4) as f32, &Device::Cpu)?.reshape((n, 4))?;
    let y = Tensor::zeros(n, DType::U32, &Device::Cpu)?;
    let dataset = Arc::new(TensorDataset::new((x / 100.0)?, y)?);
    let mut loader = acc.prepare(DataLoader::new(dataset, 2))?;
    let (mut quiet, mut synced) = (0, 0);
    for batch in loader.iter() {
        let (x, y) = batch?;
        let before = acc.comm_stats();
        let step = acc.accumulate();
        let loss = candle_nn::loss::cross_entropy(&candle_nn::Module::forward(&layer, &x)?, &y)?;
        acc.backward(&loss)?;
        opt.step()?;
        opt.zero_grad();
        let after = acc.comm_stats();
        if step.sync {
            if after.bytes_sent <= before.bytes_sent || after.all_reduces != before.all_reduces + 1
            {
                bail!("a sync micro-step did not reduce the gradient: {before:?} -> {after:?}");
            }
            synced += 1;
        } else {
            if after != before {
                bail!("a non-sync micro-step communicated: {before:?} -> {after:?}");
            }
            quiet += 1;
        }
    }
    if (quiet, synced) != (6, 2) {
        bail!("expected 6 quiet and 2 sync micro-steps, saw {quiet} and {synced}");
    }
    acc.print("result: ok");
    Ok(())
}

/// Rank 1 joins the job and then dies on the first attempt; on a restart everyone runs the
/// collectives scenario in a fresh store generation.
fn flaky() -> Result<()> {
    let restart = std::env::var("ACCELERATE_RESTART_COUNT").unwrap_or_default();
    if restart == "0" {
        let acc = Accelerator::new()?;
        if acc.process_index() == 1 {
            std::process::exit(3);
        }
        // Rank 0 waits in a collective until the launcher stops it.
        acc.wait_for_everyone()?;
        bail!("rank 0 passed a barrier that rank 1 never reached");
    }
    collectives()
}

/// Trains a small model under the mixed precision the launcher exported (bf16 expected), then
/// checks on every rank: the f32 master weights equal rank 0's bit for bit (gathered), moved from
/// the start, and the compute copies hold the masters rounded to bf16.
fn mixed() -> Result<()> {
    use accelerate_core::optim::{Sgd, SgdConfig};
    use accelerate_core::MixedPrecision;
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(2)
        .build()?;
    let r = acc.process_index();
    if acc.mixed_precision() != MixedPrecision::Bf16 {
        bail!(
            "rank {r}: mixed precision is {}, the launcher was given bf16",
            acc.mixed_precision()
        );
    }
    let varmap = VarMap::new();
    // candle's initialisation is unseeded, so ranks start apart until prepare broadcasts rank 0's.
    let vb = VarBuilder::from_varmap(&varmap, acc.compute_dtype(), &Device::Cpu);
    let l1 = candle_nn::linear(6, 8, vb.pp("l1"))?;
    let l2 = candle_nn::linear(8, 3, vb.pp("l2"))?;
    let params = acc.prepare(&varmap)?;
    let flat = |ps: &[(String, candle_core::Var)]| -> Result<Tensor> {
        let parts: Vec<Tensor> = ps
            .iter()
            .map(|(_, v)| v.as_tensor().flatten_all())
            .collect::<candle_core::Result<_>>()?;
        Ok(Tensor::cat(&parts, 0)?)
    };
    let start = flat(&params)?.to_vec1::<f32>()?;
    let mut opt = acc.prepare(Sgd::new(
        params.clone(),
        SgdConfig {
            lr: 0.1,
            momentum: 0.9,
            ..SgdConfig::default()
        },
    )?)?;
    let n = 48;
    let x: Vec<f32> = (0..n * 6)
        .map(|i| ((i * 37 % 19) as f32 - 9.0) / 9.0)
        .collect();
    let y: Vec<u32> = (0..n).map(|i| (i * 7 % 3) as u32).collect();
    let dataset = TensorDataset::new(
        Tensor::from_vec(x, (n, 6), &Device::Cpu)?,
        Tensor::from_vec(y, n, &Device::Cpu)?,
    )?;
    let mut loader = acc.prepare(DataLoader::new(Arc::new(dataset), 4).shuffle(true).seed(1))?;
    use candle_nn::Module;
    for _ in 0..2 {
        for batch in loader.iter() {
            let (x, y) = batch?;
            let _step = acc.accumulate();
            let h = l1
                .forward(&x.to_dtype(acc.compute_dtype())?)
                .and_then(|h| h.tanh())
                .and_then(|h| l2.forward(&h))
                .and_then(|l| l.to_dtype(DType::F32))?;
            let loss = candle_nn::loss::cross_entropy(&h, &y)?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
    }
    let masters = flat(acc.model().parameters())?;
    if masters.dtype() != DType::F32 {
        bail!("rank {r}: master weights are {:?}", masters.dtype());
    }
    let all = acc.gather(&masters.unsqueeze(0)?)?.to_vec2::<f32>()?;
    let ours = masters.to_vec1::<f32>()?;
    for (q, theirs) in all.iter().enumerate() {
        let same = theirs
            .iter()
            .zip(&ours)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        if !same {
            bail!("rank {r}: rank {q}'s master weights differ from ours");
        }
    }
    if ours == start {
        bail!("rank {r}: training did not move the weights");
    }
    let compute: Vec<(String, candle_core::Var)> = {
        let data = varmap.data().lock().map_err(|e| anyhow!("{e}"))?;
        let mut v: Vec<_> = data.iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    };
    let rounded = masters
        .to_dtype(DType::BF16)
        .and_then(|t| t.to_dtype(DType::F32))
        .and_then(|t| t.to_vec1::<f32>())?;
    let compute = flat(&compute)?
        .to_dtype(DType::F32)
        .and_then(|t| t.to_vec1::<f32>())?;
    if compute != rounded {
        bail!("rank {r}: the bf16 compute copies do not hold the masters rounded");
    }
    acc.print(format!(
        "result: {}",
        serde_json::json!({"identical": true, "steps": acc.optimizer_steps()})
    ));
    Ok(())
}

/// Rank 1 stalls (sleeps far longer than any test waits) before a collective that the other
/// ranks enter: they must give up after `ACCELERATE_COLLECTIVE_TIMEOUT` with an error naming
/// rank 1, and the launcher must stop rank 1.
fn stall() -> Result<()> {
    let acc = Accelerator::new()?;
    if acc.process_index() == 1 {
        std::thread::sleep(std::time::Duration::from_secs(600));
        bail!("rank 1 stalled for 600 s and nobody stopped it");
    }
    let t = Tensor::new(&[1f32], &Device::Cpu)?;
    match acc.reduce(&t, ReduceOp::Sum) {
        Ok(_) => Err(anyhow!(
            "the all-reduce completed although rank 1 never entered it"
        )),
        Err(e) => Err(e.into()),
    }
}

/// `busy-first <ms>`: rank 0 works alone inside `main_process_first` for `ms` milliseconds (the
/// test makes that several times the silence limit) while the others wait in its barrier; then
/// every rank all-reduces `rank + 1`. A busy rank is alive: nobody may give up on it, and the
/// sum is `n (n + 1) / 2`.
fn busy_first(args: &[String]) -> Result<()> {
    let busy = std::time::Duration::from_millis(arg(args, 0, 3000) as u64);
    let acc = Accelerator::new()?;
    acc.main_process_first(|| std::thread::sleep(busy))?;
    let r = acc.process_index();
    let t = Tensor::new(&[(r + 1) as f32], &Device::Cpu)?;
    let sum = acc
        .reduce(&t, ReduceOp::Sum)
        .and_then(|t| Ok(t.to_vec1::<f32>()?))?;
    let n = acc.num_processes();
    if sum != [(n * (n + 1) / 2) as f32] {
        bail!("rank {r}: the sum of rank + 1 is {sum:?}");
    }
    acc.print(format!("result: {}", serde_json::json!({"sum": sum[0]})));
    Ok(())
}

/// `dead-peer <busy> <dead>`: rank `dead` is killed (SIGKILL: no exit handler runs) soon after
/// joining, rank `busy` stays alive outside any collective, the others enter an all-reduce. They
/// cannot complete it and must fail promptly naming rank `dead`, instead of waiting on the busy
/// rank for the busy limit.
fn dead_peer(args: &[String]) -> Result<()> {
    let (busy, dead) = (arg(args, 0, 0), arg(args, 1, 2));
    let acc = Accelerator::new()?;
    let r = acc.process_index();
    if r == dead {
        // Let the others enter the all-reduce first.
        std::thread::sleep(std::time::Duration::from_millis(500));
        let me = std::process::id().to_string();
        let _ = std::process::Command::new("kill")
            .args(["-9", &me])
            .status();
        std::thread::sleep(std::time::Duration::from_secs(600));
        bail!("rank survived kill -9");
    }
    if r == busy {
        std::thread::sleep(std::time::Duration::from_secs(600));
        bail!("rank {r} was busy for 600 s and nobody stopped it");
    }
    let t = Tensor::new(&[1f32], &Device::Cpu)?;
    match acc.reduce(&t, ReduceOp::Sum) {
        Ok(_) => Err(anyhow!(
            "the all-reduce completed although rank {dead} was killed"
        )),
        Err(e) => Err(e.into()),
    }
}

/// Trains the tests' tiny model (`accelerate_tests::tiny_mlp_on`, seed 1) on the accelerator's
/// device (a GPU under `--num-gpus`): AdamW (lr 0.01, weight decay 0.1), K micro-batches of B
/// samples per rank and optimizer step, two epochs of `tiny_data(samples, 2)` shuffled with seed 5.
/// Rank 0 writes the parameters to `out` (safetensors, the `VarMap`'s names) for the test to
/// compare with a one-process reference. Arguments: `out [k=2] [b=4] [samples=160]`. At ZeRO
/// stage 3 (`--zero-stage 3`) the model is built on the host and computes through its units.
fn tiny_train(args: &[String]) -> Result<()> {
    use accelerate_core::optim::{AdamW, AdamWConfig};
    let out = std::path::PathBuf::from(
        args.first()
            .ok_or_else(|| anyhow!("tiny_train needs an output path"))?,
    );
    let (k, b, samples) = (arg(args, 1, 2), arg(args, 2, 4), arg(args, 3, 160));
    let mut acc = Accelerator::builder()
        .gradient_accumulation_steps(k)
        .build()?;
    let device = acc.device().clone();
    // At ZeRO stage 3 the model is built on the host and computes through its two units:
    // `prepare` moves only this rank's pieces to the device.
    let sharded = acc.zero_stage() == 3;
    let build_on = if sharded { Device::Cpu } else { device.clone() };
    let (varmap, model) = accelerate_tests::tiny_mlp_on(1, &build_on)?;
    let (x, y) = accelerate_tests::tiny_data(samples, 2)?;
    let prepared = if sharded {
        acc.prepare_model(
            accelerate_core::Model::from_varmap(&varmap).units(accelerate_tests::tiny_units()),
        )?
    } else {
        // The plain way below stage 3.
        acc.prepare(&varmap)?;
        acc.model().clone()
    };
    let params = prepared.parameters().to_vec();
    let cfg = AdamWConfig {
        lr: 0.01,
        weight_decay: 0.1,
        ..AdamWConfig::default()
    };
    let mut opt = acc.prepare(AdamW::new(params.clone(), cfg)?)?;
    let loader = DataLoader::new(Arc::new(TensorDataset::new(x, y)?), b)
        .shuffle(true)
        .seed(5);
    let mut loader = acc.prepare(loader)?;
    for _ in 0..2 {
        for batch in loader.iter() {
            let (x, y) = batch?;
            if !x.device().same_device(&device) {
                bail!("a batch arrived on {:?}", x.device().location());
            }
            let _step = acc.accumulate();
            let logits = if sharded {
                accelerate_tests::tiny_forward_units(&prepared, &x)?
            } else {
                model.forward(&x)?
            };
            let loss = candle_nn::loss::cross_entropy(&logits, &y)?;
            acc.backward(&loss)?;
            opt.step()?;
            opt.zero_grad();
        }
    }
    // The whole parameters on the main process's host (a collective at stage 3).
    let whole: Vec<(String, Tensor)> = if sharded {
        prepared.whole_parameters_on_main()?
    } else {
        params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect()
    };
    if acc.is_main_process() {
        let host: std::collections::HashMap<String, Tensor> = whole
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?)))
            .collect::<candle_core::Result<_>>()?;
        // Written whole, then renamed: the test never reads a partial file.
        let partial = out.with_extension("partial");
        candle_core::safetensors::save(&host, &partial)?;
        std::fs::rename(&partial, &out).map_err(|e| anyhow!("{}: {e}", out.display()))?;
    }
    acc.wait_for_everyone()?;
    acc.print(format!(
        "result: {}",
        serde_json::json!({
            "optimizer_steps": acc.optimizer_steps(),
            "device": format!("{:?}", device.location()),
            "gathers_ahead": acc.gradient_sync_stats().gathers_ahead,
        })
    ));
    Ok(())
}

/// [`stall`] with the all-reduce on the accelerator's device: under NCCL, rank 0's all-reduce
/// kernel waits for rank 1 on the GPU, and reading its result would block forever, so only the
/// NCCL watchdog (after `ACCELERATE_COLLECTIVE_TIMEOUT`) can end rank 0, with a message naming
/// the collective.
fn device_stall() -> Result<()> {
    let acc = Accelerator::new()?;
    if acc.process_index() == 1 {
        std::thread::sleep(std::time::Duration::from_secs(600));
        bail!("rank 1 stalled for 600 s and nobody stopped it");
    }
    let t = Tensor::new(&[1f32], acc.device())?;
    let summed = acc
        .reduce(&t, ReduceOp::Sum)
        .and_then(|t| Ok(t.to_vec1::<f32>()?))?;
    Err(anyhow!(
        "the all-reduce returned {summed:?} although rank 1 never entered it"
    ))
}

/// Rank 1 builds its data loader with another value of one setting (the argument: `length`,
/// `seed`, `batch`, `shuffle` or `drop-last`) than rank 0: `prepare` must refuse on every rank
/// before the first batch, instead of the ranks mixing windows and waiting for each other.
fn loader_mismatch(args: &[String]) -> Result<()> {
    let mut acc = Accelerator::new()?;
    let differs = acc.process_index() == 1;
    let setting = args.first().map(String::as_str).unwrap_or("seed");
    let pick = |name: &str, usual: usize, other: usize| {
        if differs && setting == name {
            other
        } else {
            usual
        }
    };
    let samples = pick("length", 24, 20);
    let x = Tensor::arange(0f32, samples as f32, &Device::Cpu)?;
    let y = Tensor::zeros(samples, DType::U32, &Device::Cpu)?;
    let dataset = Arc::new(TensorDataset::new(x, y)?);
    let loader = DataLoader::new(dataset, pick("batch", 4, 3))
        .seed(pick("seed", 3, 4) as u64)
        .shuffle(pick("shuffle", 1, 0) == 1)
        .drop_last(pick("drop-last", 0, 1) == 1);
    let mut loader = acc.prepare(loader)?;
    // Reached only if prepare accepted the loaders: a step per batch shows what happens then.
    for batch in loader.iter() {
        let (x, _) = batch?;
        acc.reduce(&x.sum_all()?, ReduceOp::Sum)?;
    }
    Err(anyhow!("prepare accepted a different {setting} on rank 1"))
}

/// 7 samples in batches of 3 on 2 ranks: the last round holds 1 real sample and 5 wrap-around
/// duplicates. Per epoch (one iterated with `iter()`, one with `windows(2)`), gathers each batch
/// inside the loop, then one row per rank after the loop, which must keep both rows.
fn gather_after_loop() -> Result<()> {
    let mut acc = Accelerator::new()?;
    let samples = 7;
    let x = Tensor::arange(0f32, samples as f32, &Device::Cpu)?;
    let y = Tensor::zeros(samples, DType::U32, &Device::Cpu)?;
    let dataset = Arc::new(TensorDataset::new(x, y)?);
    let mut loader = acc.prepare(DataLoader::new(dataset, 3))?;
    let mut epochs = Vec::new();
    for windows in [false, true] {
        let mut in_loop = Vec::new();
        let mut rows_here = 0usize;
        let mut take = |x: &Tensor, acc: &Accelerator| -> Result<()> {
            rows_here += x.dim(0)?;
            let all = acc.gather_for_metrics(x)?;
            in_loop.extend(all.to_vec1::<f32>()?);
            Ok(())
        };
        if windows {
            for window in loader.windows(2) {
                for (x, _) in window? {
                    let _step = acc.accumulate();
                    take(&x, &acc)?;
                }
            }
        } else {
            for batch in loader.iter() {
                take(&batch?.0, &acc)?;
            }
        }
        let mine = Tensor::new(&[rows_here as f32], &Device::Cpu)?;
        let after = acc.gather_for_metrics(&mine)?;
        in_loop.sort_by(f32::total_cmp);
        epochs.push(serde_json::json!({
            "in_loop": in_loop,
            "after_loop": after.to_vec1::<f32>()?,
        }));
    }
    acc.print(format!("result: {}", serde_json::json!(epochs)));
    Ok(())
}

/// The conformance suite of the `Communicator` contract on the communicator this process joins
/// (NCCL under `--num-gpus`, the CPU one under `--cpu`), with tensors on the host and on the
/// process's device. Joins without an `Accelerator`, which would join a second time.
fn conformance() -> Result<()> {
    let state = accelerate_core::ProcessState::from_env()?;
    let device = accelerate_core::select_device(&state)?;
    let membership = accelerate_core::comm::join(&state, &device)?;
    accelerate_tests::conformance_suite::check_communicator(membership.comm.as_ref(), &device)
        .map_err(anyhow::Error::msg)?;
    if state.rank == 0 {
        println!("result: ok");
    }
    Ok(())
}

/// Every rank logs to every tracker in one shared directory (`args[0]`), each its own rank as a
/// metric: only the main process may write, so the files hold rank 0's values alone.
fn log(args: &[String]) -> Result<()> {
    let dir = args
        .first()
        .ok_or_else(|| anyhow!("log needs a logging directory"))?;
    let acc = Accelerator::builder()
        .report_to(accelerate_core::TrackerKind::ALL)
        .logging_dir(dir)
        .build()?;
    let rank = acc.process_index() as f64;
    for step in 1..=3u64 {
        acc.log(
            [
                (accelerate_core::TRAIN_LOSS, 1.0 / step as f64),
                ("rank", rank),
            ],
            step,
        )?;
    }
    acc.end_training()?;
    acc.wait_for_everyone()?;
    acc.print("result: logged");
    Ok(())
}
