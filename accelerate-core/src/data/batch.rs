//! What a data loader hands out: a value that can be moved to the training device.

use candle_core::{Device, Tensor};

use crate::error::Result;

/// A batch that can be moved to a device.
///
/// The data loader calls [`Batch::to_device`] on its prefetch thread, so the host-to-device copy
/// overlaps with the training step that consumes the previous batch.
pub trait Batch: Send + Sized + 'static {
    /// Moves every tensor of the batch to `device` (a no-op for tensors already there).
    fn to_device(self, device: &Device) -> Result<Self>;
}

impl Batch for Tensor {
    fn to_device(self, device: &Device) -> Result<Self> {
        Ok(Tensor::to_device(&self, device)?)
    }
}

impl Batch for (Tensor, Tensor) {
    fn to_device(self, device: &Device) -> Result<Self> {
        Ok((self.0.to_device(device)?, self.1.to_device(device)?))
    }
}

impl Batch for Vec<Tensor> {
    fn to_device(self, device: &Device) -> Result<Self> {
        self.into_iter().map(|t| t.to_device(device)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn moving_to_the_same_device_keeps_values_and_shapes() {
        let x = Tensor::new(&[[1f32, 2.0], [3.0, 4.0]], &Device::Cpu).unwrap();
        let y = Tensor::new(&[7i64, 8], &Device::Cpu).unwrap();
        let (bx, by) = (x.clone(), y.clone()).to_device(&Device::Cpu).unwrap();
        assert_eq!(
            bx.to_vec2::<f32>().unwrap(),
            vec![vec![1.0, 2.0], vec![3.0, 4.0]]
        );
        assert_eq!(by.dtype(), DType::I64);
        assert_eq!(by.to_vec1::<i64>().unwrap(), vec![7, 8]);

        let v = vec![x, y].to_device(&Device::Cpu).unwrap();
        assert_eq!(v.len(), 2);
        assert_eq!(v[1].to_vec1::<i64>().unwrap(), vec![7, 8]);
    }
}
