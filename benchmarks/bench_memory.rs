//! The memory table: what each memory switch saves, per rank, on CPU ranks under the launcher.
//!
//! Every row is one real job, `accelerate-launch --cpu --num-processes N [--zero-stage S]
//! examples/<workload> ... [--gradient-checkpointing]`, run for a fixed number of optimizer steps.
//! The example reports, on its summary line, the largest peak resident set (`VmHWM`) of its ranks
//! (`peak_rss_mib=`) and its samples/s (every rank's samples over the wall time of training).
//! Rounds interleave the rows so that machine noise hits every row alike; medians are reported.
//!
//! - `--workload gpt` (the default): the table. Batch 32 per rank, and batch 8 × K = 4
//!   (the same samples per optimizer step), each plain, with ZeRO-1, with ZeRO-2, with activation
//!   checkpointing, and with ZeRO-2 and checkpointing together.
//! - `--workload mlp`: a model whose parameters and optimizer state dominate (`--hidden 4096`:
//!   20 M parameters), on 1, 2 and 3 ranks (`--num-processes`): stage 0 on one rank (ZeRO
//!   shards nothing there), stages 0 to 3 on more. Its table has a column for the training state the formula gives per rank: 16·P bytes
//!   at stage 0 (AdamW), (8 + 8/N)·P at stage 1, (4 + 12/N)·P at stage 2, 16·P/N at stage 3.
//!
//! `cargo build --release --workspace --bins --examples && target/release/bench_memory` (see
//! BENCHMARKS.md).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use accelerate_benchmarks::{median, report_value, run_within};
use anyhow::{bail, Context, Result};
use clap::{Parser, ValueEnum};

/// Which example the table trains.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// The character GPT (the table).
    Gpt,
    /// The MLP, with a hidden width large enough for the optimizer state to dominate.
    Mlp,
}

/// Peak memory per rank and samples/s of every memory switch, on CPU ranks.
#[derive(Debug, Parser)]
struct Args {
    /// The example to train.
    #[arg(long, value_enum, default_value_t = Workload::Gpt)]
    workload: Workload,
    /// Optimizer steps per row per round.
    #[arg(long, default_value_t = 3)]
    steps: u64,
    /// Rounds (each runs every row once).
    #[arg(long, default_value_t = 1)]
    rounds: usize,
    /// gpt: transformer blocks.
    #[arg(long, default_value_t = 4)]
    layers: usize,
    /// gpt: embedding width.
    #[arg(long, default_value_t = 256)]
    width: usize,
    /// gpt: longest window.
    #[arg(long, default_value_t = 256)]
    context: usize,
    /// gpt: samples per rank per optimizer step (rows run it as one batch and as 4 micro-batches).
    #[arg(long, default_value_t = 32)]
    batch_size: usize,
    /// mlp: width of the two hidden layers.
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// mlp: the numbers of ranks, comma-separated; each is a group of rows (gpt: always 2).
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 3])]
    num_processes: Vec<usize>,
    /// Only the rows whose label contains this text.
    #[arg(long)]
    only: Option<String>,
    /// Seconds a job may run before it is killed and the benchmark fails.
    #[arg(long, default_value_t = 1800)]
    job_timeout: u64,
}

/// One row of the table: a job's settings.
#[derive(Debug, Clone)]
struct Row {
    label: String,
    /// The row the percentages are taken against.
    baseline: usize,
    ranks: usize,
    batch: usize,
    k: usize,
    zero_stage: u8,
    checkpointing: bool,
}

fn rows(args: &Args) -> Vec<Row> {
    let mut rows = Vec::new();
    match args.workload {
        Workload::Gpt => {
            let b = args.batch_size;
            for (batch, k, name) in [
                (b, 1, format!("batch {b}")),
                (b / 4, 4, format!("batch {} x K=4", b / 4)),
            ] {
                let baseline = rows.len();
                for (zero_stage, checkpointing, what) in [
                    (0, false, ""),
                    (1, false, ", ZeRO-1"),
                    (2, false, ", ZeRO-2"),
                    (0, true, ", activation checkpointing"),
                    (2, true, ", ZeRO-2 + checkpointing"),
                ] {
                    rows.push(Row {
                        label: format!("{name}{what}"),
                        baseline,
                        ranks: 2,
                        batch,
                        k,
                        zero_stage,
                        checkpointing,
                    });
                }
            }
        }
        Workload::Mlp => {
            for &ranks in &args.num_processes {
                let baseline = rows.len();
                let stages: &[u8] = match ranks {
                    1 => &[0],
                    _ => &[0, 1, 2, 3],
                };
                for &zero_stage in stages {
                    rows.push(Row {
                        label: format!("N={ranks}, ZeRO stage {zero_stage}"),
                        baseline,
                        ranks,
                        batch: 64,
                        k: 1,
                        zero_stage,
                        checkpointing: false,
                    });
                }
            }
        }
    }
    rows
}

/// What a job reported.
#[derive(Debug, Clone, Copy)]
struct Report {
    peak_mib: f64,
    samples_per_s: f64,
}

/// The mlp's parameters at width `hidden`: 784 → H → H → 10 with biases.
fn mlp_parameters(hidden: usize) -> f64 {
    (784 * hidden + hidden + hidden * hidden + hidden + 10 * hidden + 10) as f64
}

