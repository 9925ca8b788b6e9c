//! The environment each worker process starts with: torchrun's variables, so programs written for
//! torchrun work unchanged, plus our own `ACCELERATE_*` ones (the job token among them).

use std::collections::BTreeMap;

use accelerate_core::env;

use crate::config::file::StateDictType;

/// What the launcher knows about the job, enough to build every worker's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobLayout {
    /// Processes over all machines.
    pub world_size: usize,
    /// Processes on this machine.
    pub local_world_size: usize,
    /// This machine's rank.
    pub machine_rank: usize,
    /// Host of the rendezvous store.
    pub master_addr: String,
    /// Port of the rendezvous store.
    pub master_port: u16,
    /// Secret the store requires from every client.
    pub job_token: String,
    /// How many times the group has been restarted.
    pub restart_count: u32,
    /// Gradient accumulation steps to export, if given.
    pub gradient_accumulation_steps: Option<usize>,
    /// Mixed-precision mode to export (`no`, `bf16`, `fp16`), if given.
    pub mixed_precision: Option<accelerate_core::MixedPrecision>,
    /// ZeRO stage to export (0 to 3), if given.
    pub zero_stage: Option<u8>,
    /// Stage 3's unit classes to export (comma-separated), if given.
    pub fsdp_layer_classes: Option<String>,
    /// Stage 3's state dict type to export, if given.
    pub fsdp_state_dict_type: Option<StateDictType>,
    /// Stage 3's units gathered ahead in the forward pass to export, if given.
    pub fsdp_forward_prefetch: Option<usize>,
    /// Stage 3's units gathered ahead in the backward pass to export, if given.
    pub fsdp_backward_prefetch: Option<usize>,
    /// Whether to export stage 3's keeping of gathered units over an accumulation window (only
    /// when on: off leaves the worker's own setting, or its default, off).
    pub fsdp_keep_gathered: bool,
    /// Whether to train on the CPU.
    pub cpu: bool,
    /// Threads each worker may use for compute (cores shared among local workers).
    pub threads_per_worker: usize,
    /// Ranks placed on each GPU (`--ranks-per-gpu`, a testing switch; 1 normally).
    pub ranks_per_gpu: usize,
    /// This machine's host name, the stem of each rank's `NCCL_HOSTID` under `--ranks-per-gpu`.
    pub host_name: String,
}

impl JobLayout {
    /// Global rank of local rank `local_rank` on this machine.
    pub fn global_rank(&self, local_rank: usize) -> usize {
        self.machine_rank * self.local_world_size + local_rank
    }

