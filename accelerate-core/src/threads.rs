//! Sizing the CPU thread pools of a worker that another launcher started.
//!
//! candle's CPU kernels (its own rayon pool, and gemm's, through
//! `candle_core::utils::get_num_threads`) and rayon's global pool, which the fused optimizer
//! kernels use, each start one thread per core unless `RAYON_NUM_THREADS` says otherwise. Several
//! workers on one machine that each take every core oversubscribe it. `accelerate-launch` sets
//! `RAYON_NUM_THREADS` and `OMP_NUM_THREADS` to its share of the cores for every worker; torchrun
//! sets only `OMP_NUM_THREADS` (1 for several workers per machine), and `srun` and `mpirun` set
//! neither. So a worker started by one of those sizes its pools itself, before candle starts one:
//!
//! - a `RAYON_NUM_THREADS` the user set stands;
//! - else `OMP_NUM_THREADS` when set (torchrun's choice, or the user's), so both kinds of pools
//!   agree; under torchrun with several workers per machine that is 1 thread, as PyTorch's own
//!   intra-op pools then get;
//! - else, under `srun`, `SLURM_CPUS_PER_TASK` when set (the CPUs SLURM gave each task), at most
//!   the usable cores: task/affinity or task/cgroup has already given each task its own CPUs, and
//!   dividing them again by the ranks of the machine would leave most of them idle;
//! - else, where the launcher bound its ranks (`srun`'s `SLURM_CPU_BIND*`, Open MPI's
//!   `OMPI_MCA_orte_bound_at_launch` or a `OMPI_MCA_hwloc_base_binding_policy` other than `none`)
//!   and the affinity mask holds fewer CPUs than are online, the mask is this rank's own: all of
//!   it, divided only among the ranks that must share it when the masks cannot all be disjoint
//!   (Open MPI binds to a socket for more than 2 ranks: 4 ranks on 2 sockets of 8 cores get 4
//!   threads each);
//! - else the cores this process may run on (its affinity mask, within a cgroup CPU quota)
//!   divided by the number of ranks on this machine, at least 1, so that a rank never takes more
//!   than its share of a mask that all the machine's ranks share.
//!
//! A lone process, and a worker of `accelerate-launch`, are left as they are.

use std::sync::Once;

use crate::process::{Launcher, ProcessState};

/// Where a thread count came from, for the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThreadCountSource {
    /// The `OMP_NUM_THREADS` the launcher or the user set.
    OmpNumThreads,
    /// The CPUs SLURM gave each task (`SLURM_CPUS_PER_TASK`), at most the usable cores.
    SlurmCpusPerTask {
        /// `SLURM_CPUS_PER_TASK`.
        cpus_per_task: usize,
        /// Cores in the affinity mask (or available parallelism).
        cores: usize,
    },
    /// The cores the launcher bound this rank to, shared only where the masks of the machine's
    /// ranks cannot all be disjoint.
    BoundCores {
        /// Cores in the affinity mask.
        cores: usize,
        /// CPUs online on the machine.
        online: usize,
        /// Ranks estimated to share the mask: ⌈ranks on this machine × cores / online⌉.
        sharing: usize,
    },
    /// The cores this process may use, shared among the ranks of its machine.
    CoresPerLocalRank {
        /// Cores in the affinity mask (or available parallelism).
        cores: usize,
        /// Ranks on this machine.
        local_ranks: usize,
    },
}

/// What to do with the CPU thread pools of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThreadPoolSizing {
    /// Leave them: a lone process, a worker of `accelerate-launch`, or `RAYON_NUM_THREADS` set.
    Keep,
    /// Set `RAYON_NUM_THREADS` (and `OMP_NUM_THREADS` when unset) to `threads`.
    Set {
        /// Threads per pool.
        threads: usize,
        /// Why that many.
        source: ThreadCountSource,
    },
}

/// The CPUs a process sees, for [`decide`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuView {
    /// The cores this process may run on ([`usable_cores`]).
    pub usable: usize,
    /// The CPUs online on the machine ([`online_cpus`]).
    pub online: usize,
}

