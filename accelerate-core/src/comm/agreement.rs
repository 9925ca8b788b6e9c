//! The pre-flight agreement of a collective: before the data moves, the ranks exchange what each
//! is about to do (the operation, the element count and dtype of its tensor, the root) in one
//! tiny all-gather, and refuse together when they differ.
//!
//! NCCL cannot detect a rank passing a tensor of another size: it reads or writes past the end of
//! the smaller buffer, or waits forever for bytes that never come. The CPU transports notice it
//! only part of the way through the collective, and a rank with an empty tensor may not notice at
//! all. With the agreement every rank learns every rank's signature first, so all of them refuse
//! with the same error, naming each rank and what it passed, and nobody is left waiting.
//!
//! The runtime's own gradient buckets skip it (`Communicator::all_reduce_agreed`): their sizes
//! were agreed once at `prepare`, when the parameters were compared across ranks.

use candle_core::{DType, Tensor};

use super::ReduceOp;
use crate::error::{Error, Result};

/// Words of one rank's signature.
pub(crate) const WORDS: usize = 4;

/// A backend that runs the pre-flight agreement: it gathers the signatures, the agreement compares
/// them. The CPU ring and NCCL implement it.
pub(crate) trait Agree {
    /// The number of ranks (with one there is nothing to agree on).
    fn ranks(&self) -> usize;

    /// Every rank's signature `words` for `collective`, this rank's given, in rank order.
    fn gather_signatures(&self, collective: Collective, words: &[i64]) -> Result<Vec<i64>>;

    /// The agreement on `collective` over `tensor`: every rank's signature gathered and compared;
    /// all ranks refuse together, naming each rank's, when they differ.
    fn agree(&self, collective: Collective, tensor: &Tensor) -> Result<()> {
        self.agree_on(collective, Signature::of(collective, tensor))
    }

    /// [`agree`](Self::agree) on a signature built by the caller.
    fn agree_on(&self, collective: Collective, signature: Signature) -> Result<()> {
        if self.ranks() == 1 {
            return Ok(());
        }
        let all = self.gather_signatures(collective, &signature.words())?;
        check(collective, &all)
    }
}

/// What a rank is about to do in a collective, as exchanged with the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Signature {
    /// The collective (and for all-reduce, the reduction).
    op: i64,
    /// Elements of the tensor.
    count: i64,
    /// The dtype, as [`dtype_code`]; for the collectives into a preallocated output, above it
    /// (from bit 8) the output's dtype code and layout (`output_form`), so that every check made
    /// before the data moves sees the same tensors on every rank.
    dtype: i64,
    /// The root of a broadcast; for an all-gather, the length of dimension 0; for the
    /// collectives into a preallocated output, the output's element count; 0 otherwise.
    extra: i64,
}

/// Which collective a signature describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Collective {
    /// `all_reduce` with this reduction.
    AllReduce(ReduceOp),
    /// `broadcast` from this root.
    Broadcast(usize),
    /// `all_gather`.
    AllGather,
    /// `reduce_scatter` with this reduction.
    ReduceScatter(ReduceOp),
    /// `all_gather_into`.
    AllGatherInto,
    /// `barrier` (on NCCL, where nothing else would tell it from another collective; the CPU
    /// transports tag every frame with its collective instead).
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    Barrier,
}

impl Collective {
    /// The name used in errors.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "all_reduce",
            Collective::Broadcast(_) => "broadcast",
            Collective::AllGather => "all_gather",
            Collective::ReduceScatter(_) => "reduce_scatter",
            Collective::AllGatherInto => "all_gather_into",
            Collective::Barrier => "barrier",
        }
    }
}

impl Signature {
    /// The signature of `collective` on `tensor` on this rank.
    pub(crate) fn of(collective: Collective, tensor: &Tensor) -> Self {
        let (op, extra) = match collective {
            Collective::AllReduce(ReduceOp::Sum) => (1, 0),
            Collective::AllReduce(ReduceOp::Mean) => (2, 0),
            Collective::AllReduce(ReduceOp::Max) => (3, 0),
            Collective::Broadcast(root) => (4, root as i64),
            // Rows must agree too: the result's shape is built from this rank's dimensions.
            Collective::AllGather => (5, tensor.dims().first().copied().unwrap_or(1) as i64),
            // Described by `of_pair`; with one tensor, only the operation is known.
            Collective::ReduceScatter(op) => (reduce_scatter_code(op), 0),
            Collective::AllGatherInto => (9, 0),
            Collective::Barrier => (BARRIER, 0),
        };
        Self {
            op,
            count: tensor.elem_count() as i64,
            dtype: dtype_code(tensor.dtype()),
            extra,
        }
    }

    /// The signature of a collective into a preallocated `output` (`reduce_scatter`,
    /// `all_gather_into`) reading `input`: both sizes, both dtypes and the output's layout.
    pub(crate) fn of_pair(collective: Collective, input: &Tensor, output: &Tensor) -> Self {
        let one = Self::of(collective, input);
        Self {
            extra: output.elem_count() as i64,
            dtype: one.dtype | output_form(input, output) << FORM_SHIFT,
            ..one
        }
    }

