//! `accelerate config`: writes the config file `accelerate launch` reads, from questions (stdin a
//! terminal), from flags (no questions), or `accelerate config default` (this machine's default,
//! as Accelerate's own `accelerate config default` decides it).
//!
//! The flags are the fields of Accelerate's `ClusterConfig` that we run. There is no
//! `--max-restarts`: `ClusterConfig` has no such field and Accelerate refuses a file with a key it
//! lacks, so it stays an `accelerate launch` flag. `--zero-stage` and
//! `--gradient-accumulation-steps` write what Accelerate's DeepSpeed answers write
//! (`distributed_type: DEEPSPEED`, `deepspeed_config`), the only place its file keeps them.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

use accelerate_core::MixedPrecision;
use clap::{Parser, Subcommand};

use crate::commands::prompt::Prompter;
use crate::config::path::default_config_path;
use crate::config::write::{ConfigAnswers, DeepSpeedAnswers};
use crate::config::DistributedType;
use crate::gpus;

/// `accelerate config [default] [flags]`.
#[derive(Debug, Clone, Parser)]
pub struct ConfigArgs {
    /// `default`: write this machine's default config without questions.
    #[command(subcommand)]
    pub action: Option<ConfigAction>,

    /// Where to write (default: $HF_HOME/accelerate/default_config.yaml).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// NO (one process), MULTI_CPU or MULTI_GPU.
    #[arg(long, alias = "distributed_type", value_name = "TYPE", value_parser = parse_distributed_type)]
    pub distributed_type: Option<DistributedType>,

    /// Total number of processes (over all machines).
    #[arg(long, alias = "num_processes", value_name = "N")]
    pub num_processes: Option<usize>,

    /// Number of machines.
    #[arg(long, alias = "num_machines", value_name = "N")]
    pub num_machines: Option<usize>,

    /// This machine's rank among the machines.
    #[arg(long, alias = "machine_rank", value_name = "R")]
    pub machine_rank: Option<usize>,

    /// Address of machine rank 0 (several machines).
    #[arg(long, alias = "main_process_ip", value_name = "IP")]
    pub main_process_ip: Option<String>,

    /// Port of the rendezvous store on machine rank 0 (several machines).
    #[arg(long, alias = "main_process_port", value_name = "PORT")]
    pub main_process_port: Option<u16>,

    /// no, bf16 or fp16.
    #[arg(long, alias = "mixed_precision", value_name = "MODE")]
    pub mixed_precision: Option<MixedPrecision>,

    /// The GPUs to use: all, or indices separated by commas (e.g. 0,1).
    #[arg(long, alias = "gpu_ids", value_name = "IDS")]
    pub gpu_ids: Option<String>,

    /// Train on the CPU even where GPUs exist.
    #[arg(long, alias = "use_cpu")]
    pub use_cpu: bool,

    /// static or c10d: both mean the rendezvous store on machine rank 0.
    #[arg(long, alias = "rdzv_backend", value_name = "BACKEND", value_parser = ["static", "c10d"])]
    pub rdzv_backend: Option<String>,

    /// The machines share a local network (Accelerate's `same_network`).
    #[arg(long, alias = "same_network")]
    pub same_network: bool,

    /// ZeRO stage 0 to 3: writes distributed_type DEEPSPEED with deepspeed_config.zero_stage,
    /// as Accelerate's DeepSpeed answer does (GPU jobs only, as in Accelerate).
    #[arg(long, alias = "zero_stage", value_name = "N", value_parser = crate::cli::parse_zero_stage)]
    pub zero_stage: Option<u8>,

    /// Gradient accumulation steps, written as deepspeed_config.gradient_accumulation_steps (the
    /// only place Accelerate's file keeps them); needs --zero-stage.
    #[arg(long, alias = "gradient_accumulation_steps", value_name = "K")]
    pub gradient_accumulation_steps: Option<usize>,
}

/// The subcommands of `accelerate config`.
#[derive(Debug, Clone, Subcommand)]
pub enum ConfigAction {
    /// Write this machine's default config (several GPUs: MULTI_GPU, one per GPU; else NO), as
    /// Accelerate's `accelerate config default` does; an existing file is kept.
    Default(DefaultArgs),
}

/// `accelerate config default`'s flags.
#[derive(Debug, Clone, clap::Args)]
pub struct DefaultArgs {
    /// Where to write (default: $HF_HOME/accelerate/default_config.yaml).
    #[arg(long, alias = "config_file", value_name = "FILE")]
    pub config_file: Option<PathBuf>,

