//! The [`Communicator`](super::Communicator) methods that the multi-rank backends (the CPU ring
//! and NCCL) implement alike, written once: the rank accessors, and the pair collectives
//! (`reduce_scatter`, `all_gather_into`), which agree with the other ranks and then run.

/// Expands, inside an `impl Communicator` block, to `rank`, `world_size`, `reduce_scatter`,
/// `reduce_scatter_agreed`, `all_gather_into` and `all_gather_into_agreed`, for a backend with
/// fields `rank` and `world_size` and the inherent methods
/// - `check_pair_devices(&self, input, output, op: &'static str) -> Result<()>`: refuses, before
///   the agreement, tensors on a device the backend cannot reach;
/// - [`Agree`](super::agreement::Agree): the pre-flight agreement;
/// - `run_with_output(&self, IntoOutput, input, output) -> Result<()>`: the collective
///   itself, on tensors this macro has checked against the contract.
macro_rules! ranked_methods {
    () => {
        fn rank(&self) -> usize {
            self.rank
        }

        fn world_size(&self) -> usize {
            self.world_size
        }

        fn reduce_scatter(
            &self,
            input: &candle_core::Tensor,
            output: &candle_core::Tensor,
            op: $crate::comm::ReduceOp,
        ) -> $crate::error::Result<()> {
            self.check_pair_devices(input, output, "reduce_scatter")?;
            let collective = $crate::comm::agreement::Collective::ReduceScatter(op);
            let signature = $crate::comm::agreement::Signature::of_pair(collective, input, output);
            $crate::comm::agreement::Agree::agree_on(self, collective, signature)?;
            self.reduce_scatter_agreed(input, output, op)
        }

        fn reduce_scatter_agreed(
            &self,
            input: &candle_core::Tensor,
            output: &candle_core::Tensor,
            op: $crate::comm::ReduceOp,
        ) -> $crate::error::Result<()> {
            let kind = $crate::comm::contract::IntoOutput::ReduceScatter(op);
            $crate::comm::contract::check_into_output(kind, input, output, self.world_size)?;
            self.run_with_output(kind, input, output)
        }

        fn all_gather_into(
            &self,
            input: &candle_core::Tensor,
            output: &candle_core::Tensor,
        ) -> $crate::error::Result<()> {
            self.check_pair_devices(input, output, "all_gather_into")?;
            let collective = $crate::comm::agreement::Collective::AllGatherInto;
            let signature = $crate::comm::agreement::Signature::of_pair(collective, input, output);
            $crate::comm::agreement::Agree::agree_on(self, collective, signature)?;
            self.all_gather_into_agreed(input, output)
        }

        fn all_gather_into_agreed(
            &self,
            input: &candle_core::Tensor,
            output: &candle_core::Tensor,
        ) -> $crate::error::Result<()> {
            let kind = $crate::comm::contract::IntoOutput::AllGatherInto;
            $crate::comm::contract::check_into_output(kind, input, output, self.world_size)?;
            self.run_with_output(kind, input, output)
        }
    };
}

pub(crate) use ranked_methods;
