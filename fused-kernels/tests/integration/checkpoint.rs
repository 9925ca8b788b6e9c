//! Activation checkpointing (`fused_kernels::checkpoint`): a model whose blocks are checkpointed
//! gives the same loss and, bit for bit, the same gradients of its input and of every parameter
//! as the same model run plainly, with candle's ordinary `loss.backward()`.

use std::any::Any;
use std::sync::{Arc, Mutex};

use crate::common::tensor;
use candle_core::{DType, Result, Tensor, Var};
use fused_kernels::checkpoint::{checkpoint, checkpoint_with_random_state, RandomState};

const BATCH: usize = 2;
const TIME: usize = 5;
const WIDTH: usize = 8;
const HIDDEN: usize = 16;

/// The parameters of one pre-norm transformer block (one attention head, a GELU MLP), as
/// variables.
#[derive(Clone)]
struct Block {
    norm1: (Tensor, Tensor),
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: (Tensor, Tensor),
    norm2: (Tensor, Tensor),
    up: (Tensor, Tensor),
    down: (Tensor, Tensor),
}

fn var(shape: &[usize], seed: u64, scale: f64, dtype: DType) -> Tensor {
    Var::from_tensor(&tensor(shape, seed, scale).to_dtype(dtype).unwrap())
        .unwrap()
        .as_tensor()
        .clone()
}

impl Block {
    fn new(seed: u64, dtype: DType) -> Self {
        Self::of_size(seed, dtype, WIDTH, HIDDEN)
    }

    fn of_size(seed: u64, dtype: DType, width: usize, hidden: usize) -> Self {
        let s = 1.2 / (width as f64).sqrt();
        let ones = |seed| var(&[width], seed, 0.1, dtype).affine(1.0, 1.0).unwrap();
        let norm = |seed| {
            (
                Var::from_tensor(&ones(seed)).unwrap().as_tensor().clone(),
                var(&[width], seed + 1, 0.1, dtype),
            )
        };
        Block {
            norm1: norm(seed),
            query: var(&[width, width], seed + 2, s, dtype),
            key: var(&[width, width], seed + 3, s, dtype),
            value: var(&[width, width], seed + 4, s, dtype),
            out: (
                var(&[width, width], seed + 5, s, dtype),
                var(&[width], seed + 6, 0.1, dtype),
            ),
            norm2: norm(seed + 7),
            up: (
                var(&[hidden, width], seed + 9, s, dtype),
                var(&[hidden], seed + 10, 0.1, dtype),
            ),
            down: (
                var(&[width, hidden], seed + 11, s, dtype),
                var(&[width], seed + 12, 0.1, dtype),
            ),
        }
    }

    fn parameters(&self) -> Vec<Tensor> {
        vec![
            self.norm1.0.clone(),
            self.norm1.1.clone(),
            self.query.clone(),
            self.key.clone(),
            self.value.clone(),
            self.out.0.clone(),
            self.out.1.clone(),
            self.norm2.0.clone(),
            self.norm2.1.clone(),
            self.up.0.clone(),
            self.up.1.clone(),
            self.down.0.clone(),
            self.down.1.clone(),
        ]
    }

    /// `x` `[BATCH, TIME, WIDTH]` through the block; `dropout` (if any) masks the MLP's hidden
    /// activations.
    fn forward(&self, x: &Tensor, dropout: Option<&Dropout>) -> Result<Tensor> {
        use fused_kernels::{causal_softmax, gelu, layer_norm, linear};
        let h = layer_norm(x, &self.norm1.0, &self.norm1.1, 1e-5)?;
        let q = linear(&h, &self.query, None)?;
        let k = linear(&h, &self.key, None)?;
        let v = linear(&h, &self.value, None)?;
        let scores = q.matmul(&k.t()?.contiguous()?)?;
        let scale = 1.0 / (x.dim(2)? as f64).sqrt();
        let attention = causal_softmax(&scores, scale)?.matmul(&v)?;
        let x = (x + linear(&attention, &self.out.0, Some(&self.out.1))?)?;
        let h = layer_norm(&x, &self.norm2.0, &self.norm2.1, 1e-5)?;
        let mut m = gelu(&linear(&h, &self.up.0, Some(&self.up.1))?)?;
        if let Some(dropout) = dropout {
            m = dropout.apply(&m)?;
        }
        x + linear(&m, &self.down.0, Some(&self.down.1))?
    }
}

