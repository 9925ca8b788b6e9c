//! The one list of job variables the tests' processes run without: what a surrounding job
//! (our launcher, torchrun, SLURM, Open MPI, PMI/PMIx with MPICH and Intel MPI, a Kubernetes
//! operator) or a developer's shell may have set that would change what a test starts — which
//! rank it is, where its peers are. Every crate's harness removes them through
//! [`remove_job_env`]; a test that wants one sets it on its command.

use std::process::Command;

/// Variables removed by name: torchrun's worker environment (which the runtime also reads for
/// any launcher that sets it).
pub const INHERITED_JOB_ENV: &[&str] = &[
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
];

/// Prefixes of the variables removed like [`INHERITED_JOB_ENV`]: every `ACCELERATE_*` setting
/// (rank identity, job token, accumulation steps, mixed precision, timeouts, transport), SLURM's
/// task layout, torchrun's elastic state, MPI's rank layout (Open MPI's `OMPI_*`, PMI's `PMI_*`
/// and PMIx's `PMIX_*`, `MPI_LOCAL*` of MPICH and Intel MPI), and the `PET_*` variables that
/// Kubeflow's PyTorchJob sets for torchrun.
pub const INHERITED_JOB_ENV_PREFIXES: &[&str] = &[
    "ACCELERATE_",
    "SLURM_",
    "TORCHELASTIC_",
    "OMPI_",
    "PMI_",
    "PMIX_",
    "MPI_LOCAL",
    "PET_",
];

/// Whether `name` is a job variable: in [`INHERITED_JOB_ENV`] or under one of
/// [`INHERITED_JOB_ENV_PREFIXES`].
pub fn is_job_variable(name: &str) -> bool {
    INHERITED_JOB_ENV.contains(&name)
        || INHERITED_JOB_ENV_PREFIXES
            .iter()
            .any(|prefix| name.starts_with(prefix))
}

/// Removes every job variable this process has (and those of [`INHERITED_JOB_ENV`], whether it
/// has them or not) from `cmd`'s environment, so that `cmd` starts as outside any job.
pub fn remove_job_env(cmd: &mut Command) -> &mut Command {
    for name in INHERITED_JOB_ENV {
        cmd.env_remove(name);
    }
    for (name, _) in std::env::vars_os() {
        if is_job_variable(&name.to_string_lossy()) {
            cmd.env_remove(&name);
        }
    }
    cmd
}
