//! CPU timings of a language model's two ends, fused against candle's path:
//!
//! - the embedding: [`fused_kernels::embedding`] against candle-nn's `Embedding::forward`
//!   (`index_select` of the flattened ids; its backward is `index_add` into a zero table),
//!   forward and backward of `Σ embedding(ids, table) · r`;
//! - the head and its loss: [`fused_kernels::linear_cross_entropy`] against `x · weightᵀ` (what
//!   candle-nn's `Linear` computes), `to_dtype(F32)` and [`fused_kernels::cross_entropy`],
//!   forward and backward to `x` and `weight`.
//!
//! `cargo run --release -p fused-kernels --example embedding_and_loss [repeats [embedding|head]]`
//! prints one line per case (both parts unless one is named): the best of `repeats` (default 3) runs after one warm-up, for ids of [8, 256] and
//! [2, 1024] (2048 rows each), width 768, GPT-2's vocabulary of 50 257, in f32 and bf16. The ids
//! are pseudo-random, uniform over the vocabulary.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Result, Tensor, Var};

/// GPT-2's width and vocabulary.
const WIDTH: usize = 768;
const VOCAB: usize = 50_257;

/// `n` pseudo-random values in `[0, 1)` (xorshift from `seed`).
fn uniform(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 11) as f64 / (1u64 << 53) as f64
        })
        .collect()
}

/// A `[dims]` tensor of values in `[-scale, scale)` in `dtype`.
fn random(dims: &[usize], seed: u64, scale: f64, dtype: DType) -> Result<Tensor> {
    let n = dims.iter().product();
    let v: Vec<f32> = uniform(n, seed)
        .into_iter()
        .map(|x| ((2.0 * x - 1.0) * scale) as f32)
        .collect();
    Tensor::from_vec(v, dims, &Device::Cpu)?.to_dtype(dtype)
}

/// The best of `repeats` timings after one warm-up run; each run of `f` times its own part.
fn best(repeats: usize, mut f: impl FnMut() -> Result<Duration>) -> Result<Duration> {
    f()?;
    let mut best = Duration::MAX;
    for _ in 0..repeats {
        best = best.min(f()?);
    }
    Ok(best)
}

/// Forward and backward of `Σ lookup(ids, table) · r`, timed separately.
fn embedding_case(
    repeats: usize,
    ids: &Tensor,
    table: &Var,
    r: &Tensor,
    lookup: impl Fn(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(Duration, Duration)> {
    let forward = best(repeats, || {
        let start = Instant::now();
        lookup(ids, table.as_tensor())?;
        Ok(start.elapsed())
    })?;
    // The backward pass of Σ out · r: the product's backward (the same for both) and the lookup's.
    let backward = best(repeats, || {
        let loss = (lookup(ids, table.as_tensor())? * r)?.sum_all()?;
        let start = Instant::now();
        let grads = loss.backward()?;
        let time = start.elapsed();
        assert!(grads.get(table.as_tensor()).is_some());
        Ok(time)
    })?;
    Ok((forward, backward))
}

/// Forward plus backward of the loss to `x` and `weight`.
fn loss_case(
    repeats: usize,
    x: &Var,
    w: &Var,
    targets: &Tensor,
    weights: &Tensor,
    loss: impl Fn(&Tensor, &Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(Duration, f32)> {
    let mut value = 0.0;
    let time = best(repeats, || {
        let start = Instant::now();
        let l = loss(x.as_tensor(), w.as_tensor(), targets, weights)?;
        let grads = l.backward()?;
        let time = start.elapsed();
        value = l.to_scalar::<f32>()?;
        assert!(grads.get(x.as_tensor()).is_some() && grads.get(w.as_tensor()).is_some());
        Ok(time)
    })?;
    Ok((time, value))
}

fn ms(d: Duration) -> String {
    format!("{:8.1} ms", d.as_secs_f64() * 1e3)
}

/// Times the two embeddings for ids of `dims` and a table of `dtype`, and prints the line.
fn embedding_line(repeats: usize, dims: [usize; 2], ids: &Tensor, dtype: DType) -> Result<()> {
    let table = Var::from_tensor(&random(&[VOCAB, WIDTH], 2, 0.1, dtype)?)?;
    let r = random(&[dims[0], dims[1], WIDTH], 3, 1.0, dtype)?;
    // candle-nn's Embedding::forward: the flattened ids, index_select, the ids' shape.
    let (cf, cb) = embedding_case(repeats, ids, &table, &r, |i, t| {
        t.index_select(&i.flatten_all()?, 0)?
            .reshape((i.dim(0)?, i.dim(1)?, WIDTH))
    })?;
    let (ff, fb) = embedding_case(repeats, ids, &table, &r, |i, t| {
        fused_kernels::embedding(i, t)
    })?;
    println!(
        "embedding      ids {dims:?} {dtype:?}: candle forward {} backward {} | fused \
                 forward {} backward {} | backward speed-up {:.1}x",
        ms(cf),
        ms(cb),
        ms(ff),
        ms(fb),
        cb.as_secs_f64() / fb.as_secs_f64()
    );
    Ok(())
}

fn main() -> Result<()> {
    let repeats: usize = std::env::args()
        .nth(1)
        .map(|a| a.parse().expect("repeats: a number"))
        .unwrap_or(3);
    let part = std::env::args().nth(2).unwrap_or_default();
    let (embeddings, heads) = (part != "head", part != "embedding");
    println!(
        "CPU, {} rayon threads, best of {repeats} after a warm-up; width {WIDTH}, vocabulary {VOCAB}",
        rayon::current_num_threads()
    );
    // The head's cost depends on the number of rows only: time it once per row count.
    let mut heads_done = Vec::new();
    for dims in [[8usize, 256], [2, 1024]] {
        let n = dims[0] * dims[1];
        let ids: Vec<u32> = uniform(n, 1)
            .iter()
            .map(|x| ((x * VOCAB as f64) as usize).min(VOCAB - 1) as u32)
            .collect();
        let ids = Tensor::from_vec(ids, dims.as_slice(), &Device::Cpu)?;
        let targets = ids.flatten_all()?;
        let weights = Tensor::ones(n, DType::F32, &Device::Cpu)?;
        for dtype in [DType::F32, DType::BF16] {
            if embeddings {
                embedding_line(repeats, dims, &ids, dtype)?;
            }
            if !heads {
                continue;
            }
            if heads_done.contains(&(n, dtype)) {
                println!("head + loss    {n} rows {dtype:?}: as above (the same rows)");
                continue;
            }
            heads_done.push((n, dtype));
            let x = Var::from_tensor(&random(&[n, WIDTH], 4, 1.0, dtype)?)?;
            let w = Var::from_tensor(&random(&[VOCAB, WIDTH], 5, 0.05, dtype)?)?;
            let (ct, cl) = loss_case(repeats, &x, &w, &targets, &weights, |x, w, t, k| {
                let logits = x.matmul(&w.t()?)?.to_dtype(DType::F32)?;
                fused_kernels::cross_entropy(&logits, t, k)
            })?;
            let (ft, fl) = loss_case(
                repeats,
                &x,
                &w,
                &targets,
                &weights,
                fused_kernels::linear_cross_entropy,
            )?;
            println!(
                "head + loss    {n} rows {dtype:?}: candle linear + f32 cast + cross_entropy {} \
                 (loss {cl:.4}) | linear_cross_entropy {} (loss {fl:.4}) | speed-up {:.1}x \
                 (forward + backward)",
                ms(ct),
                ms(ft),
                ct.as_secs_f64() / ft.as_secs_f64()
            );
        }
    }
    Ok(())
}
