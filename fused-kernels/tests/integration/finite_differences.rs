//! Every op's gradients, for every input that takes one, against central finite differences in
//! f64.

use crate::common::{check_gradients, tensor};
use candle_core::{DType, Device, Tensor};

#[test]
fn layer_norm() {
    let inputs = [
        (tensor(&[2, 3, 7], 1, 2.0) + 0.3).unwrap(),
        tensor(&[7], 2, 1.5),
        tensor(&[7], 3, 1.0),
    ];
    check_gradients("layer_norm", &inputs, &[0, 1, 2], |x| {
        fused_kernels::layer_norm(&x[0], &x[1], &x[2], 1e-5)
    });
}

#[test]
fn rms_norm() {
    let inputs = [tensor(&[3, 2, 6], 4, 2.0), tensor(&[6], 5, 1.5)];
    check_gradients("rms_norm", &inputs, &[0, 1], |x| {
        fused_kernels::rms_norm(&x[0], &x[1], 1e-6)
    });
}

#[test]
fn causal_softmax_square_and_with_more_keys_than_queries() {
    for (t_q, t_k) in [(4, 4), (3, 6), (1, 5)] {
        let inputs = [tensor(&[2, 2, t_q, t_k], 6 + t_k as u64, 3.0)];
        check_gradients("causal_softmax", &inputs, &[0], |x| {
            fused_kernels::causal_softmax(&x[0], 0.7)
        });
    }
}

#[test]
fn cross_entropy() {
    let targets = Tensor::new(&[2u32, 0, 4, 4, 1], &Device::Cpu).unwrap();
    let weights = Tensor::new(&[1.0f64, 0.0, 0.5, 2.0, 1.0], &Device::Cpu).unwrap();
    let inputs = [tensor(&[5, 6], 7, 3.0), targets, weights];
    check_gradients("cross_entropy", &inputs, &[0], |x| {
        fused_kernels::cross_entropy(&x[0], &x[1], &x[2])
    });
}

#[test]
fn embedding_with_repeated_ids() {
    // Row 3 named three times, row 2 never; ids of shape [2, 3].
    let ids = Tensor::new(&[[3u32, 0, 3], [4, 3, 1]], &Device::Cpu).unwrap();
    let inputs = [tensor(&[5, 4], 30, 1.0), ids];
    check_gradients("embedding", &inputs, &[0], |x| {
        fused_kernels::embedding(&x[1], &x[0])
    });
}

#[test]
fn linear_cross_entropy_in_chunks() {
    // 7 rows in chunks of 3 (the last one short); a padding row; the last class as a target.
    let targets = Tensor::new(&[2u32, 0, 6, 6, 1, 3, 5], &Device::Cpu).unwrap();
    let weights = Tensor::new(&[1.0f64, 0.0, 0.5, 2.0, 1.0, 1.0, 0.25], &Device::Cpu).unwrap();
    let inputs = [
        tensor(&[7, 4], 31, 2.0),
        tensor(&[7, 4], 32, 1.0),
        targets,
        weights,
    ];
    check_gradients("linear_cross_entropy", &inputs, &[0, 1], |x| {
        fused_kernels::linear_cross_entropy_in_chunks(&x[0], &x[1], &x[2], &x[3], 3)
    });
}

#[test]
fn gelu_silu_swiglu() {
    let x = [tensor(&[3, 9], 8, 4.0)];
    check_gradients("gelu", &x, &[0], |x| fused_kernels::gelu(&x[0]));
    check_gradients("silu", &x, &[0], |x| fused_kernels::silu(&x[0]));
    let inputs = [tensor(&[3, 9], 9, 4.0), tensor(&[3, 9], 10, 2.0)];
    check_gradients("swiglu", &inputs, &[0, 1], |x| {
        fused_kernels::swiglu(&x[0], &x[1])
    });
}

#[test]
fn rotary() {
    let (t, d) = (5, 8);
    let angles = tensor(&[t, d / 2], 11, 3.0);
    let inputs = [
        tensor(&[2, 3, t, d], 12, 1.0),
        angles.cos().unwrap(),
        angles.sin().unwrap(),
    ];
    check_gradients("rotary", &inputs, &[0], |x| {
        fused_kernels::rotary(&x[0], &x[1], &x[2])
    });
}

#[test]
fn add_bias_and_linear() {
    let inputs = [tensor(&[2, 3, 5], 13, 1.0), tensor(&[5], 14, 1.0)];
    check_gradients("add_bias", &inputs, &[0, 1], |x| {
        fused_kernels::add_bias(&x[0], &x[1])
    });
    let inputs = [
        tensor(&[2, 3, 5], 15, 1.0),
        tensor(&[4, 5], 16, 1.0),
        tensor(&[4], 17, 1.0),
    ];
    check_gradients("linear", &inputs, &[0, 1, 2], |x| {
        fused_kernels::linear(&x[0], &x[1], Some(&x[2]))
    });
}

#[test]
fn non_contiguous_inputs_give_the_gradients_of_their_contiguous_copies() {
    // x transposed: [5, 2, 3] seen as [3, 2, 5] through a permutation.
    let base = tensor(&[5, 2, 3], 18, 2.0);
    let inputs = [base, tensor(&[5], 19, 1.0), tensor(&[5], 20, 1.0)];
    check_gradients("layer_norm (permuted x)", &inputs, &[0, 1, 2], |x| {
        let xt = x[0].permute((2, 1, 0))?;
        assert!(!xt.is_contiguous());
        fused_kernels::layer_norm(&xt, &x[1], &x[2], 1e-5)
    });
    let scores = tensor(&[4, 3, 2], 21, 2.0);
    check_gradients("causal_softmax (transposed)", &[scores], &[0], |x| {
        fused_kernels::causal_softmax(&x[0].transpose(0, 2)?.to_dtype(DType::F64)?, 1.0)
    });
}

#[test]
fn flash_attention_grouped_query_heads_and_a_packed_projection() {
    // B = 2, T = 5, H = 4 query heads sharing Hkv = 2 key/value heads, D = 3.
    let inputs = [
        tensor(&[2, 5, 4, 3], 22, 1.0),
        tensor(&[2, 5, 2, 3], 23, 2.0),
        tensor(&[2, 5, 2, 3], 24, 1.0),
    ];
    check_gradients("flash_attention", &inputs, &[0, 1, 2], |x| {
        fused_kernels::flash_attention(&x[0], &x[1], &x[2], 0.8)
    });
    // q, k, v as views of one packed [B, T, H + 2·Hkv, D] projection, read in place.
    let packed = [tensor(&[1, 4, 4, 2], 25, 1.5)];
    check_gradients("flash_attention (packed views)", &packed, &[0], |x| {
        let (q, k, v) = (
            x[0].narrow(2, 0, 2)?,
            x[0].narrow(2, 2, 1)?,
            x[0].narrow(2, 3, 1)?,
        );
        assert!(!q.is_contiguous());
        fused_kernels::flash_attention(&q, &k, &v, 1.0)
    });
}
