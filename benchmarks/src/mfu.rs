//! Model FLOPs utilization of a decoder-only transformer's training step, by the formula of
//! PaLM's appendix B (Chowdhery et al., 2022), which nanoGPT and llm.c report too.
//!
//! A token costs `6 · N` FLOPs for the parameters' products (2 forward, 4 backward per
//! multiply-add) plus `12 · L · T · d` for attention's two `T × T` products in `L` layers of
//! width `d` at context `T`. `N` counts the parameters that multiply: every parameter except the
//! input embedding tables, which are looked up, not multiplied (an untied output head does
//! multiply and is counted). The causal mask's skipped half is not subtracted, as PaLM does not.

/// FLOPs of one training token (forward and backward), as in the module docs.
pub fn flops_per_token(matmul_params: u64, layers: u64, context: u64, width: u64) -> f64 {
    6.0 * matmul_params as f64 + 12.0 * (layers * context * width) as f64
}

/// The fraction of `peak_flops` (FLOP/s) that `tokens_per_second` tokens of `flops_per_token`
/// each make.
pub fn utilization(flops_per_token: f64, tokens_per_second: f64, peak_flops: f64) -> f64 {
    flops_per_token * tokens_per_second / peak_flops
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_small_costs_what_nanogpt_counts() {
        // GPT-2 124M with its head untied from wte: 12 blocks of 12·768² + 13·768 parameters,
        // ln_f (2·768) and the head (50257·768); wte and wpe excluded.
        let block = 12 * 768 * 768 + 13 * 768;
        let n = 12 * block + 2 * 768 + 50257 * 768;
        assert_eq!(n, 123_653_376);
        let f = flops_per_token(n, 12, 1024, 768);
        // 6 · 123,653,376 + 12 · 12 · 1024 · 768 = 741,920,256 + 113,246,208.
        assert_eq!(f, 855_166_464.0);
        // 100k tokens/s of it on a 1 PFLOP/s chip: 8.5 %.
        assert!((utilization(f, 1e5, 1e15) - 0.085_516_646_4).abs() < 1e-12);
    }
}