    /// no, bf16 or fp16.
    #[arg(
        long,
        alias = "mixed_precision",
        value_name = "MODE",
        default_value = "no"
    )]
    pub mixed_precision: MixedPrecision,
}

fn parse_distributed_type(value: &str) -> Result<DistributedType, String> {
    match DistributedType::parse(value) {
        // FSDP needs an fsdp_config, which neither the flags nor the questions write.
        Some(t) if !matches!(t, DistributedType::DeepSpeed | DistributedType::Fsdp) => Ok(t),
        _ => Err(
            "give NO, MULTI_CPU or MULTI_GPU (DEEPSPEED: add --zero-stage N to NO or \
                  MULTI_GPU)"
                .into(),
        ),
    }
}

/// Runs `accelerate config`; 0 when the file was written (or kept, under `default`), 2 with the
/// reason otherwise.
pub fn run(args: ConfigArgs) -> ExitCode {
    match config(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("accelerate config: error: {msg}");
            ExitCode::from(2)
        }
    }
}

fn target(explicit: Option<PathBuf>) -> Result<PathBuf, String> {
    explicit.or_else(default_config_path).ok_or_else(|| {
        "cannot tell where the default config goes: HF_HOME, XDG_CACHE_HOME and HOME are all \
         unset; set one, or give --config-file"
            .to_string()
    })
}

fn config(args: ConfigArgs) -> Result<(), String> {
    let gpus = gpus::visible_gpu_count();
    if let Some(ConfigAction::Default(d)) = args.action {
        let path = target(d.config_file)?;
        if path.exists() {
            // As Accelerate: scripts run it unconditionally (Dockerfiles, CI), so keeping a file
            // is not a failure.
            eprintln!(
                "accelerate config: configuration already exists at {}, will not override; run \
                 `accelerate config` to change it, or pass another --config-file",
                path.display()
            );
            return Ok(());
        }
        ConfigAnswers::default_for(gpus, d.mixed_precision).write(&path)?;
        println!("accelerate configuration saved at {}", path.display());
        return Ok(());
    }
    let path = target(args.config_file.clone())?;
    let answers = if args.any_answer() {
        args.answers_from_flags(gpus)?
    } else if std::io::stdin().is_terminal() {
        ask(gpus, std::io::stdin().lock(), std::io::stderr())?
    } else {
        return Err(
            "stdin is not a terminal, so there is no one to ask: give the answers as flags \
                    (e.g. `accelerate config --distributed-type MULTI_CPU --num-processes 4`), \
                    or run `accelerate config default`"
                .into(),
        );
    };
    check(&answers)?;
    answers.write(&path)?;
    println!("accelerate configuration saved at {}", path.display());
    Ok(())
}

impl ConfigArgs {
    fn any_answer(&self) -> bool {
        self.distributed_type.is_some()
            || self.num_processes.is_some()
            || self.num_machines.is_some()
            || self.machine_rank.is_some()
            || self.main_process_ip.is_some()
            || self.main_process_port.is_some()
            || self.mixed_precision.is_some()
            || self.gpu_ids.is_some()
            || self.use_cpu
            || self.rdzv_backend.is_some()
            || self.same_network
            || self.zero_stage.is_some()
            || self.gradient_accumulation_steps.is_some()
    }

    /// The answers the flags give, the others taking this machine's defaults; refuses a ZeRO
    /// answer Accelerate's own questions could not give.
    fn answers_from_flags(&self, gpus: usize) -> Result<ConfigAnswers, String> {
        let processes = self.num_processes.unwrap_or(1);
        let distributed_type = self.distributed_type.unwrap_or(match (self.use_cpu, gpus) {
            (true, _) | (false, 0) if processes > 1 => DistributedType::MultiCpu,
            (true, _) | (false, 0) => DistributedType::No,
            (false, 1) => DistributedType::No,
            (false, _) => DistributedType::MultiGpu,
        });
        let num_processes = self.num_processes.unwrap_or(match distributed_type {
            DistributedType::MultiGpu => gpus.max(1),
            _ => 1,
        });
        let use_cpu = self.use_cpu
            || (gpus == 0 && distributed_type != DistributedType::MultiGpu)
            || distributed_type == DistributedType::MultiCpu;
        let deepspeed = match (self.zero_stage, self.gradient_accumulation_steps) {
            (None, None) => None,
            (None, Some(k)) => {
                return Err(format!(
                    "--gradient-accumulation-steps {k} without --zero-stage: Accelerate's config \
                     file keeps gradient accumulation only under deepspeed_config (a DeepSpeed \
                     job); add --zero-stage 0 for plain data parallel, or pass \
                     --gradient-accumulation-steps {k} to `accelerate launch` instead"
                ))
            }
            (Some(_), Some(0)) => {
                return Err("--gradient-accumulation-steps 0: use 1 for no accumulation".into())
            }
            (Some(_), _) if use_cpu => {
                return Err(
                    "--zero-stage on the CPU: Accelerate offers DeepSpeed for GPU jobs only \
                     (its launcher ignores DeepSpeed with use_cpu); pass --zero-stage to \
                     `accelerate launch --cpu` to run our ZeRO on the CPU"
                        .into(),
                )
            }
            (Some(zero_stage), k) => Some(DeepSpeedAnswers {
                zero_stage,
                gradient_accumulation_steps: k.unwrap_or(1),
            }),
        };
        Ok(ConfigAnswers {
            distributed_type: if deepspeed.is_some() {
                DistributedType::DeepSpeed
            } else {
                distributed_type
            },
            num_processes,
            num_machines: self.num_machines.unwrap_or(1),
            machine_rank: self.machine_rank.unwrap_or(0),
            main_process_ip: self.main_process_ip.clone(),
            main_process_port: self.main_process_port,
            mixed_precision: self.mixed_precision.unwrap_or_default(),
            gpu_ids: self.gpu_ids.clone().filter(|ids| ids != "all"),
            use_cpu,
            rdzv_backend: self.rdzv_backend.clone().unwrap_or_else(|| "static".into()),
            same_network: self.same_network,
            deepspeed,
        })
    }
}