    /// The signature of a barrier: no tensor.
    #[cfg_attr(not(feature = "nccl"), allow(dead_code))]
    pub(crate) fn barrier() -> Self {
        Self {
            op: BARRIER,
            count: 0,
            dtype: 0,
            extra: 0,
        }
    }

    /// The words exchanged with the other ranks.
    pub(crate) fn words(&self) -> [i64; WORDS] {
        [self.op, self.count, self.dtype, self.extra]
    }

    fn from_words(w: &[i64]) -> Self {
        Self {
            op: w[0],
            count: w[1],
            dtype: w[2],
            extra: w[3],
        }
    }

    fn describe(&self) -> String {
        let op = match self.op {
            1 => "all_reduce (Sum)".to_string(),
            2 => "all_reduce (Mean)".to_string(),
            3 => "all_reduce (Max)".to_string(),
            4 => format!("broadcast from rank {}", self.extra),
            5 => "all_gather".to_string(),
            6 => "reduce_scatter (Sum)".to_string(),
            7 => "reduce_scatter (Mean)".to_string(),
            8 => "reduce_scatter (Max)".to_string(),
            9 => "all_gather_into".to_string(),
            BARRIER => return "barrier".to_string(),
            other => format!("an unknown collective ({other})"),
        };
        let form = self.dtype >> FORM_SHIFT;
        let rows = match self.op {
            5 => format!(" in {} rows", self.extra),
            6..=9 => format!(
                " into {} {} elements{}{}",
                self.extra,
                describe_dtype_code(form & 0xff),
                if form & NON_CONTIGUOUS != 0 {
                    ", not contiguous"
                } else {
                    ""
                },
                if form & SHARED != 0 {
                    ", sharing the input's storage"
                } else {
                    ""
                }
            ),
            _ => String::new(),
        };
        format!(
            "{op} of {} {} elements{rows}",
            self.count,
            describe_dtype_code(self.dtype & 0xff)
        )
    }
}

