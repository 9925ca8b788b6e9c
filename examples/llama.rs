//! Trains the `llama` workload, a Llama-architecture language model, with the accelerate-rs
//! runtime; reads and writes Hugging Face's config.json and parameter names, so transformers
//! loads what it saves.
//!
//! Alone: `cargo run --release --example llama`.
//! On two CPU processes: `accelerate-launch --cpu --num-processes 2 target/release/examples/llama`.
//!
//! The flags, the data and the training loop are the workload's (`accelerate_examples::llama`'s
//! `cli` and `train`), shared with the `lora` example; this program builds the model with every
//! parameter trained and writes `--save-model` and `--output-dir`.

use std::path::{Path, PathBuf};

use accelerate_core::{Accelerator, Model};
use accelerate_examples::layers::named_vars;
use accelerate_examples::llama::{
    self, write_model_dir, LlamaArgs, LlamaConfig, LlamaRun, ModelDir, ModelOutput,
};
use accelerate_examples::run;
use anyhow::{bail, Context, Result};
use clap::Parser;

/// Train a Llama-architecture language model (built-in sonnets, one character per token, unless
/// --data).
///
/// The evaluation split (--eval-fraction, --eval-steps) holds out rows of the data; its loss is
/// the mean cross-entropy over all predicted tokens of the held-out rows.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    #[command(flatten)]
    llama: LlamaArgs,
    /// Write the trained weights here (safetensors, Hugging Face names), and the model's
    /// config.json beside it, so `LlamaForCausalLM.from_pretrained(<its directory>)` loads them.
    #[arg(long)]
    save_model: Option<PathBuf>,
}

fn main() {
    run::exit_on_error(run(&Args::parse()));
}

fn run(args: &Args) -> Result<()> {
    if let Some(path) = &args.save_model {
        // config.json is written beside the weights: the weights cannot take its name.
        if path.file_name().and_then(|n| n.to_str()) == Some("config.json") {
            bail!(
                "--save-model {}: config.json is written beside the weights; name the weights \
                 model.safetensors (the name transformers' from_pretrained reads)",
                path.display()
            );
        }
    }
    run::check_wrap_classes(llama::DECODER_LAYER_CLASS)?;
    let mut session = LlamaRun::start(&args.llama)?;
    let (varmap, model) = session.build_model()?;
    let loads = args.llama.model.is_some() || args.llama.init_weights.is_some();
    // Under ZeRO stage 3 each rank keeps only its pieces of the prepared parameters: the initial
    // weights go into the whole model before it is cut (in its compute dtype).
    let sharded = session.acc.zero_stage() == 3;
    if loads && sharded {
        // That model is in the compute dtype: under mixed precision the f32 masters would
        // start from the loaded weights rounded.
        let mode = session.acc.mixed_precision();
        if mode != accelerate_core::MixedPrecision::No {
            bail!(
                "--model/--init-weights with --zero-stage 3 and mixed precision {mode}: the \
                 sharded f32 masters are cut from the model in the compute dtype, which would \
                 round the loaded weights; use --zero-stage 2, or train without mixed precision"
            );
        }
        session.load_initial_weights(&named_vars(&varmap))?;
    }
    let parameter_count: usize = varmap.all_vars().iter().map(|v| v.elem_count()).sum();
    let config = *model.config();
    let prepared = session
        .acc
        .prepare_model(Model::from_varmap(&varmap).units(llama::unit_specs(&config)))?;
    drop(varmap);
    let params = prepared.parameters().to_vec();
    if loads && !sharded {
        // Into the prepared parameters (the f32 masters under mixed precision), then copied to
        // the compute copies.
        session.load_initial_weights(&params)?;
        session.acc.model().refresh_compute_parameters()?;
    }
    // The model computes through its units, at every stage. At stage 3 every unit is recomputed
    // in the backward pass anyway: checkpointing inside it would run its forward a third time.
    let mut model = model.through_units(prepared);
    if sharded {
        model.set_gradient_checkpointing(false);
    }
    session.announce(&format!("{parameter_count} parameters"));
    let model_dir = session.model_dir.clone();
    let acc = session.train(&model, params)?;
    save_model(&acc, model.config(), args.save_model.as_deref())?;
    write_output_dir(&acc, &args.llama, model.config(), model_dir.as_ref())
}

/// `--output-dir`: the prepared parameters (the f32 masters under mixed precision) and `config`
/// as a Hugging Face model directory, with --model's tokenizer files and special token ids,
/// written by the main process; every rank then agrees on the outcome.
fn write_output_dir(
    acc: &Accelerator,
    args: &LlamaArgs,
    config: &LlamaConfig,
    model_dir: Option<&ModelDir>,
) -> Result<()> {
    let Some(dir) = &args.output_dir else {
        return Ok(());
    };
    // Every rank: a collective under ZeRO stage 3.
    let tensors = run::parameter_tensors(acc);
    let written = if acc.is_main_process() {
        tensors.and_then(|tensors| {
            let token_ids = model_dir.map(|m| m.token_ids().clone()).unwrap_or_default();
            write_model_dir(
                dir,
                args.overwrite_output_dir,
                &ModelOutput {
                    config,
                    token_ids: &token_ids,
                    tensors: &tensors,
                    max_shard_size: args.max_shard_size,
                    carry_from: model_dir.map(ModelDir::dir),
                    tokenizer_from: args.text.tokenizer.as_deref(),
                },
            )
            .map_err(|e| accelerate_core::Error::Config(format!("{e:#}")))
        })
    } else {
        tensors.map(|_| ())
    };
    acc.agree_across_ranks(dir, "writing the model directory", written)
        .with_context(|| format!("--output-dir {}", dir.display()))?;
    acc.print(format!("wrote the model to {}", dir.display()));
    Ok(())
}

/// `--save-model`: the prepared parameters (the f32 masters under mixed precision) under Hugging
/// Face's names at `path`, and `config.json` of `config` beside it, both written atomically by the
/// main process; every rank then agrees on the outcome, so none exits before the files are
/// complete, and a failure ends every rank with rank 0's cause.
fn save_model(acc: &Accelerator, config: &LlamaConfig, path: Option<&Path>) -> Result<()> {
    let Some(path) = path else {
        return Ok(());
    };
    if path.file_name().and_then(|n| n.to_str()) != Some("model.safetensors") {
        acc.print(format!(
            "note: transformers' from_pretrained loads a directory's weights only from \
             model.safetensors; {} will need renaming for it",
            path.display()
        ));
    }
    // Every rank: a collective under ZeRO stage 3.
    let tensors = run::parameter_tensors(acc);
    let written = if acc.is_main_process() {
        tensors.and_then(|tensors| {
            accelerate_core::save_safetensors(path, &tensors).and_then(|()| {
                let json = serde_json::to_vec_pretty(&config.to_hf_json())
                    .expect("a JSON value serializes");
                accelerate_core::write_atomic(path.with_file_name("config.json"), &json)
            })
        })
    } else {
        tensors.map(|_| ())
    };
    acc.agree_across_ranks(path, "writing the model", written)
        .with_context(|| format!("--save-model {}", path.display()))
}