    /// The variables set for the worker with `local_rank` (added to the inherited environment).
    /// `inherited` decides whether a thread-count variable the user set is kept.
    pub fn worker_env(
        &self,
        local_rank: usize,
        inherited: &dyn Fn(&str) -> bool,
    ) -> BTreeMap<String, String> {
        let rank = self.global_rank(local_rank);
        let mut env = BTreeMap::new();
        let mut set = |k: &str, v: String| {
            env.insert(k.to_string(), v);
        };
        for (r, w, lr, lw) in [
            ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
            (
                env::RANK,
                env::WORLD_SIZE,
                env::LOCAL_RANK,
                env::LOCAL_WORLD_SIZE,
            ),
        ] {
            set(r, rank.to_string());
            set(w, self.world_size.to_string());
            set(lr, local_rank.to_string());
            set(lw, self.local_world_size.to_string());
        }
        set("GROUP_RANK", self.machine_rank.to_string());
        set("MASTER_ADDR", self.master_addr.clone());
        set("MASTER_PORT", self.master_port.to_string());
        set(env::JOB_TOKEN, self.job_token.clone());
        set(env::RESTART_COUNT, self.restart_count.to_string());
        set("TORCHELASTIC_RESTART_COUNT", self.restart_count.to_string());
        if let Some(k) = self.gradient_accumulation_steps {
            set(env::GRADIENT_ACCUMULATION_STEPS, k.to_string());
        }
        if let Some(mode) = self.mixed_precision {
            set(env::MIXED_PRECISION, mode.as_str().into());
        }
        if let Some(stage) = self.zero_stage {
            set(env::ZERO_STAGE, stage.to_string());
        }
        if let Some(classes) = &self.fsdp_layer_classes {
            set(env::FSDP_LAYER_CLASSES, classes.clone());
        }
        if let Some(kind) = self.fsdp_state_dict_type {
            set(env::FSDP_STATE_DICT_TYPE, kind.as_str().into());
        }
        if let Some(units) = self.fsdp_forward_prefetch {
            set(env::FSDP_FORWARD_PREFETCH, units.to_string());
        }
        if let Some(units) = self.fsdp_backward_prefetch {
            set(env::FSDP_BACKWARD_PREFETCH, units.to_string());
        }
        if self.fsdp_keep_gathered {
            set(env::FSDP_KEEP_GATHERED, "1".into());
        }
        if self.cpu {
            set(env::USE_CPU, "1".into());
        } else {
            // A worker that cannot use its GPU must fail, not crawl on the CPU.
            set(env::DEVICE, "cuda".into());
            // Its GPU among those CUDA_VISIBLE_DEVICES shows (which is left as the user set it):
            // LOCAL_RANK normally, and every N-th under --ranks-per-gpu N.
            // NCCL connects at init rather than inside the first collective, where a peer that
            // never comes would block the call before the watchdog can time it (the worker sets
            // it too when started by another launcher).
            if !inherited("NCCL_RUNTIME_CONNECT") {
                set("NCCL_RUNTIME_CONNECT", "0".into());
            }
            let per_gpu = self.ranks_per_gpu.max(1);
            set(env::GPU_INDEX, (local_rank / per_gpu).to_string());
            if per_gpu > 1 {
                // NCCL refuses two ranks of one host on one GPU; a host id of its own per rank
                // makes each rank a host, connected over sockets (unique in the job through the
                // global rank).
                set("NCCL_HOSTID", format!("{}-rank{rank}", self.host_name));
            }
        }
        // As torchrun sets OMP_NUM_THREADS=1 for several workers per node: workers that each use
        // every core oversubscribe the machine. candle's CPU kernels follow RAYON_NUM_THREADS.
        if self.local_world_size > 1 {
            for var in ["OMP_NUM_THREADS", "RAYON_NUM_THREADS"] {
                if !inherited(var) {
                    set(var, self.threads_per_worker.to_string());
                }
            }
        }
        env
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> JobLayout {
        JobLayout {
            world_size: 4,
            local_world_size: 2,
            machine_rank: 1,
            master_addr: "10.1.2.3".into(),
            master_port: 29500,
            job_token: "t0k3n".into(),
            restart_count: 2,
            gradient_accumulation_steps: Some(4),
            mixed_precision: Some(accelerate_core::MixedPrecision::Bf16),
            zero_stage: Some(2),
            fsdp_layer_classes: None,
            fsdp_state_dict_type: None,
            fsdp_forward_prefetch: None,
            fsdp_backward_prefetch: None,
            fsdp_keep_gathered: false,
            cpu: true,
            threads_per_worker: 3,
            ranks_per_gpu: 1,
            host_name: "node7".into(),
        }
    }

    /// Two GPUs with three ranks each on the second of two machines (global ranks 6..12).
    fn three_ranks_per_gpu() -> JobLayout {
        JobLayout {
            world_size: 12,
            local_world_size: 6,
            cpu: false,
            ranks_per_gpu: 3,
            ..layout()
        }
    }

    #[test]
    fn ranks_per_gpu_share_each_gpu_in_order_with_distinct_nccl_host_ids() {
        let layout = three_ranks_per_gpu();
        let envs: Vec<_> = (0..6).map(|l| layout.worker_env(l, &|_| false)).collect();
        let column = |k: &str| -> Vec<String> { envs.iter().map(|e| e[k].clone()).collect() };
        assert_eq!(
            column("ACCELERATE_GPU_INDEX"),
            ["0", "0", "0", "1", "1", "1"]
        );
        assert_eq!(column("LOCAL_RANK"), ["0", "1", "2", "3", "4", "5"]);
        assert_eq!(column("RANK"), ["6", "7", "8", "9", "10", "11"]);
        assert!(column("WORLD_SIZE").iter().all(|w| w == "12"));
        assert!(column("LOCAL_WORLD_SIZE").iter().all(|w| w == "6"));
        assert!(column("ACCELERATE_DEVICE").iter().all(|d| d == "cuda"));
        let ids = column("NCCL_HOSTID");
        let distinct: std::collections::BTreeSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), 6, "{ids:?}");
        assert_eq!(ids[0], "node7-rank6");
        // CUDA_VISIBLE_DEVICES keeps the user's meaning: the index is into it.
        assert!(envs.iter().all(|e| !e.contains_key("CUDA_VISIBLE_DEVICES")));
    }

    #[test]
    fn one_rank_per_gpu_uses_its_local_rank_and_the_hosts_own_id() {
        let one_per_gpu = JobLayout {
            ranks_per_gpu: 1,
            ..three_ranks_per_gpu()
        };
        for local in 0..6 {
            let env = one_per_gpu.worker_env(local, &|_| false);
            assert_eq!(env["ACCELERATE_GPU_INDEX"], local.to_string());
            assert!(!env.contains_key("NCCL_HOSTID"));
            // NCCL connects at init, where a missing peer cannot block a collective's call.
            assert_eq!(env["NCCL_RUNTIME_CONNECT"], "0");
        }
        // Unless the user chose.
        let env = one_per_gpu.worker_env(0, &|k| k == "NCCL_RUNTIME_CONNECT");
        assert!(!env.contains_key("NCCL_RUNTIME_CONNECT"));
        // CPU workers are told no GPU at all.
        let env = layout().worker_env(0, &|_| false);
        assert!(!env.contains_key("ACCELERATE_GPU_INDEX") && !env.contains_key("NCCL_HOSTID"));
        assert!(!env.contains_key("NCCL_RUNTIME_CONNECT"));
    }

    #[test]
    fn torchrun_and_accelerate_variables_for_the_second_machine() {
        let env = layout().worker_env(1, &|_| false);
        let get = |k: &str| env.get(k).map(String::as_str);
        assert_eq!(get("RANK"), Some("3"));
        assert_eq!(get("ACCELERATE_RANK"), Some("3"));
        assert_eq!(get("LOCAL_RANK"), Some("1"));
        assert_eq!(get("WORLD_SIZE"), Some("4"));
        assert_eq!(get("LOCAL_WORLD_SIZE"), Some("2"));
        assert_eq!(get("MASTER_ADDR"), Some("10.1.2.3"));
        assert_eq!(get("ACCELERATE_JOB_TOKEN"), Some("t0k3n"));
        assert_eq!(get("ACCELERATE_RESTART_COUNT"), Some("2"));
        assert_eq!(get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS"), Some("4"));
        assert_eq!(get("ACCELERATE_MIXED_PRECISION"), Some("bf16"));
        assert_eq!(get("ACCELERATE_ZERO_STAGE"), Some("2"));
        assert_eq!(get("RAYON_NUM_THREADS"), Some("3"));
    }

    #[test]
    fn mixed_precision_is_exported_only_when_given() {
        let none = JobLayout {
            mixed_precision: None,
            ..layout()
        };
        // The worker's own ACCELERATE_MIXED_PRECISION (or the default, no) then applies.
        assert!(!none
            .worker_env(0, &|_| false)
            .contains_key("ACCELERATE_MIXED_PRECISION"));
    }

    #[test]
    fn zero_stage_is_exported_to_every_worker_only_when_given() {
        for local in 0..2 {
            let env = layout().worker_env(local, &|_| false);
            assert_eq!(env["ACCELERATE_ZERO_STAGE"], "2", "local rank {local}");
        }
        let stage_0 = JobLayout {
            zero_stage: Some(0),
            ..layout()
        };
        assert_eq!(
            stage_0.worker_env(1, &|_| false)["ACCELERATE_ZERO_STAGE"],
            "0"
        );
        let none = JobLayout {
            zero_stage: None,
            ..layout()
        };
        // The worker's own ACCELERATE_ZERO_STAGE (or the default, 0) then applies.
        assert!(!none
            .worker_env(0, &|_| false)
            .contains_key("ACCELERATE_ZERO_STAGE"));
    }

    #[test]
    fn fsdp_variables_are_exported_to_every_worker_only_when_given() {
        // The layout's own are None: nothing exported, the worker's defaults apply.
        for local in 0..2 {
            let env = layout().worker_env(local, &|_| false);
            assert!(!env.contains_key("ACCELERATE_FSDP_LAYER_CLASSES"));
            assert!(!env.contains_key("ACCELERATE_FSDP_STATE_DICT_TYPE"));
        }
        let stage_3 = JobLayout {
            zero_stage: Some(3),
            fsdp_layer_classes: Some("GPT2Block,GPT2MLP".into()),
            fsdp_state_dict_type: Some(StateDictType::Sharded),
            ..layout()
        };
        for local in 0..2 {
            let env = stage_3.worker_env(local, &|_| false);
            assert_eq!(env["ACCELERATE_ZERO_STAGE"], "3", "local rank {local}");
            assert_eq!(env["ACCELERATE_FSDP_LAYER_CLASSES"], "GPT2Block,GPT2MLP");
            assert_eq!(env["ACCELERATE_FSDP_STATE_DICT_TYPE"], "SHARDED_STATE_DICT");
        }
        // Either without the other.
        let full_only = JobLayout {
            fsdp_state_dict_type: Some(StateDictType::Full),
            ..layout()
        };
        let env = full_only.worker_env(0, &|_| false);
        assert_eq!(env["ACCELERATE_FSDP_STATE_DICT_TYPE"], "FULL_STATE_DICT");
        assert!(!env.contains_key("ACCELERATE_FSDP_LAYER_CLASSES"));
    }

    #[test]
    fn prefetch_and_keep_gathered_are_exported_to_every_worker_only_when_given() {
        const NAMES: [&str; 3] = [
            "ACCELERATE_FSDP_FORWARD_PREFETCH",
            "ACCELERATE_FSDP_BACKWARD_PREFETCH",
            "ACCELERATE_FSDP_KEEP_GATHERED",
        ];
        // Not given: nothing exported, the worker's own variables (or its defaults) apply.
        for local in 0..2 {
            let env = layout().worker_env(local, &|_| false);
            for name in NAMES {
                assert!(!env.contains_key(name), "{name}");
            }
        }
        let given = JobLayout {
            zero_stage: Some(3),
            fsdp_forward_prefetch: Some(2),
            fsdp_backward_prefetch: Some(0),
            fsdp_keep_gathered: true,
            ..layout()
        };
        for local in 0..2 {
            let env = given.worker_env(local, &|_| false);
            let values: Vec<_> = NAMES.iter().map(|n| env[*n].as_str()).collect();
            assert_eq!(values, ["2", "0", "1"], "local rank {local}");
        }
        // Each without the others.
        let backward_only = JobLayout {
            fsdp_backward_prefetch: Some(1),
            ..layout()
        };
        let env = backward_only.worker_env(1, &|_| false);
        assert_eq!(env["ACCELERATE_FSDP_BACKWARD_PREFETCH"], "1");
        assert!(!env.contains_key(NAMES[0]) && !env.contains_key(NAMES[2]));
    }

    #[test]
    fn a_thread_count_the_user_set_is_kept() {
        let env = layout().worker_env(0, &|v| v == "RAYON_NUM_THREADS");
        assert!(!env.contains_key("RAYON_NUM_THREADS"));
        assert_eq!(env.get("OMP_NUM_THREADS").map(String::as_str), Some("3"));
    }
}