/// The interactive questions, short: the type, the machines, the processes, the GPUs, the
/// precision.
pub fn ask(
    gpus: usize,
    input: impl std::io::BufRead,
    out: impl std::io::Write,
) -> Result<ConfigAnswers, String> {
    let mut p = Prompter::new(input, out);
    let suggested = ConfigAnswers::default_for(gpus, MixedPrecision::No);
    let distributed_type = p.ask(
        "Distributed type: NO (one process), MULTI_CPU or MULTI_GPU?",
        suggested.distributed_type.as_str(),
        parse_distributed_type,
    )?;
    let whole = |min: usize| {
        move |a: &str| match a.parse::<usize>() {
            Ok(n) if n >= min => Ok(n),
            _ => Err(format!("give a whole number of at least {min}")),
        }
    };
    let mut answers = ConfigAnswers {
        distributed_type,
        use_cpu: distributed_type == DistributedType::MultiCpu
            || (gpus == 0 && distributed_type == DistributedType::No),
        ..suggested
    };
    if distributed_type != DistributedType::No {
        answers.num_machines = p.ask("How many machines?", "1", whole(1))?;
        if answers.num_machines > 1 {
            let last = answers.num_machines - 1;
            answers.machine_rank = p.ask("The rank of this machine?", "0", move |a| match a
                .parse::<usize>()
            {
                Ok(r) if r <= last => Ok(r),
                _ => Err(format!("give a rank from 0 to {last}")),
            })?;
            answers.main_process_ip =
                Some(p.ask("The IP address of machine rank 0?", "", |a| match a {
                    "" => Err("every machine needs it to reach the rendezvous store".into()),
                    a => Ok(a.to_string()),
                })?);
            answers.main_process_port = Some(p.ask(
                "The port of the rendezvous store on machine rank 0?",
                "29500",
                |a| {
                    a.parse::<u16>()
                        .ok()
                        .filter(|&p| p > 0)
                        .ok_or_else(|| "give a TCP port from 1 to 65535".to_string())
                },
            )?);
        }
        let (what, default) = match distributed_type {
            DistributedType::MultiGpu => ("GPU", gpus.max(1) * answers.num_machines),
            _ => ("CPU", 2 * answers.num_machines),
        };
        answers.num_processes = p.ask(
            &format!("How many {what} processes in total, over all machines?"),
            &default.to_string(),
            whole(1),
        )?;
        if distributed_type == DistributedType::MultiGpu {
            answers.gpu_ids = p.ask(
                "Which GPUs (indices separated by commas), or all?",
                "all",
                |a| {
                    if a == "all" {
                        Ok(None)
                    } else if a.split(',').all(|i| i.trim().parse::<u32>().is_ok()) {
                        Ok(Some(a.replace(' ', "")))
                    } else {
                        Err("give all, or GPU indices separated by commas (e.g. 0,1)".into())
                    }
                },
            )?;
        }
    }
    answers.mixed_precision = p.ask("Mixed precision: no, bf16 or fp16?", "no", |a| {
        a.parse::<MixedPrecision>()
            .map_err(|_| format!("give {}", MixedPrecision::VALID))
    })?;
    Ok(answers)
}

