//! The plan of a multi-tensor optimizer launch (`cuda/multi_tensor.cu`): the table of tensors the
//! kernel reads (pointers, sizes, the block each tensor starts at), the per-step scalar sets
//! passed by value, and the grid size. Plain data, so that it is built and tested without a GPU;
//! `cuda_kernels` uploads and launches it.
//!
//! The table depends only on the tensors' addresses and sizes, their compute copies' kinds and
//! which scalar set each reads, all of which stay the same from step to step of a training run;
//! the scalars themselves (learning rate, bias corrections) change every step and travel in the
//! launch's parameters. So the table is uploaded once and reused while it is unchanged.

/// Scalars per tensor (`SCALARS` in the kernel source).
pub(crate) const SCALARS: usize = 8;

/// Distinct scalar sets one launch carries (`MAX_SETS` in the kernel source); more are split over
/// several launches.
pub(crate) const MAX_SETS: usize = 8;

/// 64-bit words per tensor in the table (`TensorArgs` in the kernel source).
pub(crate) const WORDS: usize = 8;

/// Elements per block: each block updates one chunk of one tensor.
pub(crate) const CHUNK: u64 = 8192;

/// The largest grid one launch may have (CUDA's limit on `gridDim.x`).
const MAX_BLOCKS: u64 = (1 << 31) - 1;

/// The element type of a tensor's compute copy (`COPY_*` in the kernel source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyKind {
    /// No compute copy is written.
    None = 0,
    /// bfloat16.
    Bf16 = 1,
    /// IEEE half precision.
    F16 = 2,
}

/// One tensor of a launch: device addresses (0 where absent), its element count, and the scalars
/// of its update this step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TensorSlot {
    /// The f32 parameter (read and written).
    pub p: u64,
    /// Its f32 gradient.
    pub g: u64,
    /// Its first and second f32 state tensors.
    pub state: [u64; 2],
    /// Its compute copy.
    pub copy: u64,
    /// What the compute copy holds.
    pub copy_kind: CopyKind,
    /// Elements.
    pub n: u64,
    /// The rule's scalars for this tensor's update.
    pub scalars: [f32; SCALARS],
}

/// One launch: the tensor table, the scalar sets it refers to, and its grid.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LaunchPlan {
    /// [`WORDS`] words per tensor, in the order of `TensorArgs`.
    pub table: Vec<u64>,
    /// [`MAX_SETS`] sets of [`SCALARS`] floats (unused sets are zero).
    pub sets: [f32; MAX_SETS * SCALARS],
    /// Blocks in the grid: the sum over the tensors of their chunks.
    pub blocks: u32,
}

impl LaunchPlan {
    /// Tensors in the table.
    pub fn tensors(&self) -> usize {
        self.table.len() / WORDS
    }
}

/// Launches that together update every tensor of `slots` with at least one element: as few as the
/// limits allow ([`MAX_SETS`] distinct scalar sets and `2^31 - 1` blocks per launch), so one in
/// the usual case of a few parameter groups whose parameters have all stepped equally often.
pub(crate) fn plan_launches(slots: &[TensorSlot]) -> Vec<LaunchPlan> {
    let mut plans = Vec::new();
    let mut current = Building::default();
    for slot in slots.iter().filter(|s| s.n > 0) {
        let chunks = slot.n.div_ceil(CHUNK);
        assert!(
            chunks <= MAX_BLOCKS,
            "a tensor of {} elements needs more blocks than one launch has",
            slot.n
        );
        let full = current.blocks + chunks > MAX_BLOCKS || !current.has_room_for(&slot.scalars);
        if full {
            plans.push(std::mem::take(&mut current).finish());
        }
        let set = current.set_of(&slot.scalars);
        current.table.extend_from_slice(&[
            slot.p,
            slot.g,
            slot.state[0],
            slot.state[1],
            slot.copy,
            slot.n,
            current.blocks,
            slot.copy_kind as u64 | (set as u64) << 8,
        ]);
        current.blocks += chunks;
    }
    if !current.table.is_empty() {
        plans.push(current.finish());
    }
    plans
}

/// A launch being filled.
#[derive(Default)]
struct Building {
    table: Vec<u64>,
    sets: Vec<[f32; SCALARS]>,
    blocks: u64,
}

impl Building {
    /// Whether `scalars` is one of the launch's sets, or could become one.
    fn has_room_for(&self, scalars: &[f32; SCALARS]) -> bool {
        self.sets.len() < MAX_SETS || self.position(scalars).is_some()
    }

    /// The index of the set holding `scalars` (bit for bit), added if new; the caller checked
    /// [`has_room_for`](Self::has_room_for).
    fn set_of(&mut self, scalars: &[f32; SCALARS]) -> usize {
        if let Some(i) = self.position(scalars) {
            return i;
        }
        debug_assert!(self.sets.len() < MAX_SETS);
        self.sets.push(*scalars);
        self.sets.len() - 1
    }