/// Dropout with probability ½ whose masks come from a small generator the test controls.
#[derive(Clone)]
struct Dropout {
    state: Arc<Mutex<u64>>,
}

impl Dropout {
    fn new(seed: u64) -> Self {
        Dropout {
            state: Arc::new(Mutex::new(seed | 1)),
        }
    }

    fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let mut s = self.state.lock().unwrap();
        let mask: Vec<f64> = (0..x.elem_count())
            .map(|_| {
                *s ^= *s << 13;
                *s ^= *s >> 7;
                *s ^= *s << 17;
                if *s & 1 == 0 {
                    0.0
                } else {
                    2.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, x.dims(), x.device())?.to_dtype(x.dtype())?;
        x * mask
    }
}

impl RandomState for Dropout {
    fn snapshot(&self) -> Box<dyn Any + Send + Sync> {
        Box::new(*self.state.lock().unwrap())
    }

    fn restore(&self, state: &(dyn Any + Send + Sync)) -> Result<()> {
        let Some(s) = state.downcast_ref::<u64>() else {
            candle_core::bail!("Dropout::restore: not a state of this generator");
        };
        *self.state.lock().unwrap() = *s;
        Ok(())
    }
}

/// How each block of a model runs.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Plain,
    /// Every block checkpointed.
    Checkpointed,
    /// Blocks checkpointed in pairs: a checkpoint around two checkpointed blocks.
    Nested,
}

fn run_block(block: &Block, x: &Tensor, mode: Mode, dropout: Option<&Dropout>) -> Result<Tensor> {
    if mode == Mode::Plain {
        return block.forward(x, dropout);
    }
    let b = block.clone();
    match dropout {
        None => checkpoint(x, move |x| b.forward(x, None)),
        Some(d) => {
            let d2 = d.clone();
            checkpoint_with_random_state(x, move |x| b.forward(x, Some(&d2)), Arc::new(d.clone()))
        }
    }
}

fn run_model(
    blocks: &[Block],
    x: &Tensor,
    mode: Mode,
    dropout: Option<&Dropout>,
) -> Result<Tensor> {
    if mode == Mode::Nested {
        let mut x = x.clone();
        for pair in blocks.chunks(2) {
            let pair = pair.to_vec();
            let d = dropout.cloned();
            let inner = move |x: &Tensor| run_model(&pair, x, Mode::Checkpointed, d.as_ref());
            x = match dropout {
                None => checkpoint(&x, inner)?,
                Some(d) => checkpoint_with_random_state(&x, inner, Arc::new(d.clone()))?,
            };
        }
        return Ok(x);
    }
    let mut x = x.clone();
    for block in blocks {
        x = run_block(block, &x, mode, dropout)?;
    }
    Ok(x)
}

/// The loss, the gradient of the input (when it is a variable) and of every parameter, as bits.
struct Outcome {
    loss: Vec<u64>,
    input: Option<Vec<u64>>,
    parameters: Vec<Vec<u64>>,
}

fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.flatten_all().unwrap();
    match t.dtype() {
        DType::F32 => t
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u64)
            .collect(),
        DType::F64 => t
            .to_vec1::<f64>()
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        other => panic!("no bits for {other:?}"),
    }
}

