//! Fine-tunes the `llama` workload with LoRA adapters (Hu et al. 2021, as Hugging Face PEFT
//! computes them): the base model is frozen, and beside each chosen projection `W x` of every
//! decoder layer a trained low-rank update `(alpha / r) · B (A x)` is added, `A` drawn
//! Kaiming-uniform and `B` zero, so training starts from the base model's outputs.
//!
//! Alone: `cargo run --release --example lora`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/lora`.
//!
//! It takes `llama`'s flags (the same data, model size, optimizer and training loop) and writes
//! `--save-adapter DIR` as PEFT does, which `--load-adapter DIR` reads back, or `--output-dir DIR`
//! (the adapter and --model's tokenizer files).

use std::path::{Path, PathBuf};

use accelerate_core::{Accelerator, Model};
use accelerate_examples::llama::model_dir::{copy_carried_files, write_dir_atomically};
use accelerate_examples::llama::{LlamaArgs, LlamaRun};
use accelerate_examples::lora::{self, LoraConfig, LoraRunIdentity, LoraTarget};
use accelerate_examples::run;
use anyhow::{bail, Context, Result};
use candle_core::Var;
use clap::Parser;

/// Fine-tune a Llama-architecture language model with LoRA adapters over a frozen base (llama's
/// flags, plus the adapters').
///
/// The evaluation split (--eval-fraction, --eval-steps) holds out rows of the data; its loss is
/// the mean cross-entropy over all predicted tokens of the held-out rows.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(flatten)]
    llama: LlamaArgs,
    /// The adapters' rank r [default: 8, or --load-adapter's].
    #[arg(long)]
    lora_r: Option<usize>,
    /// The adapters' alpha; their update is scaled by alpha / r [default: 16 (PEFT's is 8), or
    /// --load-adapter's].
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// The projections of every decoder layer that get adapters, separated by commas: any of
    /// q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj [default: q_proj,v_proj, or
    /// --load-adapter's].
    #[arg(long, value_name = "LIST")]
    lora_targets: Option<String>,
    /// Start from the adapter in this directory (adapter_config.json and
    /// adapter_model.safetensors, as PEFT writes them) instead of fresh adapters.
    #[arg(long, value_name = "DIR")]
    load_adapter: Option<PathBuf>,
    /// Write the trained adapter into this directory as PEFT does: adapter_model.safetensors and
    /// adapter_config.json.
    #[arg(long, value_name = "DIR")]
    save_adapter: Option<PathBuf>,
    /// base_model_name_or_path of the saved adapter_config.json (default: the --model directory,
    /// else the --init-weights file's directory, else the --config file's, as absolute paths,
    /// else null).
    #[arg(long, value_name = "NAME")]
    base_model_name: Option<String>,
}

/// --load-adapter's directory for messages (the layer check only fails for a loaded adapter).
fn adapter_dir(args: &Args) -> String {
    args.load_adapter
        .as_deref()
        .map_or(String::new(), |d| d.display().to_string())
}

fn main() {
    run::exit_on_error(run(&Args::parse()));
}