    fn position(&self, scalars: &[f32; SCALARS]) -> Option<usize> {
        let bits = |s: &[f32; SCALARS]| s.map(f32::to_bits);
        self.sets.iter().position(|s| bits(s) == bits(scalars))
    }

    fn finish(self) -> LaunchPlan {
        let mut sets = [0f32; MAX_SETS * SCALARS];
        for (dst, src) in sets.chunks_mut(SCALARS).zip(&self.sets) {
            dst.copy_from_slice(src);
        }
        LaunchPlan {
            table: self.table,
            sets,
            blocks: u32::try_from(self.blocks).expect("at most 2^31 - 1 blocks per launch"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(n: u64, scalar: f32, base: u64) -> TensorSlot {
        TensorSlot {
            p: base,
            g: base + 1,
            state: [base + 2, 0],
            copy: base + 3,
            copy_kind: CopyKind::Bf16,
            n,
            scalars: [scalar; SCALARS],
        }
    }

    /// The tensor that owns `block`, as the kernel finds it: the last one starting at or before it.
    fn owner(plan: &LaunchPlan, block: u64) -> usize {
        (0..plan.tensors())
            .rev()
            .find(|&t| plan.table[t * WORDS + 6] <= block)
            .unwrap()
    }

    #[test]
    fn every_element_of_every_tensor_is_covered_by_exactly_one_block() {
        let sizes = [1, CHUNK - 1, CHUNK, CHUNK + 1, 0, 3 * CHUNK, 7];
        let slots: Vec<_> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| slot(n, 1.0, 100 * i as u64))
            .collect();
        let plans = plan_launches(&slots);
        assert_eq!(plans.len(), 1, "one scalar set: one launch");
        let plan = &plans[0];
        // The empty tensor is left out; chunks: 1 + 1 + 1 + 2 + 3 + 1.
        assert_eq!(plan.tensors(), 6);
        assert_eq!(plan.blocks, 9);
        let mut covered: Vec<Vec<u32>> = sizes.iter().map(|&n| vec![0; n as usize]).collect();
        for block in 0..plan.blocks as u64 {
            let t = owner(plan, block);
            let row = &plan.table[t * WORDS..(t + 1) * WORDS];
            let (n, first) = (row[5], row[6]);
            let begin = (block - first) * CHUNK;
            assert!(begin < n, "block {block} starts inside tensor {t}");
            let original = sizes.iter().position(|&s| s == n).unwrap();
            assert_eq!(
                row[0],
                100 * original as u64,
                "the table keeps the pointers"
            );
            for i in begin..(begin + CHUNK).min(n) {
                covered[original][i as usize] += 1;
            }
        }
        assert!(covered.iter().flatten().all(|&c| c == 1));
    }

    #[test]
    fn tensors_share_scalar_sets_and_a_ninth_set_starts_a_second_launch() {
        // Two groups stepping together: two sets, one launch.
        let mut slots: Vec<_> = (0..6).map(|i| slot(10, (i % 2) as f32, 10 * i)).collect();
        slots[1].copy_kind = CopyKind::F16;
        slots[2].copy_kind = CopyKind::None;
        let plans = plan_launches(&slots);
        assert_eq!(plans.len(), 1);
        let set_of = |plan: &LaunchPlan, t: usize| plan.table[t * WORDS + 7] >> 8;
        assert_eq!(
            (0..6).map(|t| set_of(&plans[0], t)).collect::<Vec<_>>(),
            vec![0, 1, 0, 1, 0, 1]
        );
        assert_eq!(plans[0].sets[..SCALARS], [0.0; SCALARS]);
        assert_eq!(plans[0].sets[SCALARS..2 * SCALARS], [1.0; SCALARS]);
        let kind_of = |t: usize| plans[0].table[t * WORDS + 7] & 0xff;
        assert_eq!(
            (kind_of(0), kind_of(1), kind_of(2)),
            (1, 2, 0),
            "bf16, f16, none"
        );

        // Ten different sets: the ninth tensor opens a second launch.
        let slots: Vec<_> = (0..10).map(|i| slot(10, i as f32, 10 * i)).collect();
        let plans = plan_launches(&slots);
        assert_eq!(
            plans.iter().map(|p| p.tensors()).collect::<Vec<_>>(),
            [8, 2]
        );
        let second = &plans[1];
        assert_eq!(second.table[6], 0, "the second launch's blocks start at 0");
        assert_eq!(second.sets[SCALARS], 9.0);
        assert_eq!(second.table[WORDS + 7] >> 8, 1);
    }

    #[test]
    fn the_same_tensors_give_the_same_table_whatever_the_scalars() {
        let step = |s: f32| plan_launches(&[slot(5, s, 0), slot(5, s + 1.0, 10), slot(5, s, 20)]);
        let (a, b) = (step(1.0), step(2.0));
        assert_eq!(
            a[0].table, b[0].table,
            "the table is reused from step to step"
        );
        assert_ne!(a[0].sets, b[0].sets);
        assert!(plan_launches(&[slot(0, 1.0, 0)]).is_empty());
    }
}
