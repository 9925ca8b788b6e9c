use fused_kernels_emulator::*;
#[test]
fn smoke() {
    let ks = kernels();
    println!("{} kernels: {:?}", ks.len(), ks);
    println!("{:?}", signature("layer_norm_backward_bf16"));
    let x = Buffer::from_slice(&[1.0f32, -2.0, 3.0]).unwrap();
    let mut y = Buffer::<f32>::poisoned(3).unwrap();
    launch("gelu_f32", 1, 256, 0, &[Arg::ptr(&x), Arg::ptr_mut(&mut y), Arg::U64(3)], Order::Increasing).unwrap();
    println!("{:?}", y.to_vec());
}
