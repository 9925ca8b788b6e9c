//! Tests that need a GPU. Without the `nccl` feature they are listed as ignored; in a `nccl` build
//! on a machine without a usable GPU each prints `skipped: ...` and passes; tests that need more
//! GPUs than the machine has say so the same way.
//!
//! On a GPU machine: `cargo test --release -p accelerate-tests --features nccl --test integration
//! gpu:: -- --test-threads=1` (or build with `scripts/gpu-build.sh build` elsewhere and run the
//! binary there; docs/src/gpus.md, "GPU tests"). They take the GPU one at a time whatever the number of
//! test threads.
//!
//! The multi-rank tests put two NCCL ranks on one GPU with the launcher's testing switch
//! `--num-gpus 1 --ranks-per-gpu 2` (each rank gets its own `NCCL_HOSTID`, so NCCL connects them
//! over sockets instead of refusing a duplicate GPU); they need one GPU.

#![cfg_attr(not(feature = "nccl"), allow(dead_code, unused_imports))]

const NEEDS: &str = "needs a GPU and --features nccl (docs/src/gpus.md, GPU tests)";

/// One `#[test]` per GPU test body in `on_gpu`: ignored (with the reason) without the `nccl`
/// feature, run otherwise.
macro_rules! gpu_tests {
    ($($name:ident),* $(,)?) => {$(
        #[test]
        #[cfg_attr(
            not(feature = "nccl"),
            ignore = "needs a GPU and --features nccl (docs/src/gpus.md, GPU tests)"
        )]
        fn $name() {
            #[cfg(feature = "nccl")]
            {
                let _gpu = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
                on_gpu::$name();
            }
        }
    )*};
}

/// Held by each GPU test while it runs: their ranks would compete for the one GPU (memory, NCCL's
/// connections) if libtest ran them side by side in this binary's threads.
#[cfg(feature = "nccl")]
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

gpu_tests!(
    nccl_collectives_on_one_gpu_match_the_host,
    nccl_all_reduce_across_gpus_matches_the_formula,
    k_micro_batches_on_the_gpu_equal_one_big_batch_on_the_cpu,
    the_mlp_example_trains_on_every_gpu_under_the_launcher,
    mixed_precision_on_the_gpu_tracks_full_precision,
    two_nccl_ranks_on_one_gpu_with_k2_equal_one_process_with_the_global_batch,
    gpt_on_two_nccl_ranks_with_item_weighted_accumulation_equals_one_rank,
    a_killed_nccl_rank_restarts_and_ends_bitwise_like_an_uninterrupted_run,
    a_stalled_nccl_rank_is_ended_by_the_watchdog_naming_the_collective,
    prefetched_batches_are_complete_when_the_training_thread_reads_them,
    gpt_at_zero_stage_three_on_two_nccl_ranks_equals_stage_zero,
    a_host_built_model_at_stage_three_on_two_nccl_ranks_equals_one_process,
);

#[cfg(feature = "nccl")]
mod on_gpu {
    use std::collections::BTreeMap;
    use std::io::Read;
    use std::sync::Arc;
    use std::time::Duration;

    use accelerate_core::comm::{Communicator, NcclCommunicator, StoreServer, TcpStoreClient};
    use accelerate_core::data::{DataLoader, Dataset, TensorDataset};
    use accelerate_core::optim::{AdamW, AdamWConfig};
    use accelerate_core::{Accelerator, ProcessState, ReduceOp};
    use accelerate_tests::{
        kill_rank_once_checkpointed, load_flat, max_abs_diff, max_abs_diff_flat, named_vars,
        output_text, restart_mlp_args, skip, summary_value, tiny_data, tiny_mlp, tiny_mlp_on, Job,
        ReferenceOptimizer,
    };
    use candle_core::{DType, Device, Tensor, Var};

    use super::NEEDS;

    fn gpu() -> Option<Device> {
        match Device::new_cuda(0) {
            Ok(d) => Some(d),
            Err(e) => {
                skip(format_args!("no usable GPU ({e}); this test {NEEDS}"));
                None
            }
        }
    }

    fn visible_gpus() -> usize {
        candle_core::cuda_backend::cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize
    }