fn train_step(blocks: &[Block], input: &Tensor, mode: Mode, dropout: Option<&Dropout>) -> Outcome {
    let y = run_model(blocks, input, mode, dropout).unwrap();
    let weights = tensor(y.dims(), 77, 1.0).to_dtype(y.dtype()).unwrap();
    let loss = (y * weights).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let parameters = blocks
        .iter()
        .flat_map(Block::parameters)
        .map(|p| bits(grads.get(&p).expect("a parameter has no gradient")))
        .collect();
    Outcome {
        loss: bits(&loss),
        input: grads.get(input).map(bits),
        parameters,
    }
}

fn assert_same(plain: &Outcome, other: &Outcome, what: &str) {
    assert_eq!(plain.loss, other.loss, "{what}: the loss differs");
    assert_eq!(
        plain.input, other.input,
        "{what}: the input's gradient differs"
    );
    assert_eq!(plain.parameters.len(), other.parameters.len());
    for (i, (p, o)) in plain.parameters.iter().zip(&other.parameters).enumerate() {
        assert_eq!(p, o, "{what}: parameter {i}'s gradient differs");
    }
}

fn input(dtype: DType) -> Tensor {
    var(&[BATCH, TIME, WIDTH], 5, 1.0, dtype)
}

#[test]
fn one_checkpointed_block_gives_the_plain_gradients_bit_for_bit() {
    for dtype in [DType::F32, DType::F64] {
        let blocks = [Block::new(100, dtype)];
        let x = input(dtype);
        let plain = train_step(&blocks, &x, Mode::Plain, None);
        assert!(plain.input.is_some());
        let checkpointed = train_step(&blocks, &x, Mode::Checkpointed, None);
        assert_same(&plain, &checkpointed, &format!("{dtype:?}"));
    }
}

#[test]
fn checkpointed_blocks_in_sequence_and_nested_give_the_plain_gradients_bit_for_bit() {
    let blocks: Vec<Block> = (0..4)
        .map(|i| Block::new(100 + 20 * i, DType::F32))
        .collect();
    let x = input(DType::F32);
    let plain = train_step(&blocks, &x, Mode::Plain, None);
    let checkpointed = train_step(&blocks, &x, Mode::Checkpointed, None);
    assert_same(&plain, &checkpointed, "four blocks in sequence");
    let nested = train_step(&blocks, &x, Mode::Nested, None);
    assert_same(
        &plain,
        &nested,
        "two checkpoints of two checkpointed blocks",
    );
}

#[test]
fn a_checkpointed_block_with_dropout_sees_the_same_masks_when_it_runs_again() {
    let blocks: Vec<Block> = (0..2)
        .map(|i| Block::new(300 + 20 * i, DType::F32))
        .collect();
    let x = input(DType::F32);
    let plain_dropout = Dropout::new(9);
    let plain = train_step(&blocks, &x, Mode::Plain, Some(&plain_dropout));
    let dropout = Dropout::new(9);
    let checkpointed = train_step(&blocks, &x, Mode::Checkpointed, Some(&dropout));
    assert_same(&plain, &checkpointed, "dropout");
    // The recomputation left the generator where the forward pass did.
    assert_eq!(
        *plain_dropout.state.lock().unwrap(),
        *dropout.state.lock().unwrap()
    );
    let nested = train_step(&blocks, &x, Mode::Nested, Some(&Dropout::new(9)));
    assert_same(&plain, &nested, "dropout, nested");
}

#[test]
fn a_checkpointed_block_without_parameters_or_with_an_untracked_input_gets_its_gradients() {
    // No parameters: only the input's gradient.
    let x = input(DType::F32);
    let f = |x: &Tensor| -> Result<Tensor> { x + fused_kernels::gelu(&x.sqr()?)? };
    let plain = {
        let g = f(&x).unwrap().sum_all().unwrap().backward().unwrap();
        bits(g.get(&x).unwrap())
    };
    let checkpointed = {
        let y = checkpoint(&x, f).unwrap();
        let g = y.sum_all().unwrap().backward().unwrap();
        bits(g.get(&x).unwrap())
    };
    assert_eq!(plain, checkpointed);

    // An input that is data, not a variable: only the parameters' gradients.
    let blocks = [Block::new(500, DType::F32)];
    let data = x.detach();
    let plain = train_step(&blocks, &data, Mode::Plain, None);
    let checkpointed = train_step(&blocks, &data, Mode::Checkpointed, None);
    // (candle's custom ops may leave a gradient for an untracked tensor; it is not compared.)
    assert_eq!(plain.loss, checkpointed.loss);
    assert_eq!(plain.parameters, checkpointed.parameters);
}