/// The rule of this module: from who started the process, its local world size, the variable
/// lookup `var` and the CPUs it sees, the pool size (pure, for tests).
pub fn decide(
    launcher: Launcher,
    local_world_size: usize,
    var: &dyn Fn(&str) -> Option<String>,
    cpus: CpuView,
) -> ThreadPoolSizing {
    let set = |name: &str| var(name).filter(|v| !v.trim().is_empty());
    let count = |name: &str| {
        set(name)
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
    };
    if matches!(launcher, Launcher::None | Launcher::Accelerate)
        || set("RAYON_NUM_THREADS").is_some()
    {
        return ThreadPoolSizing::Keep;
    }
    if let Some(omp) = set("OMP_NUM_THREADS") {
        // OpenMP allows a list ("4,2" for nested levels); the first level is the pool's.
        if let Some(threads) = omp
            .split(',')
            .next()
            .and_then(|n| n.trim().parse::<usize>().ok())
            .filter(|&n| n > 0)
        {
            return ThreadPoolSizing::Set {
                threads,
                source: ThreadCountSource::OmpNumThreads,
            };
        }
    }
    let cores = cpus.usable.max(1);
    if launcher == Launcher::Slurm {
        if let Some(cpus_per_task) = count("SLURM_CPUS_PER_TASK") {
            return ThreadPoolSizing::Set {
                threads: cpus_per_task.min(cores),
                source: ThreadCountSource::SlurmCpusPerTask {
                    cpus_per_task,
                    cores,
                },
            };
        }
    }
    let local_ranks = local_world_size.max(1);
    if launcher_bound_ranks(launcher, &set) && cores < cpus.online {
        let sharing = (local_ranks * cores).div_ceil(cpus.online).max(1);
        return ThreadPoolSizing::Set {
            threads: (cores / sharing).max(1),
            source: ThreadCountSource::BoundCores {
                cores,
                online: cpus.online,
                sharing,
            },
        };
    }
    ThreadPoolSizing::Set {
        threads: (cores / local_ranks).max(1),
        source: ThreadCountSource::CoresPerLocalRank { cores, local_ranks },
    }
}

/// Whether the launcher bound each rank to CPUs of its own, by what it exports: `srun`'s
/// `SLURM_CPU_BIND_TYPE`/`SLURM_CPU_BIND` (other than `none`); Open MPI 4's
/// `OMPI_MCA_orte_bound_at_launch=1` (set whenever `mpirun` bound, by default for up to 2 ranks)
/// or the `--bind-to` policy it exports as `OMPI_MCA_hwloc_base_binding_policy` (other than
/// `none`). Only the variables of the launcher that started this rank count: ranks `mpirun`
/// started inside an `sbatch` allocation inherit the batch step's SLURM variables.
fn launcher_bound_ranks(launcher: Launcher, set: &dyn Fn(&str) -> Option<String>) -> bool {
    let bound = |policy: Option<String>| policy.is_some_and(|p| !p.contains("none"));
    match launcher {
        Launcher::Slurm => bound(set("SLURM_CPU_BIND_TYPE").or_else(|| set("SLURM_CPU_BIND"))),
        Launcher::Mpi => {
            set("OMPI_MCA_orte_bound_at_launch").is_some_and(|v| v.trim() == "1")
                || bound(set("OMPI_MCA_hwloc_base_binding_policy"))
        }
        Launcher::None | Launcher::Accelerate | Launcher::Torchrun => false,
    }
}

/// The cores this process may run on: its affinity mask, within what the standard library sees
/// as available (which also counts a cgroup CPU quota).
pub fn usable_cores() -> usize {
    let available = std::thread::available_parallelism().map_or(1, |n| n.get());
    affinity_cores().map_or(available, |mask| mask.min(available).max(1))
}

