//! Who this process is in the job: rank, world size, local rank, where the rendezvous store is.
//!
//! Parsed once from the environment, the first launcher whose variables are set winning:
//!
//! 1. our launcher's `ACCELERATE_*` variables;
//! 2. torchrun's (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`,
//!    `MASTER_PORT`);
//! 3. Open MPI's `mpirun` (`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE`,
//!    `OMPI_COMM_WORLD_LOCAL_RANK`, `OMPI_COMM_WORLD_LOCAL_SIZE`);
//! 4. a PMI launcher: MPICH's Hydra, Intel MPI, `srun --mpi=pmi2` (`PMI_RANK`, `PMI_SIZE`,
//!    `MPI_LOCALRANKID`, `MPI_LOCALNRANKS`);
//! 5. SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, ...).
//!
//! MPI comes before SLURM because `mpirun` inside an `sbatch` allocation passes the batch step's
//! `SLURM_PROCID=0` and `SLURM_NTASKS` on to every rank it starts (and ranks that `orted` started
//! see the daemon step's `SLURM_PROCID`): read first, SLURM's variables would make several ranks
//! rank 0. Where SLURM starts the tasks itself the order costs nothing: under `srun` direct launch
//! Open MPI's variables are not set before the program runs, and under `srun --mpi=pmi2`
//! `PMI_RANK` equals `SLURM_PROCID`. With none of them set the process is alone: rank 0 of 1, no
//! store, no sockets.

use std::collections::HashMap;

use crate::env;
use crate::error::{Error, Result};

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// Nobody: a plain single process.
    None,
    /// `accelerate-launch` (it hosts the store and sets a job token).
    Accelerate,
    /// torchrun or anything else that sets `RANK`/`WORLD_SIZE` (rank 0 hosts the store).
    Torchrun,
    /// SLURM's `srun` (rank 0 hosts the store).
    Slurm,
    /// An MPI launcher: Open MPI's `mpirun`, or MPICH's / Intel MPI's through PMI (rank 0 hosts
    /// the store on `MASTER_PORT`; the user passes `MASTER_ADDR`/`MASTER_PORT` to every rank,
    /// e.g. `mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`).
    Mpi,
}

/// The identity of this process within its job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Number of processes in the job.
    pub world_size: usize,
    /// Rank among the processes of this machine; selects the GPU.
    pub local_rank: usize,
    /// Number of processes on this machine.
    pub local_world_size: usize,
    /// Host of the rendezvous store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of the rendezvous store (`MASTER_PORT`).
    pub master_port: u16,
    /// Secret every store client proves it holds (`ACCELERATE_JOB_TOKEN`): set by our launcher,
    /// and by the user for every rank under torchrun, SLURM or MPI on several machines (empty if
    /// not: a job on one machine then makes its own, and one on several is refused unless
    /// `ACCELERATE_ALLOW_OPEN_STORE` is set).
    pub job_token: String,
    /// How many times the launcher has restarted the group (`ACCELERATE_RESTART_COUNT`; under
    /// torchrun on one machine `TORCHELASTIC_RESTART_COUNT`): the store generation this process
    /// presents, so that a store of an earlier attempt refuses it and a straggler of an earlier
    /// attempt is refused by this one's.
    pub restart_count: u32,
    /// Who started the process.
    pub launcher: Launcher,
}

/// Default rendezvous port, as torchrun and Accelerate.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