#[test]
fn a_checkpointed_block_read_twice_sums_its_parameters_gradients() {
    // The same block applied twice (shared weights): the gradients are the plain model's
    // within rounding (the parts are summed in another order).
    let block = Block::new(700, DType::F64);
    let blocks = [block.clone(), block];
    let x = input(DType::F64);
    let plain = train_step(&blocks, &x, Mode::Plain, None);
    let checkpointed = train_step(&blocks, &x, Mode::Checkpointed, None);
    assert_eq!(plain.loss, checkpointed.loss);
    let close = |a: &[u64], b: &[u64]| {
        a.iter().zip(b).all(|(a, b)| {
            let (a, b) = (f64::from_bits(*a), f64::from_bits(*b));
            (a - b).abs() <= 1e-12 * (1.0 + a.abs())
        })
    };
    assert!(close(
        plain.input.as_ref().unwrap(),
        checkpointed.input.as_ref().unwrap()
    ));
    for (p, c) in plain.parameters.iter().zip(&checkpointed.parameters) {
        assert!(close(p, c));
    }
}

#[test]
fn a_checkpointed_block_that_makes_new_variables_each_call_is_refused_in_backward() {
    let x = input(DType::F32);
    let y = checkpoint(&x, |x| {
        let w = Var::from_tensor(&Tensor::ones(WIDTH, DType::F32, x.device())?)?;
        x.broadcast_mul(w.as_tensor())
    })
    .unwrap();
    let err = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(
        err.contains("did not reach one of its variables"),
        "unexpected error: {err}"
    );
}

#[test]
fn a_checkpointed_stack_keeps_only_each_blocks_input_and_a_scalar_per_two_parameters() {
    // The tensors the graph of the output holds, apart from the parameters: with checkpointing,
    // each block's output (the next block's input, `BATCH·TIME·WIDTH` elements) and one 0-d
    // link per two parameters; without, every intermediate tensor of every block.
    let layers = 3;
    let blocks: Vec<Block> = (0..layers)
        .map(|i| Block::new(900 + 20 * i, DType::F32))
        .collect();
    let x = input(DType::F32);
    let held = |y: &Tensor| -> usize {
        y.sorted_nodes()
            .into_iter()
            .filter(|n| !n.is_variable())
            .map(|n| n.elem_count())
            .sum()
    };
    let checkpointed = run_model(&blocks, &x, Mode::Checkpointed, None).unwrap();
    let parameters = blocks[0].parameters().len();
    assert_eq!(
        held(&checkpointed),
        layers as usize * (BATCH * TIME * WIDTH + parameters.div_ceil(2))
    );
    let plain = run_model(&blocks, &x, Mode::Plain, None).unwrap();
    assert!(held(&plain) > 10 * held(&checkpointed));
}

#[test]
fn checkpointed_blocks_large_enough_for_the_parallel_kernels_give_the_plain_gradients_bit_for_bit()
{
    // Rows of 64 × 4·64 activations: the fused kernels split them over rayon's threads.
    let blocks: Vec<Block> = (0..2)
        .map(|i| Block::of_size(1100 + 20 * i, DType::F32, 64, 256))
        .collect();
    let x = var(&[4, 64, 64], 6, 1.0, DType::F32);
    let plain = train_step(&blocks, &x, Mode::Plain, None);
    let checkpointed = train_step(&blocks, &x, Mode::Checkpointed, None);
    assert_same(&plain, &checkpointed, "large blocks");
}