/// Checks the signatures every rank sent (`gathered` holds [`WORDS`] words per rank, in rank
/// order) against each other. Every rank computes the same answer from the same words, so either
/// all go on or all refuse with the same error.
pub(crate) fn check(collective: Collective, gathered: &[i64]) -> Result<()> {
    let signatures: Vec<Signature> = gathered
        .chunks_exact(WORDS)
        .map(Signature::from_words)
        .collect();
    let Some(first) = signatures.first() else {
        return Ok(());
    };
    if signatures.iter().all(|s| s == first) {
        return Ok(());
    }
    // Ranks grouped by what they passed, in order of first appearance.
    let mut groups: Vec<(Signature, Vec<usize>)> = Vec::new();
    for (rank, s) in signatures.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| g == s) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((*s, vec![rank])),
        }
    }
    let described: Vec<String> = groups
        .iter()
        .map(|(s, ranks)| {
            let who = match ranks.as_slice() {
                [one] => format!("rank {one}"),
                many => format!(
                    "ranks {}",
                    many.iter()
                        .map(|r| r.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            };
            format!("{who}: {}", s.describe())
        })
        .collect();
    // The first rank that differs from rank 0 is the one named as the peer.
    let peer = signatures.iter().position(|s| s != first);
    let hint = if signatures.iter().all(|s| s.op == first.op) && first.op == 5 {
        "; to gather tensors of different lengths, pad them first with \
         Accelerator::pad_across_processes"
    } else if signatures.iter().any(|s| (6..=9).contains(&s.op)) {
        " (and an output of the same size, dtype and layout)"
    } else {
        ""
    };
    let what = if signatures.iter().all(|s| s.op == first.op) {
        "passed different tensors"
    } else {
        "called different collectives"
    };
    Err(Error::Collective {
        op: collective.name(),
        peer,
        problem: format!(
            "the ranks {what} ({}); every rank must call the same collective \
             with a tensor of the same number of elements and dtype{hint}. Nothing was \
             exchanged: the collective was refused on every rank",
            described.join("; ")
        ),
    })
}

/// The op code of a barrier.
const BARRIER: i64 = 10;

/// Where the output's form starts in the dtype word of a signature.
const FORM_SHIFT: u32 = 8;
/// Bit of [`output_form`]: the output is not contiguous.
const NON_CONTIGUOUS: i64 = 1 << 8;
/// Bit of [`output_form`]: the output shares the input's storage.
const SHARED: i64 = 1 << 9;

/// The op code of `reduce_scatter` with `op`.
fn reduce_scatter_code(op: ReduceOp) -> i64 {
    match op {
        ReduceOp::Sum => 6,
        ReduceOp::Mean => 7,
        ReduceOp::Max => 8,
    }
}

/// The output's dtype code and the layout facts the contract checks, in one word.
fn output_form(input: &Tensor, output: &Tensor) -> i64 {
    let mut form = dtype_code(output.dtype());
    if !output.is_contiguous() {
        form |= NON_CONTIGUOUS;
    }
    if super::contract::share_storage(input, output) {
        form |= SHARED;
    }
    form
}

/// A stable number for each dtype, the same on every machine.
pub(crate) fn dtype_code(dtype: DType) -> i64 {
    match dtype {
        DType::U8 => 1,
        DType::U32 => 2,
        DType::I16 => 3,
        DType::I32 => 4,
        DType::I64 => 5,
        DType::BF16 => 6,
        DType::F16 => 7,
        DType::F32 => 8,
        DType::F64 => 9,
        DType::F8E4M3 => 10,
        // The remaining (sub-byte) types travel on no backend; one code is enough to tell them
        // apart from the others.
        _ => 11,
    }
}

fn describe_dtype_code(code: i64) -> &'static str {
    match code {
        1 => "u8",
        2 => "u32",
        3 => "i16",
        4 => "i32",
        5 => "i64",
        6 => "bf16",
        7 => "f16",
        8 => "f32",
        9 => "f64",
        10 => "f8e4m3",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn words(collective: Collective, tensors: &[Tensor]) -> Vec<i64> {
        tensors
            .iter()
            .flat_map(|t| Signature::of(collective, t).words())
            .collect()
    }

    #[test]
    fn equal_signatures_pass_and_different_ones_name_every_rank_and_size() {
        let t = |n: usize, dtype: DType| Tensor::zeros(n, dtype, &Device::Cpu).unwrap();
        let sum = Collective::AllReduce(ReduceOp::Sum);
        check(sum, &words(sum, &[t(8, DType::F32), t(8, DType::F32)])).unwrap();

        let err = check(
            sum,
            &words(sum, &[t(8, DType::F32), t(8, DType::F32), t(9, DType::F32)]),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("ranks 0, 1: all_reduce (Sum) of 8 f32 elements")
                && err.contains("rank 2: all_reduce (Sum) of 9 f32 elements")
                && err.contains("with rank 2"),
            "{err}"
        );

        let err = check(sum, &words(sum, &[t(8, DType::F32), t(8, DType::F64)]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("8 f64 elements"), "{err}");
    }

    #[test]
    fn different_operations_and_roots_are_named() {
        let t = Tensor::zeros(4, DType::I64, &Device::Cpu).unwrap();
        let a = Signature::of(Collective::Broadcast(1), &t).words();
        let b = Signature::of(Collective::AllReduce(ReduceOp::Max), &t).words();
        let err = check(Collective::Broadcast(1), &[a, b].concat())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("rank 0: broadcast from rank 1 of 4 i64 elements")
                && err.contains("rank 1: all_reduce (Max)"),
            "{err}"
        );
    }

    #[test]
    fn a_barrier_against_another_collective_is_named_as_such() {
        let t = Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap();
        let barrier = Signature::barrier().words();
        check(Collective::Barrier, &[barrier, barrier].concat()).unwrap();
        let reduce = Signature::of(Collective::AllReduce(ReduceOp::Sum), &t).words();
        let err = check(Collective::Barrier, &[barrier, reduce].concat())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("called different collectives")
                && err.contains("rank 0: barrier;")
                && err.contains("rank 1: all_reduce (Sum) of 3 f32 elements"),
            "{err}"
        );
    }

    #[test]
    fn gathers_must_agree_on_rows_and_are_pointed_to_padding() {
        let a = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let b = Tensor::zeros((3, 2), DType::F32, &Device::Cpu).unwrap();
        let g = Collective::AllGather;
        let err = check(g, &words(g, &[a, b])).unwrap_err().to_string();
        assert!(
            err.contains("in 2 rows") && err.contains("in 3 rows"),
            "{err}"
        );
        assert!(err.contains("pad_across_processes"), "{err}");
    }

    #[test]
    fn outputs_are_part_of_the_signature_and_named() {
        let t = |n: usize, dtype: DType| Tensor::zeros(n, dtype, &Device::Cpu).unwrap();
        let rs = Collective::ReduceScatter(ReduceOp::Sum);
        let input = t(8, DType::F32);
        let pair = |output: &Tensor| Signature::of_pair(rs, &input, output).words();
        let same = [pair(&t(4, DType::F32)), pair(&t(4, DType::F32))].concat();
        check(rs, &same).unwrap();

        let strided = t(8, DType::F32)
            .reshape((4, 2))
            .unwrap()
            .narrow(1, 0, 1)
            .unwrap();
        let shared = input.narrow(0, 0, 4).unwrap();
        for (output, needle) in [
            (
                t(5, DType::F32),
                "rank 1: reduce_scatter (Sum) of 8 f32 elements into 5 f32",
            ),
            (t(4, DType::F64), "into 4 f64 elements"),
            (strided, "into 4 f32 elements, not contiguous"),
            (shared, "into 4 f32 elements, sharing the input's storage"),
        ] {
            let words = [pair(&t(4, DType::F32)), pair(&output)].concat();
            let err = check(rs, &words).unwrap_err().to_string();
            assert!(
                err.contains("rank 0: reduce_scatter (Sum) of 8 f32 elements into 4 f32 elements;")
                    && err.contains(needle),
                "{err}"
            );
        }
    }
}