/// Refuses answers the launcher would refuse, before anything is written.
fn check(a: &ConfigAnswers) -> Result<(), String> {
    if a.distributed_type == DistributedType::No && a.num_processes > 1 {
        return Err(format!(
            "--distributed-type NO runs one process, not {}; use MULTI_CPU or MULTI_GPU",
            a.num_processes
        ));
    }
    if a.distributed_type == DistributedType::MultiGpu && a.use_cpu {
        return Err("--use-cpu with --distributed-type MULTI_GPU; use MULTI_CPU".into());
    }
    if a.num_processes == 0 || a.num_machines == 0 {
        return Err("a job needs at least one process on at least one machine".into());
    }
    if a.machine_rank >= a.num_machines {
        return Err(format!(
            "--machine-rank {} with --num-machines {}: machine ranks run from 0 to {}",
            a.machine_rank,
            a.num_machines,
            a.num_machines - 1
        ));
    }
    if a.num_machines > 1 && a.main_process_ip.is_none() {
        return Err(
            "--num-machines > 1 needs --main-process-ip (the address of machine rank 0)".into(),
        );
    }
    if a.num_processes % a.num_machines != 0 {
        return Err(format!(
            "--num-processes {} is not divisible by --num-machines {}; every machine runs the \
             same number of processes",
            a.num_processes, a.num_machines
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ConfigFile;

    #[test]
    fn answers_typed_at_the_prompt_are_written_and_read_back() {
        let script = "MULTI_CPU\n\n3\nbf16\n";
        let mut shown = Vec::new();
        let a = ask(0, script.as_bytes(), &mut shown).unwrap();
        let text = a.to_text();
        let read = ConfigFile::parse(std::path::Path::new("c.yaml"), &text).unwrap();
        assert_eq!(read.distributed_type, DistributedType::MultiCpu);
        assert_eq!(read.num_processes, Some(3));
        assert_eq!(read.num_machines, Some(1));
        assert_eq!(read.mixed_precision, Some(MixedPrecision::Bf16));
        assert!(read.use_cpu);
        assert!(read.ignored.is_empty(), "{:?}", read.ignored);
    }

    #[test]
    fn a_bad_answer_is_asked_again_with_the_reason() {
        let script = "FSDP\nNO\nfp8\nfp16\n";
        let mut shown = Vec::new();
        let a = ask(1, script.as_bytes(), &mut shown).unwrap();
        assert_eq!(a.distributed_type, DistributedType::No);
        assert_eq!(a.mixed_precision, MixedPrecision::Fp16);
        let shown = String::from_utf8(shown).unwrap();
        assert!(
            shown.contains("\"FSDP\": give NO, MULTI_CPU or MULTI_GPU"),
            "{shown}"
        );
        assert!(shown.contains("\"fp8\": give no, bf16 or fp16"), "{shown}");
        // The end of the input is an error, not a half-answered file.
        assert!(ask(1, "MULTI_GPU\n".as_bytes(), Vec::new()).is_err());
    }

    #[test]
    fn flags_without_a_type_pick_one_from_the_machine() {
        let args =
            ConfigArgs::try_parse_from(["config", "--num-processes", "4", "--use-cpu"]).unwrap();
        let a = args.answers_from_flags(8).unwrap();
        assert_eq!(
            (a.distributed_type, a.num_processes, a.use_cpu),
            (DistributedType::MultiCpu, 4, true)
        );
        let a = ConfigArgs::try_parse_from(["config", "--mixed-precision", "bf16"])
            .unwrap()
            .answers_from_flags(2)
            .unwrap();
        assert_eq!(
            (a.distributed_type, a.num_processes),
            (DistributedType::MultiGpu, 2)
        );
        let no = ConfigArgs::try_parse_from([
            "config",
            "--distributed-type",
            "NO",
            "--num-processes",
            "2",
        ])
        .unwrap()
        .answers_from_flags(0)
        .unwrap();
        assert!(check(&no).unwrap_err().contains("NO runs one process"));
    }

    fn from_flags(flags: &[&str], gpus: usize) -> Result<ConfigAnswers, String> {
        let mut argv = vec!["config"];
        argv.extend(flags);
        ConfigArgs::try_parse_from(argv)
            .unwrap()
            .answers_from_flags(gpus)
    }

    #[test]
    fn zero_stage_writes_accelerates_deepspeed_answer_and_reads_back() {
        // Accelerate's ClusterConfig (commands/config/config_args.py) built as cluster.py's
        // questions build it for multi-GPU, one machine, DeepSpeed yes, no DeepSpeed json file,
        // ZeRO stage 2, offload none/none, 4 accumulation steps, no clipping, no zero.Init, no
        // MoE, and written by its to_json_file (run from Accelerate's source with stub enums).
        // Its questions also write gpu_ids "all" and tpu_env [], which its `config default`
        // and our flags leave out; everything else is this, byte for byte.
        let want = "{\n  \"compute_environment\": \"LOCAL_MACHINE\",\n  \"debug\": false,\n  \
                    \"deepspeed_config\": {\n    \"gradient_accumulation_steps\": 4,\n    \
                    \"offload_optimizer_device\": \"none\",\n    \
                    \"offload_param_device\": \"none\",\n    \"zero3_init_flag\": false,\n    \
                    \"zero_stage\": 2\n  },\n  \"distributed_type\": \"DEEPSPEED\",\n  \
                    \"downcast_bf16\": false,\n  \"enable_cpu_affinity\": false,\n  \
                    \"machine_rank\": 0,\n  \"main_training_function\": \"main\",\n  \
                    \"mixed_precision\": \"no\",\n  \"num_machines\": 1,\n  \
                    \"num_processes\": 2,\n  \"rdzv_backend\": \"static\",\n  \
                    \"same_network\": false,\n  \"tpu_use_cluster\": false,\n  \
                    \"tpu_use_sudo\": false,\n  \"use_cpu\": false\n}\n";
        let a = from_flags(
            &["--zero-stage", "2", "--gradient-accumulation-steps", "4"],
            2,
        )
        .unwrap();
        assert_eq!(a.to_text(), want);
        let read = ConfigFile::parse(std::path::Path::new("c.yaml"), &a.to_text()).unwrap();
        assert_eq!(read.distributed_type, DistributedType::DeepSpeed);
        assert_eq!(read.zero_stage, Some(2));
        assert_eq!(read.gradient_accumulation_steps, Some(4));
        assert_eq!(read.num_processes, Some(2));
        assert!(read.ignored.is_empty(), "{:?}", read.ignored);
        // Stage 1 on two machines: no offload keys, a launcher on each machine.
        let a = from_flags(
            &[
                "--zero-stage",
                "1",
                "--num-machines",
                "2",
                "--num-processes",
                "4",
                "--main-process-ip",
                "10.0.0.1",
                "--rdzv-backend",
                "c10d",
                "--same-network",
            ],
            2,
        )
        .unwrap();
        check(&a).unwrap();
        let text = a.to_text();
        assert!(!text.contains("offload"), "{text}");
        assert!(
            text.contains("\"deepspeed_multinode_launcher\": \"standard\""),
            "{text}"
        );
        assert!(text.contains("\"rdzv_backend\": \"c10d\""), "{text}");
        assert!(text.contains("\"same_network\": true"), "{text}");
        let read = ConfigFile::parse(std::path::Path::new("c.yaml"), &text).unwrap();
        assert!(read.ignored.is_empty(), "{:?}", read.ignored);
        assert_eq!(
            (read.zero_stage, read.gradient_accumulation_steps),
            (Some(1), Some(1))
        );
        assert_eq!((read.num_machines, read.num_processes), (Some(2), Some(4)));
    }

    #[test]
    fn zero_answers_accelerate_could_not_write_are_refused_with_the_way_out() {
        let e = from_flags(&["--gradient-accumulation-steps", "4"], 2).unwrap_err();
        assert!(
            e.contains("--zero-stage") && e.contains("accelerate launch"),
            "{e}"
        );
        let e = from_flags(
            &["--zero-stage", "1", "--use-cpu", "--num-processes", "2"],
            0,
        )
        .unwrap_err();
        assert!(e.contains("GPU jobs only") && e.contains("--cpu"), "{e}");
        assert!(
            ConfigArgs::try_parse_from(["config", "--zero-stage", "4"]).is_err(),
            "there is no stage 4"
        );
        // Stage 3 is Accelerate's stage-3 answer: zero3_save_16bit_model asked, default no.
        let a = from_flags(&["--zero-stage", "3"], 2).unwrap();
        let text = a.to_text();
        assert!(text.contains("\"zero3_save_16bit_model\": false"), "{text}");
        let read = ConfigFile::parse(std::path::Path::new("c.yaml"), &text).unwrap();
        assert_eq!(read.zero_stage, Some(3));
        assert!(read.ignored.is_empty(), "{:?}", read.ignored);
        assert!(ConfigArgs::try_parse_from(["config", "--rdzv-backend", "etcd"]).is_err());
        // No --max-restarts: Accelerate's ClusterConfig has no such key and refuses unknown ones.
        assert!(ConfigArgs::try_parse_from(["config", "--max-restarts", "2"]).is_err());
    }
}