    pub fn nccl_collectives_on_one_gpu_match_the_host() {
        let Some(device) = gpu() else { return };
        let server = StoreServer::start("127.0.0.1:0".parse().unwrap(), "t".into(), 0).unwrap();
        let timeout = Duration::from_secs(30);
        let store = TcpStoreClient::connect(server.local_addr(), "t", 0, 0, timeout).unwrap();
        let comm = NcclCommunicator::connect(Arc::new(store), &device, 0, 1, timeout).unwrap();
        assert_eq!((comm.rank(), comm.world_size()), (0, 1));

        let host: Vec<f32> = (0..40).map(|i| i as f32 * 0.5 - 7.0).collect();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let base = Tensor::new(host.as_slice(), &device)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            // A view with an offset: the collective must touch exactly its elements.
            let view = base.narrow(0, 10, 20).unwrap();
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                comm.all_reduce(&view, op).unwrap();
            }
            comm.broadcast(&view, 0).unwrap();
            let back: Vec<f32> = base.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
            // One rank: every reduction is the identity; the values (exact in every dtype:
            // multiples of 0.5 below 16) must come back unchanged, neighbours included.
            assert_eq!(back, host, "{dtype:?}");
            let gathered: Vec<f32> = comm
                .all_gather(&view)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1()
                .unwrap();
            assert_eq!(gathered, host[10..30].to_vec(), "{dtype:?} all_gather");
        }
        // Integers: Sum and Mean (a sum, then a division truncated toward zero) both work.
        let ints = Tensor::new(&[3i64, -4, 5], &device).unwrap();
        comm.all_reduce(&ints, ReduceOp::Sum).unwrap();
        comm.all_reduce(&ints, ReduceOp::Mean).unwrap();
        assert_eq!(ints.to_vec1::<i64>().unwrap(), vec![3, -4, 5]);
        // A host tensor is staged through the GPU (the contract on `Communicator`): the result
        // lands in the host tensor itself, a view's neighbours untouched, and a gather of a host
        // tensor comes back on the host. (The conformance suite checks the values on 2 ranks.)
        let host_buffer = Tensor::new(&[9f32, 1.5, -2.0, 9.0], &Device::Cpu).unwrap();
        let host_view = host_buffer.narrow(0, 1, 2).unwrap();
        comm.all_reduce(&host_view, ReduceOp::Sum).unwrap();
        assert!(host_view.device().is_cpu());
        assert_eq!(
            host_buffer.to_vec1::<f32>().unwrap(),
            vec![9.0, 1.5, -2.0, 9.0]
        );
        let gathered = comm.all_gather(&host_view).unwrap();
        assert!(gathered.device().is_cpu());
        assert_eq!(gathered.to_vec1::<f32>().unwrap(), vec![1.5, -2.0]);
        comm.barrier().unwrap();
        let stats = comm.stats();
        assert_eq!((stats.all_reduces, stats.broadcasts), (3 * 3 + 3, 3));
    }

    pub fn nccl_all_reduce_across_gpus_matches_the_formula() {
        let gpus = visible_gpus().min(4);
        // Every GPU with a rank of its own; on a one-GPU machine, two ranks sharing it (the
        // launcher's testing switch: NCCL then connects them over sockets).
        let placement: Vec<String> = match gpus {
            0 => {
                skip(format_args!("no GPU; this test {NEEDS}"));
                return;
            }
            1 => ["--num-gpus", "1", "--ranks-per-gpu", "2"]
                .map(String::from)
                .to_vec(),
            n => vec!["--num-gpus".into(), n.to_string()],
        };
        let out = Job::worker()
            .launcher_flags(placement)
            .launcher_flags(["--main-process-port", "0"])
            .arg("allreduce")
            .limit(Duration::from_secs(120))
            .run();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("result: ok"),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn k_micro_batches_on_the_gpu_equal_one_big_batch_on_the_cpu() {
        let Some(device) = gpu() else { return };
        let (samples, b, k) = (160, 8, 4);
        let cfg = AdamWConfig {
            lr: 0.01,
            weight_decay: 0.1,
            ..AdamWConfig::default()
        };
        let train = |k: usize| -> Vec<(String, Var)> {
            let mut acc = Accelerator::builder()
                .gradient_accumulation_steps(k)
                .device(device.clone())
                .process_state(ProcessState::single())
                .build()
                .unwrap();
            let (varmap, model) = tiny_mlp_on(1, &device).unwrap();
            let (x, y) = tiny_data(samples, 2).unwrap();
            let params = acc.prepare(&varmap).unwrap();
            let mut opt = acc
                .prepare(AdamW::new(params.clone(), cfg).unwrap())
                .unwrap();
            let loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), b)
                .shuffle(true)
                .seed(5);
            let mut loader = acc.prepare(loader).unwrap();
            for _ in 0..2 {
                for batch in loader.iter() {
                    let (x, y) = batch.unwrap();
                    assert!(x.device().same_device(&device), "batches arrive on the GPU");
                    let _step = acc.accumulate();
                    let logits = model.forward(&x).unwrap();
                    let loss = candle_nn::loss::cross_entropy(&logits, &y).unwrap();
                    acc.backward(&loss).unwrap();
                    opt.step().unwrap();
                    opt.zero_grad();
                }
            }
            // Back on the CPU for the comparison.
            params
                .iter()
                .map(|(n, v)| {
                    let t = v.as_tensor().to_device(&Device::Cpu).unwrap();
                    (n.clone(), Var::from_tensor(&t).unwrap())
                })
                .collect()
        };
        let ours = train(k);

        // Reference: plain candle on the CPU, one batch of K·B, PyTorch's AdamW written out.
        let (varmap, model) = tiny_mlp(1).unwrap();
        let (x, y) = tiny_data(samples, 2).unwrap();
        let reference = named_vars(&varmap);
        let mut opt = ReferenceOptimizer::adamw(0.01, 0.1);
        let mut loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), b * k)
            .shuffle(true)
            .seed(5);
        for _ in 0..2 {
            for batch in loader.iter() {
                let (x, y) = batch.unwrap();
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
                opt.step(&reference, &loss.backward().unwrap()).unwrap();
            }
        }
        let d = max_abs_diff(&ours, &reference);
        // Different summation orders on the two devices; AdamW's normalized steps keep the
        // difference at rounding level.
        assert!(d < 1e-4, "max |Δθ| GPU vs CPU reference = {d}");
        let unaccumulated = train(1);
        assert!(
            max_abs_diff(&unaccumulated, &reference) > 1e-2,
            "the comparison must be able to fail"
        );
    }

    /// Runs the `mlp` example under the launcher with `device_flags` and `extra` arguments;
    /// returns its final loss and its output.
    fn run_mlp(device_flags: &[&str], extra: &[&str]) -> (f64, String) {
        let out = Job::example("mlp")
            .launcher_flags(device_flags)
            // A free port: the suite's jobs must never meet on the default one.
            .launcher_flags(["--main-process-port", "0"])
            .args([
                "--max-steps",
                "40",
                "--grad-accum",
                "2",
                "--batch-size",
                "32",
            ])
            .args(extra)
            .limit(Duration::from_secs(300))
            .run();
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let finals: Vec<f64> = stdout
            .lines()
            .filter_map(|l| l.split("final_loss=").nth(1))
            .filter_map(|v| v.split_whitespace().next()?.parse().ok())
            .collect();
        assert_eq!(finals.len(), 1, "{stdout}");
        (finals[0], stdout)
    }

    pub fn the_mlp_example_trains_on_every_gpu_under_the_launcher() {
        let n = visible_gpus();
        if n == 0 {
            skip(format_args!("no GPU; this test {NEEDS}"));
            return;
        }
        let n_str = n.to_string();
        let (gpu_loss, gpu_out) = run_mlp(&["--num-gpus", &n_str], &[]);
        assert!(gpu_out.contains("Cuda"), "trained on the GPU: {gpu_out}");
        // The reference: the same job on the CPU (same seeds, samples and per-rank batches).
        let (cpu_loss, _) = run_mlp(&["--cpu", "--num-processes", &n_str], &[]);
        eprintln!("{gpu_out}\nfinal loss: GPU {gpu_loss}, CPU {cpu_loss}");
        // 10 classes: a model that learned nothing sits at ln 10 = 2.303.
        assert!(gpu_loss < 2.2, "final loss {gpu_loss} after 40 steps");
        assert!(
            (gpu_loss - cpu_loss).abs() < 2e-3,
            "GPU {gpu_loss} vs CPU {cpu_loss}"
        );
    }

    pub fn mixed_precision_on_the_gpu_tracks_full_precision() {
        if visible_gpus() == 0 {
            skip(format_args!("no GPU; this test {NEEDS}"));
            return;
        }
        let gpu = ["--num-gpus", "1"];
        let (f32_loss, _) = run_mlp(&gpu, &[]);
        for mode in ["bf16", "fp16"] {
            let (loss, out) = run_mlp(&gpu, &["--mixed-precision", mode]);
            eprintln!("{mode}: final loss {loss} (f32: {f32_loss})");
            assert!(out.contains(&format!("mixed_precision={mode}")), "{out}");
            // Half-precision rounding moves the trajectory a little, not the learning.
            assert!(
                (loss - f32_loss).abs() < 0.05 * f32_loss,
                "{mode} final loss {loss} vs f32 {f32_loss}"
            );
        }
    }

    const LIMIT: Duration = Duration::from_secs(300);

    /// Whether a GPU is visible; prints the skip line when not.
    fn have_a_gpu() -> bool {
        let n = visible_gpus();
        if n == 0 {
            skip(format_args!("no GPU visible; this test {NEEDS}"));
        }
        n > 0
    }

    /// `job` under the launcher with two NCCL ranks on GPU 0, on a free port.
    fn two_ranks_on_one_gpu(job: Job) -> Job {
        job.launcher_flags([
            "--num-gpus",
            "1",
            "--ranks-per-gpu",
            "2",
            "--main-process-port",
            "0",
        ])
        .limit(LIMIT)
    }

    fn flat_vars(vars: &[(String, Var)]) -> BTreeMap<String, Vec<f32>> {
        vars.iter()
            .map(|(n, v)| {
                let t = v.as_tensor().flatten_all().unwrap();
                (
                    n.clone(),
                    t.to_device(&Device::Cpu).unwrap().to_vec1().unwrap(),
                )
            })
            .collect()
    }

    pub fn two_nccl_ranks_on_one_gpu_with_k2_equal_one_process_with_the_global_batch() {
        tiny_train_on_two_nccl_ranks_equals_one_process("0");
    }

    /// As the test above at ZeRO stage 3, with the model built on the host: `prepare` moves only
    /// each rank's pieces to the GPU (the way to a model larger than one GPU), and the two units'
    /// gathers and reduce-scatters run over NCCL.
    pub fn a_host_built_model_at_stage_three_on_two_nccl_ranks_equals_one_process() {
        tiny_train_on_two_nccl_ranks_equals_one_process("3");
    }

    fn tiny_train_on_two_nccl_ranks_equals_one_process(zero_stage: &str) {
        if !have_a_gpu() {
            return;
        }
        let (k, b, samples) = (2usize, 4usize, 160usize);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("two_ranks.safetensors");
        let o = two_ranks_on_one_gpu(Job::worker())
            .launcher_flags(["--zero-stage", zero_stage])
            .arg("tiny_train")
            .arg(&out)
            .args([k.to_string(), b.to_string(), samples.to_string()])
            .run();
        let text = output_text(&o);
        assert!(o.status.success(), "{text}");
        // 160 samples in global batches of 2 ranks x K x B = 16: 10 optimizer steps per epoch.
        assert!(
            text.contains("\"optimizer_steps\":20") && text.contains("Cuda"),
            "{text}"
        );
        let ours = load_flat(&out);

        // Reference: plain candle on the CPU, one process, one batch of 2·K·B per step over the
        // same shuffled samples, PyTorch's AdamW written out (tests/support.rs).
        let (varmap, model) = tiny_mlp(1).unwrap();
        let initial = flat_vars(&named_vars(&varmap));
        let (x, y) = tiny_data(samples, 2).unwrap();
        let reference = named_vars(&varmap);
        let mut opt = ReferenceOptimizer::adamw(0.01, 0.1);
        let mut loader = DataLoader::new(Arc::new(TensorDataset::new(x, y).unwrap()), 2 * k * b)
            .shuffle(true)
            .seed(5);
        for _ in 0..2 {
            for batch in loader.iter() {
                let (x, y) = batch.unwrap();
                let loss = candle_nn::loss::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
                opt.step(&reference, &loss.backward().unwrap()).unwrap();
            }
        }
        let reference = flat_vars(&reference);
        let d = max_abs_diff_flat(&ours, &reference);
        // GPU and CPU sum in different orders; AdamW's normalized steps keep that at rounding.
        assert!(
            d < 1e-4,
            "max |Δθ| 2 NCCL ranks x K={k} at ZeRO stage {zero_stage} vs one process = {d}"
        );
        assert!(
            max_abs_diff_flat(&initial, &reference) > 1e-2,
            "the training moved the weights: the comparison could have failed"
        );
    }

    /// The arguments of tests/integration/gpt.rs's small model: one layer, width 32, context 16, seed 5.
    fn small_gpt_args(out: &std::path::Path, batch: usize, steps: u64) -> Vec<String> {
        [
            "--layers",
            "1",
            "--width",
            "32",
            "--heads",
            "2",
            "--context",
            "16",
            "--seed",
            "5",
            "--batch-size",
            &batch.to_string(),
            "--max-steps",
            &steps.to_string(),
            "--save-model",
            out.to_str().unwrap(),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    pub fn gpt_on_two_nccl_ranks_with_item_weighted_accumulation_equals_one_rank() {
        if !have_a_gpu() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let dist = dir.path().join("dist.safetensors");
        let mut args = small_gpt_args(&dist, 4, 12);
        args.extend(["--grad-accum".to_string(), "2".to_string()]);
        let d = two_ranks_on_one_gpu(Job::example("gpt")).args(&args).run();
        assert!(d.status.success(), "{}", output_text(&d));
        assert_eq!(
            summary_value::<f64>(&d, "steps"),
            12.0,
            "{}",
            output_text(&d)
        );
        assert_eq!(
            summary_value::<f64>(&d, "micro_steps"),
            24.0,
            "{}",
            output_text(&d)
        );

        // One rank on the same GPU, one micro-batch holding the same 2 x 2 x 4 windows per step.
        // Its batches are padded to other lengths than the ranks' smaller ones; weighting each
        // window by its items (tokens) makes that irrelevant.
        let run_single = |out: &std::path::Path, steps: u64| {
            let o = Job::example("gpt")
                .launcher_flags(["--num-gpus", "1", "--main-process-port", "0"])
                .args(small_gpt_args(out, 16, steps))
                .limit(LIMIT)
                .run();
            assert!(o.status.success(), "{}", output_text(&o));
            o
        };
        let single = dir.path().join("single.safetensors");
        let s = run_single(&single, 12);
        let (a, b) = (load_flat(&dist), load_flat(&single));
        assert!(a.contains_key("lm_head.weight"), "{:?}", a.keys());
        let diff = max_abs_diff_flat(&a, &b);
        assert!(
            diff < 1e-4,
            "max |Δθ| between 2 NCCL ranks x K=2 and 1 rank = {diff}"
        );
        let (ld, ls) = (
            summary_value::<f64>(&d, "final_loss"),
            summary_value::<f64>(&s, "final_loss"),
        );
        assert!((ld - ls).abs() < 1e-4, "final loss {ld} vs {ls}");

        // The comparison could have failed: training moved the weights far more than that.
        let init = dir.path().join("init.safetensors");
        run_single(&init, 0);
        assert!(max_abs_diff_flat(&load_flat(&init), &b) > 0.01);
    }

    /// ZeRO stage 3 on two NCCL ranks (bf16 gathers under mixed precision, f32 masters and
    /// reductions) trains the small GPT as stage 0 does: the saved weights agree within float
    /// rounding (f32), and within bf16's (bf16; the compute copies are rounded either way).
    pub fn gpt_at_zero_stage_three_on_two_nccl_ranks_equals_stage_zero() {
        if !have_a_gpu() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        for (mode, tolerance) in [("no", 1e-5), ("bf16", 2e-3)] {
            let saved: Vec<BTreeMap<String, Vec<f32>>> = ["0", "3"]
                .iter()
                .map(|stage| {
                    let out = dir.path().join(format!("gpt-{mode}-{stage}.safetensors"));
                    let mut args = small_gpt_args(&out, 4, 6);
                    args.extend(["--grad-accum".to_string(), "2".to_string()]);
                    let o = two_ranks_on_one_gpu(Job::example("gpt"))
                        .launcher_flags(["--zero-stage", stage, "--mixed-precision", mode])
                        .args(&args)
                        .run();
                    assert!(o.status.success(), "{}", output_text(&o));
                    assert_eq!(
                        summary_value::<u8>(&o, "zero_stage"),
                        stage.parse::<u8>().unwrap()
                    );
                    load_flat(&out)
                })
                .collect();
            let diff = max_abs_diff_flat(&saved[0], &saved[1]);
            eprintln!("{mode}: stage 3 against stage 0 on two NCCL ranks, max |Δθ| = {diff:e}");
            assert!(diff <= tolerance, "{mode}: max |Δθ| = {diff}");
        }
    }

    fn bits(path: &std::path::Path) -> BTreeMap<String, Vec<u32>> {
        load_flat(path)
            .into_iter()
            .map(|(n, v)| (n, v.into_iter().map(f32::to_bits).collect()))
            .collect()
    }

    pub fn a_killed_nccl_rank_restarts_and_ends_bitwise_like_an_uninterrupted_run() {
        if !have_a_gpu() {
            return;
        }
        // tests/integration/checkpoint.rs's CPU test, on two NCCL ranks sharing the GPU.
        let dir = tempfile::tempdir().unwrap();
        let args = restart_mlp_args;
        let launch = || {
            two_ranks_on_one_gpu(Job::example("mlp"))
                .launcher_flags(["--max-restarts", "1", "--grace-period", "2"])
                // A rank left waiting in an NCCL kernel for the killed one is stopped by the
                // launcher; the watchdog is only a backstop here.
                .env("ACCELERATE_COLLECTIVE_TIMEOUT", "60")
        };
        let whole = dir.path().join("whole.safetensors");
        let o = launch()
            .args(args(&whole, &dir.path().join("ckpt_whole")))
            .run();
        assert!(o.status.success(), "{}", output_text(&o));
        assert!(output_text(&o).contains("steps=256"), "{}", output_text(&o));

        let ckpt = dir.path().join("ckpt");
        let killed = dir.path().join("killed.safetensors");
        let mut child = launch()
            .args(args(&killed, &ckpt))
            .command()
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let read = |mut p: Box<dyn std::io::Read + Send>| {
            std::thread::spawn(move || {
                let mut s = String::new();
                let _ = p.read_to_string(&mut s);
                s
            })
        };
        let out_reader = read(Box::new(child.stdout.take().unwrap()));
        let err_reader = read(Box::new(child.stderr.take().unwrap()));
        // Kill rank 1 once the first checkpoint exists (well before the run's 256 steps).
        let start = std::time::Instant::now();
        kill_rank_once_checkpointed(&mut child, 1, &ckpt.join("checkpoint_16"), LIMIT);
        let status = loop {
            if let Some(s) = child.try_wait().unwrap() {
                break s;
            }
            if start.elapsed() > LIMIT {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the restarted job did not finish within {LIMIT:?}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let (out, err) = (out_reader.join().unwrap(), err_reader.join().unwrap());
        assert!(status.success(), "{out}\n{err}");
        assert!(
            err.contains("killed by signal 9") && err.contains("restart 1 of 1"),
            "{err}"
        );
        assert!(out.contains("steps=256"), "{out}");
        assert_eq!(
            bits(&killed),
            bits(&whole),
            "the restarted run ended elsewhere"
        );
    }

    pub fn a_stalled_nccl_rank_is_ended_by_the_watchdog_naming_the_collective() {
        if !have_a_gpu() {
            return;
        }
        // Rank 1 sleeps for 600 s before the all-reduce rank 0 has queued on the GPU; only the
        // watchdog can end rank 0 (its kernel waits for rank 1 forever), then the launcher stops
        // rank 1. Long enough for both ranks to create their CUDA contexts and join NCCL.
        let o = two_ranks_on_one_gpu(Job::worker())
            .env("ACCELERATE_COLLECTIVE_TIMEOUT", "15")
            // Rank 1 is alive (asleep): without a short busy limit rank 0 would wait for it
            // for the default 30 minutes.
            .env("ACCELERATE_BUSY_PEER_TIMEOUT", "15")
            .arg("device_stall")
            .run();
        let text = output_text(&o);
        assert!(!o.status.success(), "{text}");
        // The wording is the watchdog's to choose; it must name the collective and a rank on the
        // same line.
        let names_a_rank = |line: &str| {
            line.match_indices("rank ").any(|(i, m)| {
                line[i + m.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| c.is_ascii_digit())
            })
        };
        assert!(
            text.lines()
                .any(|l| l.contains("all_reduce") && names_a_rank(l)),
            "no line names the all_reduce and a rank:\n{text}"
        );
        assert!(
            !text.contains("nobody stopped it") && !text.contains("although rank 1 never"),
            "{text}"
        );
    }

    /// Rows per batch and values per row of [`IndexPattern`]: 32 MiB of f32 per batch, so that a
    /// transfer takes long enough (a millisecond or more) to be caught in flight.
    const PATTERN_BATCH: usize = 16;
    const PATTERN_WIDTH: usize = 1 << 19;

    /// Sample `s` is the row `s + 1024 · (j mod 1024)` for `j` in `0..PATTERN_WIDTH`: exact in f32
    /// (below 2^24) and different for every sample, so a batch read before its copy has landed
    /// (still holding an earlier batch's bytes, or nothing) differs from the formula. Collating
    /// sleeps, so the training thread is always the one waiting and reads each batch the moment it
    /// arrives.
    struct IndexPattern {
        samples: usize,
    }

    impl Dataset for IndexPattern {
        type Item = usize;
        type Batch = Tensor;

        fn len(&self) -> usize {
            self.samples
        }

        fn get(&self, index: usize) -> accelerate_core::Result<usize> {
            Ok(index)
        }

        fn collate(&self, items: Vec<usize>) -> accelerate_core::Result<Tensor> {
            std::thread::sleep(Duration::from_millis(40));
            let rows = items.len();
            let mut values = Vec::with_capacity(rows * PATTERN_WIDTH);
            for s in items {
                values.extend((0..PATTERN_WIDTH).map(|j| (s + 1024 * (j % 1024)) as f32));
            }
            Ok(Tensor::from_vec(
                values,
                (rows, PATTERN_WIDTH),
                &Device::Cpu,
            )?)
        }
    }

    pub fn prefetched_batches_are_complete_when_the_training_thread_reads_them() {
        let Some(device) = gpu() else { return };
        let batches = 24;
        let mut loader = DataLoader::new(
            Arc::new(IndexPattern {
                samples: batches * PATTERN_BATCH,
            }),
            PATTERN_BATCH,
        )
        .prefetch(2)
        .device(device.clone());
        // Batch i holds samples i·B .. (i+1)·B (no shuffle): row r is the pattern of sample
        // i·B + r, which is `pattern` + i·B.
        let host: Vec<f32> = (0..PATTERN_BATCH)
            .flat_map(|r| (0..PATTERN_WIDTH).map(move |j| (r + 1024 * (j % 1024)) as f32))
            .collect();
        let pattern = Tensor::from_vec(host, (PATTERN_BATCH, PATTERN_WIDTH), &device).unwrap();
        // Slow kernels for the training thread's stream: a chain of 2048² matrix products.
        let a = Tensor::randn(0f32, 1.0, (2048, 2048), &device).unwrap();
        device.synchronize().unwrap();

        let mut mismatches = Vec::new();
        let mut iter = loader.iter();
        for i in 0.. {
            let expected = pattern.affine(1.0, (i * PATTERN_BATCH) as f64).unwrap();
            let mut busy = None;
            if i % 2 == 0 {
                // This thread's stream idle: the batch is read the moment it arrives.
                device.synchronize().unwrap();
            } else {
                // This thread's stream busy for a while, as in training, when the batch arrives.
                let mut m = a.clone();
                for _ in 0..8 {
                    m = m.matmul(&a).unwrap().affine(1.0 / 45.0, 0.0).unwrap();
                }
                busy = Some(m);
            }
            let Some(batch) = iter.next() else { break };
            let x = batch.unwrap();
            assert!(x.device().same_device(&device), "batches arrive on the GPU");
            // The first kernel that reads the batch on this thread; counted on the GPU and read
            // back at the end, so nothing here waits for the GPU.
            mismatches.push(
                x.ne(&expected)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .sum_all()
                    .unwrap(),
            );
            drop(busy);
        }
        assert_eq!(mismatches.len(), batches);
        let stale: Vec<(usize, f32)> = mismatches
            .iter()
            .map(|m| m.to_scalar::<f32>().unwrap())
            .enumerate()
            .filter(|&(_, wrong)| wrong != 0.0)
            .collect();
        assert!(
            stale.is_empty(),
            "(batch, values differing from the formula) of stale batches: {stale:?}"
        );
    }
}