/// The adapters' settings: --load-adapter's, which the flags may repeat but not contradict, or the
/// flags' (defaults r 8 and `q_proj,v_proj` as PEFT's examples use them, and alpha 16, twice r,
/// where PEFT's `LoraConfig` defaults to 8).
fn lora_config(args: &Args) -> Result<LoraConfig> {
    let targets = args
        .lora_targets
        .as_deref()
        .map(|list| LoraTarget::parse_list(list).context("--lora-targets"))
        .transpose()?;
    if args.lora_r == Some(0) {
        bail!("--lora-r must be at least 1");
    }
    if let Some(alpha) = args.lora_alpha {
        if !(alpha.is_finite() && alpha > 0.0) {
            bail!("--lora-alpha must be a positive number, got {alpha}");
        }
    }
    let Some(dir) = &args.load_adapter else {
        let defaults = LoraConfig::default();
        return Ok(LoraConfig {
            r: args.lora_r.unwrap_or(defaults.r),
            alpha: args.lora_alpha.unwrap_or(defaults.alpha),
            targets: targets.unwrap_or(defaults.targets),
            ..defaults
        });
    };
    let saved = lora::read_adapter_config(dir)
        .with_context(|| format!("--load-adapter {}", dir.display()))?;
    let differs = [
        ("--lora-r", args.lora_r.is_some_and(|r| r != saved.r)),
        (
            "--lora-alpha",
            args.lora_alpha.is_some_and(|a| a != saved.alpha),
        ),
        (
            "--lora-targets",
            targets.as_ref().is_some_and(|t| *t != saved.targets),
        ),
    ];
    if let Some((flag, _)) = differs.iter().find(|(_, d)| *d) {
        bail!(
            "{flag} differs from the adapter in --load-adapter {} (r {}, alpha {}, targets {}); \
             leave {flag} out to take the adapter's",
            dir.display(),
            saved.r,
            saved.alpha,
            saved
                .targets
                .iter()
                .map(|t| t.name())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    Ok(saved)
}

fn run(args: &Args) -> Result<()> {
    let lora = lora_config(args)?;
    let mut session = LlamaRun::start(&args.llama)?;
    lora.check_layers(session.config.num_hidden_layers)
        .with_context(|| format!("--load-adapter {}", adapter_dir(args)))?;
    if lora.dropout > 0.0 {
        session.acc.print(format!(
            "note: the adapter was trained with lora_dropout {}; dropout is not applied while \
             training here (it does not change what the adapter computes), and the value is \
             written back with --save-adapter",
            lora.dropout
        ));
    }
    if let Some(dir) = &args.save_adapter {
        // Before training, so that an unwritable directory does not cost a run.
        let made = if session.acc.is_main_process() {
            lora::prepare_adapter_dir(dir)
                .map_err(|e| accelerate_core::Error::Config(format!("{e:#}")))
        } else {
            Ok(())
        };
        session
            .acc
            .agree_across_ranks(dir, "creating the adapter directory", made)
            .with_context(|| format!("--save-adapter {}", dir.display()))?;
    }
    // The base's weights are loaded before `prepare` broadcasts them, once.
    let (varmap, base) = session.build_model()?;
    let base_params: Vec<(String, Var)> = {
        let data = varmap.data().lock().unwrap_or_else(|e| e.into_inner());
        data.iter().map(|(n, v)| (n.clone(), v.clone())).collect()
    };
    session.load_initial_weights(&base_params)?;
    drop(base_params);
    let model = lora::with_adapters(&base, &lora, &varmap, args.llama.seed)?;
    drop(base);
    let acc = &mut session.acc;
    let prepared =
        acc.prepare(Model::from_varmap(&varmap).freeze(|name| !lora::is_adapter_parameter(name)))?;
    // Saved with every checkpoint and compared once --resume has loaded one: registered before
    // the training loop loads it.
    let identity = LoraRunIdentity::new(&lora, prepared.frozen_parameters())?;
    let restored = acc.register_for_checkpointing(identity.clone());
    // The adapters (their f32 masters under mixed precision).
    let params = prepared.parameters().to_vec();
    if let Some(dir) = &args.load_adapter {
        lora::load_adapter(dir, &params)
            .with_context(|| format!("--load-adapter {}", dir.display()))?;
        acc.model().refresh_compute_parameters()?;
    }
    let count = |p: &[(String, Var)]| p.iter().map(|(_, v)| v.elem_count()).sum::<usize>();
    session.announce(&format!(
        "{} trained parameters (LoRA r {}, alpha {}, on {}), {} frozen",
        count(&params),
        lora.r,
        lora.alpha,
        lora.targets
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(","),
        count(prepared.frozen_parameters())
    ));
    session.check_after_resume(move |_| {
        let checkpoint = restored.lock().unwrap_or_else(|e| e.into_inner());
        identity
            .check_resumable_from(&checkpoint)
            .context("--resume")
    });
    let model_dir = session.model_dir.as_ref().map(|m| m.dir().to_path_buf());
    let acc = session.train(&model, params)?;
    let base_model = lora::base_model_name_or_path(
        args.base_model_name.as_deref(),
        args.llama.model.as_deref(),
        args.llama.init_weights.as_deref(),
        args.llama.config.as_deref(),
    );
    save_adapter(
        &acc,
        &lora,
        base_model.as_deref(),
        args.save_adapter.as_deref(),
    )?;
    write_output_dir(
        &acc,
        &args.llama,
        &lora,
        base_model.as_deref(),
        model_dir.as_deref(),
    )
}

/// `--output-dir`: the trained adapters as PEFT writes them (see [`save_adapter`]), with
/// --model's tokenizer files, as one directory written atomically by the main process; every rank
/// then agrees on the outcome.
fn write_output_dir(
    acc: &Accelerator,
    args: &LlamaArgs,
    lora: &LoraConfig,
    base_model: Option<&str>,
    model_dir: Option<&Path>,
) -> Result<()> {
    let Some(dir) = &args.output_dir else {
        return Ok(());
    };
    let written = if acc.is_main_process() {
        write_dir_atomically(
            dir,
            args.overwrite_output_dir,
            |_| false,
            |tmp| {
                lora::save_adapter(tmp, lora, base_model, acc.model().parameters())?;
                // The tokenizer trained with: --tokenizer's, else --model's.
                if let Some(from) = args.text.tokenizer.as_deref().or(model_dir) {
                    copy_carried_files(from, tmp, false)?;
                }
                Ok(())
            },
        )
        .map_err(|e| accelerate_core::Error::Config(format!("{e:#}")))
    } else {
        Ok(())
    };
    acc.agree_across_ranks(dir, "writing the adapter directory", written)
        .with_context(|| format!("--output-dir {}", dir.display()))?;
    acc.print(format!("wrote the adapter to {}", dir.display()));
    Ok(())
}

/// `--save-adapter`: the trained adapters (the f32 masters under mixed precision), written by the
/// main process; every rank then agrees on the outcome, so none exits before the files are
/// complete, and a failure ends every rank with rank 0's cause.
fn save_adapter(
    acc: &Accelerator,
    lora: &LoraConfig,
    base_model: Option<&str>,
    dir: Option<&Path>,
) -> Result<()> {
    let Some(dir) = dir else {
        return Ok(());
    };
    let written = if acc.is_main_process() {
        lora::save_adapter(dir, lora, base_model, acc.model().parameters())
    } else {
        Ok(())
    };
    acc.agree_across_ranks(dir, "writing the adapter", written)
        .with_context(|| format!("--save-adapter {}", dir.display()))
}