/// The training state per rank the formula gives (parameters, gradients, AdamW's two moments, in
/// f32), in MiB, for the mlp's `row`.
fn formula_mib(hidden: usize, row: &Row) -> f64 {
    let (p, n) = (mlp_parameters(hidden), row.ranks as f64);
    let bytes_per_parameter = match row.zero_stage {
        0 => 16.0,
        1 => 8.0 + 8.0 / n,
        2 => 4.0 + 12.0 / n,
        _ => 16.0 / n,
    };
    bytes_per_parameter * p / 1048576.0
}

fn main() -> Result<()> {
    let args = Args::parse();
    if args.num_processes.contains(&0) {
        bail!("--num-processes takes numbers of ranks, each at least 1");
    }
    let dir = std::env::current_exe()
        .context("locating the benchmark's own executable")?
        .parent()
        .context("the benchmark's directory")?
        .to_path_buf();
    let rows: Vec<Row> = rows(&args)
        .into_iter()
        .filter(|r| {
            args.only
                .as_ref()
                .is_none_or(|o| r.label.contains(o.as_str()))
        })
        .collect();
    if rows.is_empty() {
        bail!("--only {:?} matches no row", args.only);
    }
    let mut reports: Vec<Vec<Report>> = vec![Vec::new(); rows.len()];
    for round in 0..args.rounds {
        for (row, out) in rows.iter().zip(&mut reports) {
            out.push(run_row(&args, &dir, row)?);
            eprintln!("round {}: {} done", round + 1, row.label);
        }
    }
    let mlp = args.workload == Workload::Mlp;
    println!();
    println!(
        "| configuration ({}{} steps, median of {} rounds) |{} peak memory per rank (MiB) \
         | vs group's first | samples/s | vs group's first |",
        if mlp { "" } else { "2 ranks, " },
        args.steps,
        args.rounds,
        if mlp {
            " training state, formula (MiB) |"
        } else {
            ""
        }
    );
    println!(
        "|---|{}---:|---:|---:|---:|",
        if mlp { "---:|" } else { "" }
    );
    let medians: Vec<Report> = reports
        .iter()
        .map(|r| Report {
            peak_mib: median(&r.iter().map(|x| x.peak_mib).collect::<Vec<_>>()),
            samples_per_s: median(&r.iter().map(|x| x.samples_per_s).collect::<Vec<_>>()),
        })
        .collect();
    let all = self::rows(&args);
    for (row, m) in rows.iter().zip(&medians) {
        // Against the row's group's first row when it ran, else against the table's first.
        let base = rows
            .iter()
            .position(|r| r.label == all[row.baseline].label)
            .map_or(medians[0], |i| medians[i]);
        let formula = match mlp {
            true => format!(" {:.0} |", formula_mib(args.hidden, row)),
            false => String::new(),
        };
        println!(
            "| {} |{formula} {:.0} | {:+.1} % | {:.2} | {:+.1} % |",
            row.label,
            m.peak_mib,
            (m.peak_mib / base.peak_mib - 1.0) * 100.0,
            m.samples_per_s,
            (m.samples_per_s / base.samples_per_s - 1.0) * 100.0
        );
    }
    Ok(())
}

/// Runs one row's job and reads its summary line.
fn run_row(args: &Args, dir: &Path, row: &Row) -> Result<Report> {
    let launcher: PathBuf = dir.join("accelerate-launch");
    let example = dir.join("examples").join(match args.workload {
        Workload::Gpt => "gpt",
        Workload::Mlp => "mlp",
    });
    for bin in [&launcher, &example] {
        if !bin.exists() {
            bail!(
                "{} is missing; build it first: cargo build --release --workspace --bins --examples",
                bin.display()
            );
        }
    }
    let mut cmd = Command::new(&launcher);
    cmd.args([
        "--cpu",
        "--num-processes",
        &row.ranks.to_string(),
        "--zero-stage",
    ])
    .arg(row.zero_stage.to_string())
    .arg(&example);
    let steps = args.steps.to_string();
    match args.workload {
        Workload::Gpt => {
            cmd.args(["--layers", &args.layers.to_string()])
                .args(["--width", &args.width.to_string()])
                .args(["--heads", "4"])
                .args(["--context", &args.context.to_string()])
                .args(["--epochs", "1000"]);
            if row.checkpointing {
                cmd.arg("--gradient-checkpointing");
            }
        }
        Workload::Mlp => {
            cmd.args(["--hidden", &args.hidden.to_string()])
                .args(["--optimizer", "adamw"])
                .args(["--epochs", "1000"]);
        }
    }
    cmd.args(["--batch-size", &row.batch.to_string()])
        .args(["--grad-accum", &row.k.to_string()])
        .args(["--max-steps", &steps]);
    let Some((status, out)) = run_within(&mut cmd, Duration::from_secs(args.job_timeout))? else {
        bail!(
            "{} ran longer than --job-timeout {} s; lower --steps",
            row.label,
            args.job_timeout
        );
    };
    if !status.success() {
        bail!("{} failed ({status}):\n{out}", row.label);
    }
    Ok(Report {
        peak_mib: report_value(&out, "peak_rss_mib", &row.label)?,
        samples_per_s: report_value(&out, "samples/s", &row.label)?,
    })
}
