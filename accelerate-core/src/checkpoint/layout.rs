//! A prepared model's trained parameters as a checkpoint sees them: whole (names, shapes and
//! dtypes, whatever the ZeRO stage) and, under ZeRO, which elements of each one every rank keeps.
//! Stages 1 and 2 cut the optimizer state by their shard plan; stage 3 cuts the parameters
//! themselves (and so the optimizer state over them) by the units' layout. Saving records the cut
//! in the manifest ([`ZeroEntry`]); loading re-cuts what was saved to this run's.

use std::ops::Range;

use candle_core::{DType, Shape};

use super::manifest::{self, ParameterEntry, PieceEntry, ZeroEntry};
use crate::training::TrainingState;

/// Which elements of every parameter each rank keeps under ZeRO.
#[derive(Debug, Clone)]
pub(crate) struct Partition {
    /// The ZeRO stage (1, 2 or 3).
    pub stage: u8,
    /// Per rank, per parameter (sorted index): the elements of the flattened parameter it keeps.
    pieces: Vec<Vec<Option<Range<usize>>>>,
}

impl Partition {
    /// Rank `rank`'s pieces, per parameter (sorted index).
    pub fn rank(&self, rank: usize) -> &[Option<Range<usize>>] {
        &self.pieces[rank]
    }

    /// The number of ranks.
    pub fn world(&self) -> usize {
        self.pieces.len()
    }
}

/// One prepared model's trained parameters, whole, and their partition.
#[derive(Debug, Clone)]
pub(crate) struct ModelLayout {
    /// Every trained parameter whole, sorted by name: its name, shape and dtype (the f32 masters'
    /// under mixed precision).
    params: Vec<(String, Shape, DType)>,
    zero: Option<Partition>,
}

impl ModelLayout {
    /// `model`'s layout in a run of `world` ranks.
    pub fn of(model: &TrainingState, world: usize) -> Self {
        if let Some(fsdp) = model.fsdp() {
            let layout = fsdp.layout();
            let params: Vec<(String, Shape, DType)> = fsdp
                .pieces()
                .iter()
                .enumerate()
                .map(|(p, (name, piece))| (name.clone(), layout.shape(p).clone(), piece.dtype()))
                .collect();
            let pieces = (0..world)
                .map(|rank| (0..params.len()).map(|p| layout.piece(p, rank)).collect())
                .collect();
            return Self {
                params,
                zero: Some(Partition { stage: 3, pieces }),
            };
        }
        let params = model
            .parameters()
            .iter()
            .map(|(name, var)| (name.clone(), var.shape().clone(), var.dtype()))
            .collect();
        let zero = model.zero_plan().map(|(stage, plan)| Partition {
            stage,
            pieces: (0..plan.world()).map(|rank| plan.pieces(rank)).collect(),
        });
        Self { params, zero }
    }

    /// The manifest's entries of the parameters, whole.
    pub fn entries(&self) -> Vec<ParameterEntry> {
        self.params
            .iter()
            .map(|(name, shape, dtype)| manifest::parameter_entry(name, shape, *dtype))
            .collect()
    }

    /// Every parameter's name and whole shape, sorted by name.
    pub fn shapes(&self) -> Vec<(String, Shape)> {
        self.params
            .iter()
            .map(|(name, shape, _)| (name.clone(), shape.clone()))
            .collect()
    }

    /// The dtype the parameters are saved and loaded in (each parameter's own; under mixed
    /// precision the masters').
    pub fn dtype(&self, p: usize) -> DType {
        self.params[p].2
    }

    /// The partition under ZeRO.
    pub fn partition(&self) -> Option<&Partition> {
        self.zero.as_ref()
    }

    /// Whether the parameters themselves are cut into pieces (ZeRO stage 3): each rank holds, and
    /// loads, only its pieces.
    pub fn shards_parameters(&self) -> bool {
        self.zero.as_ref().is_some_and(|z| z.stage == 3)
    }

    /// The manifest's record of the partition (every rank's pieces by parameter name), saying
    /// whether the parameters were saved as those pieces.
    pub fn zero_entry(&self, sharded_parameters: bool) -> Option<ZeroEntry> {
        let zero = self.zero.as_ref()?;
        let pieces = zero
            .pieces
            .iter()
            .map(|ranks| {
                ranks
                    .iter()
                    .zip(&self.params)
                    .filter_map(|(piece, (name, _, _))| {
                        let piece = piece.as_ref()?;
                        Some(PieceEntry {
                            param: name.clone(),
                            start: piece.start as u64,
                            len: piece.len() as u64,
                        })
                    })
                    .collect()
            })
            .collect();
        Some(ZeroEntry {
            stage: zero.stage,
            world_size: zero.world(),
            pieces,
            sharded_parameters,
        })
    }
}