/// The CPUs online on this machine, whatever this process's mask
/// (`sysconf(_SC_NPROCESSORS_ONLN)`); the available parallelism where that is unknown.
pub fn online_cpus() -> usize {
    #[cfg(unix)]
    {
        // SAFETY: sysconf only reads a system setting.
        let online = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        if let Ok(n) = usize::try_from(online) {
            if n > 0 {
                return n;
            }
        }
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

#[cfg(target_os = "linux")]
fn affinity_cores() -> Option<usize> {
    // SAFETY: cpu_set_t is plain data, all zeroes is an empty set; sched_getaffinity writes at
    // most size_of::<cpu_set_t>() bytes into it, and CPU_COUNT only reads it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        usize::try_from(libc::CPU_COUNT(&set))
            .ok()
            .filter(|&n| n > 0)
    }
}

#[cfg(not(target_os = "linux"))]
fn affinity_cores() -> Option<usize> {
    None
}

/// Applies [`decide`] to this process once: sets `RAYON_NUM_THREADS` (and `OMP_NUM_THREADS`
/// when unset), builds rayon's global pool with that many threads, and says so on local rank 0.
/// Called where the `Accelerator` is built, before it runs any tensor op.
pub fn size_cpu_pools(state: &ProcessState) {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let sizing = decide(
            state.launcher,
            state.local_world_size,
            &|name| std::env::var(name).ok(),
            CpuView {
                usable: usable_cores(),
                online: online_cpus(),
            },
        );
        let ThreadPoolSizing::Set { threads, source } = sizing else {
            return;
        };
        // Setting a variable races with threads that read the environment at the same time
        // (getenv in C code). This runs while the Accelerator is built, before the training
        // starts its threads: the store and heartbeat threads start later in the same build, and
        // candle reads RAYON_NUM_THREADS only when it first starts a pool. A program that has
        // started threads of its own reading the environment should set RAYON_NUM_THREADS itself,
        // which leaves the environment untouched here.
        std::env::set_var("RAYON_NUM_THREADS", threads.to_string());
        if std::env::var_os("OMP_NUM_THREADS").is_none() {
            std::env::set_var("OMP_NUM_THREADS", threads.to_string());
        }
        let why = match source {
            ThreadCountSource::OmpNumThreads => "OMP_NUM_THREADS".to_string(),
            ThreadCountSource::SlurmCpusPerTask {
                cpus_per_task,
                cores,
            } => format!("SLURM_CPUS_PER_TASK={cpus_per_task}, {cores} usable cores"),
            ThreadCountSource::BoundCores {
                cores,
                online,
                sharing: 1,
            } => format!("the {cores} of {online} cores the launcher bound this rank to"),
            ThreadCountSource::BoundCores {
                cores,
                online,
                sharing,
            } => format!(
                "the {cores} of {online} cores the launcher bound this rank to / {sharing} ranks \
                 sharing them"
            ),
            ThreadCountSource::CoresPerLocalRank { cores, local_ranks } => {
                format!("{cores} usable cores / {local_ranks} ranks on this machine")
            }
        };
        let global = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build_global();
        if state.is_local_main_process() {
            let plural = if threads == 1 { "" } else { "s" };
            let line = format!(
                "sized the CPU thread pool to {threads} thread{plural} per rank ({why}); set \
                 RAYON_NUM_THREADS to choose"
            );
            tracing::info!("{line}");
            eprintln!("accelerate: {line}");
        }
        if global.is_err() && rayon::current_num_threads() != threads {
            let line = format!(
                "rayon's global thread pool was already started with {} threads before the \
                 Accelerator was built, so it keeps them (candle's own pool takes {threads}); \
                 build the Accelerator before running tensor code, or set RAYON_NUM_THREADS",
                rayon::current_num_threads()
            );
            tracing::warn!("{line}");
            eprintln!("accelerate: warning on rank {}: {line}", state.rank);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    /// A process that may use `usable` of the machine's `online` CPUs.
    fn cpus(usable: usize, online: usize) -> CpuView {
        CpuView { usable, online }
    }

    fn threads(sizing: ThreadPoolSizing) -> usize {
        match sizing {
            ThreadPoolSizing::Set { threads, .. } => threads,
            ThreadPoolSizing::Keep => panic!("expected a size, got Keep"),
        }
    }

    #[test]
    fn a_lone_process_and_our_launchers_workers_are_left_alone() {
        for launcher in [Launcher::None, Launcher::Accelerate] {
            assert_eq!(
                decide(launcher, 2, &vars(&[]), cpus(16, 16)),
                ThreadPoolSizing::Keep
            );
        }
    }

    #[test]
    fn a_rayon_count_the_user_set_stands_under_every_launcher() {
        for launcher in [Launcher::Torchrun, Launcher::Slurm, Launcher::Mpi] {
            let env = [
                ("RAYON_NUM_THREADS", "7"),
                ("OMP_NUM_THREADS", "1"),
                ("SLURM_CPUS_PER_TASK", "8"),
            ];
            assert_eq!(
                decide(launcher, 2, &vars(&env), cpus(16, 16)),
                ThreadPoolSizing::Keep
            );
        }
    }

    #[test]
    fn torchruns_omp_num_threads_sizes_the_pool() {
        // torchrun sets OMP_NUM_THREADS=1 for several workers per machine.
        let env = [("OMP_NUM_THREADS", "1")];
        assert_eq!(
            decide(Launcher::Torchrun, 4, &vars(&env), cpus(16, 16)),
            ThreadPoolSizing::Set {
                threads: 1,
                source: ThreadCountSource::OmpNumThreads
            }
        );
        // A nested list: the outer level. The user's count also beats SLURM's CPUs per task.
        let env = [("OMP_NUM_THREADS", "6,2"), ("SLURM_CPUS_PER_TASK", "8")];
        assert!(matches!(
            decide(Launcher::Slurm, 4, &vars(&env), cpus(16, 16)),
            ThreadPoolSizing::Set { threads: 6, .. }
        ));
    }

    #[test]
    fn without_a_count_the_usable_cores_are_shared_among_the_local_ranks() {
        // 16 cores, 4 ranks on this machine: 4 each.
        assert_eq!(
            decide(Launcher::Mpi, 4, &vars(&[]), cpus(16, 16)),
            ThreadPoolSizing::Set {
                threads: 4,
                source: ThreadCountSource::CoresPerLocalRank {
                    cores: 16,
                    local_ranks: 4
                }
            }
        );
        // More ranks than cores: one thread, never none.
        assert!(matches!(
            decide(Launcher::Mpi, 2, &vars(&[]), cpus(1, 1)),
            ThreadPoolSizing::Set { threads: 1, .. }
        ));
        // A blank or unusable OMP_NUM_THREADS counts as unset.
        for omp in ["", "0", "many"] {
            let env = [("OMP_NUM_THREADS", omp)];
            assert!(
                matches!(
                    decide(Launcher::Slurm, 3, &vars(&env), cpus(12, 12)),
                    ThreadPoolSizing::Set { threads: 4, .. }
                ),
                "{omp:?}"
            );
        }
    }

    #[test]
    fn slurm_cpus_per_task_is_each_tasks_own_count() {
        // `srun -n 4 --cpus-per-task=8` on a 32-CPU node, each task bound to its 8 CPUs: 8, not
        // 8 / 4 ranks.
        let env = [
            ("SLURM_CPUS_PER_TASK", "8"),
            ("SLURM_CPU_BIND_TYPE", "mask_cpu:"),
        ];
        assert_eq!(
            decide(Launcher::Slurm, 4, &vars(&env), cpus(8, 32)),
            ThreadPoolSizing::Set {
                threads: 8,
                source: ThreadCountSource::SlurmCpusPerTask {
                    cpus_per_task: 8,
                    cores: 8
                }
            }
        );
        // Unbound (task/none, or one cgroup for the whole step): still 8 of the 32 it sees.
        let env = [("SLURM_CPUS_PER_TASK", "8")];
        assert_eq!(
            threads(decide(Launcher::Slurm, 4, &vars(&env), cpus(32, 32))),
            8
        );
        // Never more than the process may use: a mask or quota of 2.
        assert_eq!(
            threads(decide(Launcher::Slurm, 4, &vars(&env), cpus(2, 32))),
            2
        );
        // Inherited by ranks that mpirun started inside the allocation, it does not count.
        assert_eq!(
            threads(decide(Launcher::Mpi, 4, &vars(&env), cpus(32, 32))),
            8
        );
        // Unusable values count as unset: 32 / 4.
        for bad in ["", "0", "eight"] {
            let env = [("SLURM_CPUS_PER_TASK", bad)];
            assert_eq!(
                threads(decide(Launcher::Slurm, 4, &vars(&env), cpus(32, 32))),
                8,
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_mask_the_launcher_bound_is_the_ranks_own() {
        // srun's binding without --cpus-per-task: 4 tasks on a 16-CPU node, 4 CPUs each.
        let slurm = [
            ("SLURM_CPU_BIND_TYPE", "mask_cpu:"),
            ("SLURM_CPU_BIND", "quiet,mask_cpu:0xF"),
        ];
        assert_eq!(
            decide(Launcher::Slurm, 4, &vars(&slurm), cpus(4, 16)),
            ThreadPoolSizing::Set {
                threads: 4,
                source: ThreadCountSource::BoundCores {
                    cores: 4,
                    online: 16,
                    sharing: 1
                }
            }
        );
        // Open MPI 4.1, as `mpirun --bind-to core -np 2 env` prints here: each rank on its core.
        let ompi_core = [
            ("OMPI_MCA_orte_bound_at_launch", "1"),
            ("OMPI_MCA_hwloc_base_binding_policy", "core"),
        ];
        assert_eq!(
            threads(decide(Launcher::Mpi, 2, &vars(&ompi_core), cpus(1, 2))),
            1
        );
        // `mpirun --bind-to core --map-by slot:PE=4 -np 3` on 16 CPUs: 4 each, not 4 / 3.
        assert_eq!(
            threads(decide(Launcher::Mpi, 3, &vars(&ompi_core), cpus(4, 16))),
            4
        );
        // Open MPI's default binding for more than 2 ranks, one socket each: 4 ranks on 2
        // sockets of 8 cores share each mask by 2.
        let ompi_default = [("OMPI_MCA_orte_bound_at_launch", "1")];
        assert_eq!(
            decide(Launcher::Mpi, 4, &vars(&ompi_default), cpus(8, 16)),
            ThreadPoolSizing::Set {
                threads: 4,
                source: ThreadCountSource::BoundCores {
                    cores: 8,
                    online: 16,
                    sharing: 2
                }
            }
        );
    }

    #[test]
    fn a_mask_nobody_bound_per_rank_is_shared_by_the_machines_ranks() {
        // `docker --cpuset-cpus=0-3` or `taskset -c 0-3 mpirun`: 4 CPUs of 16 for all 4 ranks.
        for (launcher, env) in [
            (Launcher::Mpi, vec![]),
            (
                Launcher::Mpi,
                vec![("OMPI_MCA_hwloc_base_binding_policy", "none")],
            ),
            (Launcher::Slurm, vec![("SLURM_CPU_BIND_TYPE", "none")]),
            (Launcher::Slurm, vec![("SLURM_CPU_BIND", "quiet,none")]),
            // torchrun binds nothing; a bare torchrun (no OMP_NUM_THREADS) divides.
            (
                Launcher::Torchrun,
                vec![("SLURM_CPU_BIND_TYPE", "mask_cpu:")],
            ),
            // mpirun inside an srun step that was bound: SLURM's variables are not mpirun's.
            (Launcher::Mpi, vec![("SLURM_CPU_BIND_TYPE", "mask_cpu:")]),
        ] {
            assert_eq!(
                decide(launcher, 4, &vars(&env), cpus(4, 16)),
                ThreadPoolSizing::Set {
                    threads: 1,
                    source: ThreadCountSource::CoresPerLocalRank {
                        cores: 4,
                        local_ranks: 4
                    }
                },
                "{launcher:?} {env:?}"
            );
        }
        // Bound, but to every CPU online (one socket): the mask is shared, 2 / 2.
        let env = [("OMPI_MCA_orte_bound_at_launch", "1")];
        assert_eq!(
            threads(decide(Launcher::Mpi, 2, &vars(&env), cpus(2, 2))),
            1
        );
    }

    #[test]
    fn the_machine_has_at_least_the_cores_this_process_may_use() {
        // An independent reference: the CPUs online as Linux lists them.
        let online = online_cpus();
        assert!(usable_cores() >= 1 && usable_cores() <= online);
        #[cfg(target_os = "linux")]
        {
            let listed = std::fs::read_to_string("/sys/devices/system/cpu/online").unwrap();
            let count: usize = listed
                .trim()
                .split(',')
                .map(|range| match range.split_once('-') {
                    Some((a, b)) => b.parse::<usize>().unwrap() - a.parse::<usize>().unwrap() + 1,
                    None => 1,
                })
                .sum();
            assert_eq!(online, count, "/sys/devices/system/cpu/online = {listed:?}");
        }
    }
}