impl ProcessState {
    /// A lone process: rank 0 of 1.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            job_token: String::new(),
            restart_count: 0,
            launcher: Launcher::None,
        }
    }

    /// Reads the process environment.
    pub fn from_env() -> Result<Self> {
        Self::from_vars(&std::env::vars().collect())
    }

    /// Parses the given environment (for tests and embedding).
    pub fn from_vars(vars: &HashMap<String, String>) -> Result<Self> {
        let get = |k: &str| vars.get(k).filter(|v| !v.is_empty());
        let (launcher, rank_var, world_var, local_var, local_world_var) = if get(env::RANK)
            .is_some()
        {
            (
                Launcher::Accelerate,
                env::RANK,
                env::WORLD_SIZE,
                env::LOCAL_RANK,
                env::LOCAL_WORLD_SIZE,
            )
        } else if get("RANK").is_some() || get("WORLD_SIZE").is_some() {
            (
                Launcher::Torchrun,
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
            )
        } else if get("OMPI_COMM_WORLD_RANK").is_some() && get("OMPI_COMM_WORLD_SIZE").is_some() {
            (
                Launcher::Mpi,
                "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE",
                "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE",
            )
        } else if get("PMI_RANK").is_some() && get("PMI_SIZE").is_some() {
            // Hydra and Intel MPI say where a rank sits on its machine; `srun --mpi=pmi2` does
            // not, and there the tasks are SLURM's, whose layout is in SLURM's variables.
            let (local_var, local_world_var) =
                if get("MPI_LOCALRANKID").is_none() && get("SLURM_LOCALID").is_some() {
                    ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
                } else {
                    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS")
                };
            (
                Launcher::Mpi,
                "PMI_RANK",
                "PMI_SIZE",
                local_var,
                local_world_var,
            )
        } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            (
                Launcher::Slurm,
                "SLURM_PROCID",
                "SLURM_NTASKS",
                "SLURM_LOCALID",
                "SLURM_NTASKS_PER_NODE",
            )
        } else {
            return Ok(Self::single());
        };
        let number = |name: &str, default: Option<usize>| -> Result<usize> {
            match get(name) {
                Some(v) => v.trim().parse::<usize>().map_err(|_| Error::Env {
                    name: name.into(),
                    value: v.clone(),
                    problem: "expected a non-negative integer".into(),
                }),
                None => default.ok_or_else(|| Error::Env {
                    name: name.into(),
                    value: String::new(),
                    problem: format!(
                        "it is unset although {rank_var} is set; a launcher sets both \
                         (run under accelerate-launch or torchrun, or unset {rank_var})"
                    ),
                }),
            }
        };
        let rank = number(rank_var, None)?;
        let world_size = number(world_var, None)?;
        if world_size == 0 {
            return Err(Error::Env {
                name: world_var.into(),
                value: "0".into(),
                problem: "a job has at least one process".into(),
            });
        }
        if rank >= world_size {
            return Err(Error::Env {
                name: rank_var.into(),
                value: rank.to_string(),
                problem: format!("rank must be below the world size {world_size} ({world_var})"),
            });
        }
        let local_rank = number(local_var, Some(rank))?;
        // srun sets SLURM_NTASKS_PER_NODE only when asked `--ntasks-per-node`; the step's
        // layout, one count per node ("2(x3),1"), is always there.
        let slurm_local = local_var == "SLURM_LOCALID";
        let slurm_layout = slurm_local
            .then(|| slurm_tasks_on_this_node(&get))
            .flatten();
        let local_world_size = match (slurm_layout, get(local_world_var)) {
            (Some(tasks), _) => tasks,
            // SLURM_NTASKS_PER_NODE may read "4(x2)"; take the leading count.
            (None, Some(v)) if slurm_local => v
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(world_size),
            _ => number(local_world_var, Some(world_size))?,
        };
        if local_rank >= local_world_size {
            return Err(Error::Env {
                name: local_var.into(),
                value: local_rank.to_string(),
                problem: format!(
                    "local rank must be below the local world size {local_world_size} ({local_world_var})"
                ),
            });
        }
        if get("MASTER_ADDR").is_none() && local_world_size < world_size {
            return Err(Error::Env {
                name: "MASTER_ADDR".into(),
                value: String::new(),
                problem: format!(
                    "unset, but the {world_size} processes span several machines ({local_world_size} \
                     on this one); set it to the first machine's address (under SLURM: \
                     `export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n1)`; \
                     under mpirun: `mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=<port> ...`)"
                ),
            });
        }
        let master_addr = get("MASTER_ADDR")
            .cloned()
            .unwrap_or_else(|| "127.0.0.1".into());
        let master_port = match get("MASTER_PORT") {
            Some(p) => p.trim().parse::<u16>().map_err(|_| Error::Env {
                name: "MASTER_PORT".into(),
                value: p.clone(),
                problem: "expected a TCP port number (1-65535)".into(),
            })?,
            None => DEFAULT_MASTER_PORT,
        };
        let count = |name: &str| {
            env::parse(
                name,
                get(name).map(String::as_str),
                "expected a non-negative integer",
                |v| v.parse::<u32>().ok(),
            )
        };
        let restart_count = match count(env::RESTART_COUNT)? {
            Some(n) => n,
            None if launcher == Launcher::Torchrun => {
                // torchrun's count is its agent's: the restarts this machine's workers caused
                // (pytorch#108158). Several agents count differently, and a generation that
                // differs between the machines would make the store refuse healthy ranks. There
                // torchrun fences the attempts itself: every agent stops its workers before it
                // joins the next attempt's rendezvous, and that attempt's rank 0 hosts a fresh
                // store, holding no key of the attempt before.
                let agents = get("GROUP_WORLD_SIZE")
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(world_size.div_ceil(local_world_size));
                match count("TORCHELASTIC_RESTART_COUNT")? {
                    Some(n) if agents == 1 => n,
                    _ => 0,
                }
            }
            None => 0,
        };
        Ok(Self {
            rank,
            world_size,
            local_rank,
            local_world_size,
            master_addr,
            master_port,
            job_token: get(env::JOB_TOKEN).cloned().unwrap_or_default(),
            restart_count,
            launcher,
        })
    }

    /// Whether this is global rank 0.
    pub fn is_main_process(&self) -> bool {
        self.rank == 0
    }

    /// Whether this is rank 0 of its machine.
    pub fn is_local_main_process(&self) -> bool {
        self.local_rank == 0
    }

    /// Whether more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

/// The number of tasks SLURM placed on this node (`SLURM_NODEID`), read from the step's layout
/// `SLURM_STEP_TASKS_PER_NODE` (else the job's `SLURM_TASKS_PER_NODE`): counts per node in node
/// order, runs of equal counts written `count(xnodes)`, e.g. "2(x3),1". `None` when either is
/// missing or does not parse.
fn slurm_tasks_on_this_node<'a>(get: &impl Fn(&str) -> Option<&'a String>) -> Option<usize> {
    let node: usize = get("SLURM_NODEID")?.trim().parse().ok()?;
    let layout = get("SLURM_STEP_TASKS_PER_NODE").or_else(|| get("SLURM_TASKS_PER_NODE"))?;
    let mut first_node = 0;
    for run in layout.split(',') {
        let (count, nodes) = match run.trim().split_once("(x") {
            Some((count, repeat)) => (count, repeat.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (run.trim(), 1),
        };
        if node < first_node + nodes {
            return count.parse().ok();
        }
        first_node += nodes;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn empty_environment_is_a_single_process() {
        assert_eq!(
            ProcessState::from_vars(&vars(&[])).unwrap(),
            ProcessState::single()
        );
    }

    #[test]
    fn torchrun_variables_are_read() {
        let s = ProcessState::from_vars(&vars(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!((s.master_addr.as_str(), s.master_port), ("10.0.0.1", 1234));
        assert_eq!(s.launcher, Launcher::Torchrun);
        assert!(!s.is_main_process() && !s.is_local_main_process());
    }

    #[test]
    fn our_variables_win_over_torchruns() {
        let s = ProcessState::from_vars(&vars(&[
            ("ACCELERATE_RANK", "1"),
            ("ACCELERATE_WORLD_SIZE", "2"),
            ("ACCELERATE_JOB_TOKEN", "secret"),
            ("RANK", "0"),
            ("WORLD_SIZE", "9"),
        ]))
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (1, 2, 1));
        assert_eq!(s.job_token, "secret");
        assert_eq!(s.launcher, Launcher::Accelerate);
    }

    #[test]
    fn slurm_task_counts_with_repeat_suffix() {
        let s = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("MASTER_ADDR", "node001"),
        ]))
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (5, 8, 1, 4)
        );
    }

    #[test]
    fn slurm_tasks_on_this_node_come_from_the_step_layout() {
        // `srun -N 3 -n 7` without --ntasks-per-node: 3, 2, 2 tasks on nodes 0, 1, 2.
        let on_node = |node: &str, procid: &str| {
            let s = ProcessState::from_vars(&vars(&[
                ("SLURM_PROCID", procid),
                ("SLURM_NTASKS", "7"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", node),
                ("SLURM_STEP_TASKS_PER_NODE", "3,2(x2)"),
                ("SLURM_TASKS_PER_NODE", "9(x3)"),
                ("MASTER_ADDR", "node001"),
            ]))
            .unwrap();
            (s.rank, s.world_size, s.local_world_size)
        };
        assert_eq!(on_node("0", "0"), (0, 7, 3));
        assert_eq!(on_node("1", "3"), (3, 7, 2));
        assert_eq!(on_node("2", "5"), (5, 7, 2));
        // On one node the layout is the world: no MASTER_ADDR needed.
        let s = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2"),
        ]))
        .unwrap();
        assert_eq!((s.local_rank, s.local_world_size), (1, 2));
        // Two nodes without MASTER_ADDR are refused although SLURM_NTASKS_PER_NODE is unset.
        let e = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_TASKS_PER_NODE", "2(x2)"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_ADDR"), "{e}");
    }

    #[test]
    fn open_mpi_variables_are_read() {
        let s = ProcessState::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "1234"),
            ("ACCELERATE_JOB_TOKEN", "secret"),
        ]))
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (3, 4, 1, 2)
        );
        assert_eq!((s.master_addr.as_str(), s.master_port), ("10.0.0.1", 1234));
        assert_eq!(s.job_token, "secret");
        assert_eq!(s.launcher, Launcher::Mpi);
        // All ranks on one machine: MASTER_ADDR and MASTER_PORT may be left out.
        let s = ProcessState::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!((s.rank, s.world_size, s.local_rank), (1, 2, 1));
        assert_eq!(
            (s.master_addr.as_str(), s.master_port),
            ("127.0.0.1", DEFAULT_MASTER_PORT)
        );
    }

    #[test]
    fn pmi_variables_are_read_with_or_without_the_local_layout() {
        // MPICH's Hydra and Intel MPI.
        let s = ProcessState::from_vars(&vars(&[
            ("PMI_RANK", "5"),
            ("PMI_SIZE", "8"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "4"),
            ("MASTER_ADDR", "node001"),
        ]))
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (5, 8, 1, 4)
        );
        assert_eq!(s.launcher, Launcher::Mpi);
        // Without the local layout every rank counts as on one machine.
        let s = ProcessState::from_vars(&vars(&[("PMI_RANK", "1"), ("PMI_SIZE", "2")])).unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (1, 2, 1, 2)
        );
        assert_eq!(s.launcher, Launcher::Mpi);
    }

    #[test]
    fn torchrun_comes_before_mpi_and_mpi_before_slurm() {
        // `mpirun -np 4` inside `sbatch`: every rank inherits the batch step's SLURM_PROCID=0 and
        // SLURM_NTASKS; Open MPI's variables say which rank it is.
        let in_sbatch = |rank: &str| {
            let s = ProcessState::from_vars(&vars(&[
                ("SLURM_PROCID", "0"),
                ("SLURM_NTASKS", "4"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", "0"),
                ("SLURM_TASKS_PER_NODE", "4"),
                ("OMPI_COMM_WORLD_RANK", rank),
                ("OMPI_COMM_WORLD_SIZE", "4"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", rank),
                ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
            ]))
            .unwrap();
            (s.launcher, s.rank, s.world_size, s.local_rank)
        };
        assert_eq!(in_sbatch("3"), (Launcher::Mpi, 3, 4, 3));
        assert_eq!(in_sbatch("0"), (Launcher::Mpi, 0, 4, 0));
        // MPICH's Hydra inside `sbatch`: PMI's variables, not the inherited SLURM ones.
        let s = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("MPI_LOCALRANKID", "2"),
            ("MPI_LOCALNRANKS", "3"),
        ]))
        .unwrap();
        assert_eq!(
            (
                s.launcher,
                s.rank,
                s.world_size,
                s.local_rank,
                s.local_world_size
            ),
            (Launcher::Mpi, 2, 3, 2, 3)
        );
        // `srun -N 2 -n 4 --mpi=pmi2`: PMI_RANK is SLURM_PROCID, and with no MPI_LOCALRANKID the
        // place on the node is SLURM's.
        let s = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
            ("PMI_RANK", "3"),
            ("PMI_SIZE", "4"),
            ("MASTER_ADDR", "node001"),
        ]))
        .unwrap();
        assert_eq!(
            (s.rank, s.world_size, s.local_rank, s.local_world_size),
            (3, 4, 1, 2)
        );
        // torchrun's variables win over Open MPI's.
        let s = ProcessState::from_vars(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!((s.launcher, s.rank), (Launcher::Torchrun, 0));
    }

    #[test]
    fn mpi_on_several_machines_without_master_addr_names_the_mpirun_fix() {
        let e = ProcessState::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "5"),
            ("OMPI_COMM_WORLD_SIZE", "8"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "4"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("MASTER_ADDR") && e.contains("mpirun -x MASTER_ADDR"),
            "{e}"
        );
        let e = ProcessState::from_vars(&vars(&[
            ("OMPI_COMM_WORLD_RANK", "2"),
            ("OMPI_COMM_WORLD_SIZE", "2"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("OMPI_COMM_WORLD_RANK") && e.contains("below"),
            "{e}"
        );
    }

    #[test]
    fn several_machines_without_master_addr_is_an_error_naming_it() {
        let e = ProcessState::from_vars(&vars(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_ADDR") && e.contains("scontrol"), "{e}");
    }

    #[test]
    fn bad_values_name_the_variable() {
        let e = ProcessState::from_vars(&vars(&[("RANK", "2"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("RANK") && e.contains("below the world size 2"),
            "{e}"
        );
        let e = ProcessState::from_vars(&vars(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=\"x\""), "{e}");
        let e = ProcessState::from_vars(&vars(&[("RANK", "0")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("WORLD_SIZE"), "{e}");
        let e = ProcessState::from_vars(&vars(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_PORT", "99999"),
        ]))
        .unwrap_err()
        .to_string();
        assert!(e.contains("MASTER_PORT"), "{e}");
    }

    /// torchrun's variables for rank `rank` of 2 in attempt `restart` of its agent, on one
    /// machine (`nodes` 1) or one rank on each of two machines (`nodes` 2).
    fn torchrun_attempt(rank: usize, nodes: usize, restart: &str) -> HashMap<String, String> {
        let local = if nodes == 1 { rank } else { 0 };
        let rank = rank.to_string();
        let local = local.to_string();
        let local_world = (2 / nodes).to_string();
        let group_world = nodes.to_string();
        vars(&[
            ("RANK", rank.as_str()),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", local.as_str()),
            ("LOCAL_WORLD_SIZE", local_world.as_str()),
            ("GROUP_WORLD_SIZE", group_world.as_str()),
            ("MASTER_ADDR", "127.0.0.1"),
            ("ACCELERATE_JOB_TOKEN", "shared"),
            ("TORCHELASTIC_RESTART_COUNT", restart),
        ])
    }

    #[test]
    fn a_restarted_torchrun_rank_is_refused_by_the_store_of_the_attempt_before() {
        use crate::comm::store::{Store, StoreServer, TcpStoreClient};
        use std::time::Duration;
        let wait = Duration::from_secs(10);
        // Attempt 0's store (its rank 0 not yet gone) holds attempt 0's keys, such as the ring
        // address a rank published then.
        let store = StoreServer::start("127.0.0.1:0".parse().unwrap(), "shared".into(), 0).unwrap();
        let old = TcpStoreClient::connect(store.local_addr(), "shared", 0, 1, wait).unwrap();
        old.set("cpu_comm/1/rank0", b"attempt 0's address").unwrap();
        // Rank 1 of attempt 1 connects as `comm::join` does, with its state's generation.
        let s = ProcessState::from_vars(&torchrun_attempt(1, 1, "1")).unwrap();
        let joined = TcpStoreClient::connect(
            store.local_addr(),
            &s.job_token,
            u64::from(s.restart_count),
            s.rank,
            wait,
        );
        match joined {
            Ok(client) => panic!(
                "a rank of torchrun's attempt 1 joined attempt 0's store and read {:?}",
                client
                    .get("cpu_comm/1/rank0", Duration::ZERO)
                    .map(|v| String::from_utf8_lossy(&v).into_owned())
            ),
            Err(e) => assert!(e.to_string().contains("generation 1"), "{e}"),
        }
    }

    #[test]
    fn torchrun_restarts_count_as_generations_only_where_one_agent_counts_them() {
        // One machine: one agent, whose count every rank sees.
        for rank in 0..2 {
            let s = ProcessState::from_vars(&torchrun_attempt(rank, 1, "2")).unwrap();
            assert_eq!(s.restart_count, 2, "rank {rank}");
        }
        // Two machines: each agent counts the restarts it caused (pytorch#108158), so the
        // machines' counts differ; the generation must not, or the store would refuse a healthy
        // machine's ranks.
        let a = ProcessState::from_vars(&torchrun_attempt(0, 2, "1")).unwrap();
        let b = ProcessState::from_vars(&torchrun_attempt(1, 2, "0")).unwrap();
        assert_eq!(a.restart_count, b.restart_count);
        // A value that is no count is named.
        let e = ProcessState::from_vars(&torchrun_attempt(0, 1, "x"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("TORCHELASTIC_RESTART_COUNT"), "{e}");
    }
}
