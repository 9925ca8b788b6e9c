//! [`TensorDataset`]: an in-memory dataset of rows, optionally read from a safetensors file.

use std::path::Path;

use candle_core::safetensors::Load;
use candle_core::{Device, Tensor};

use super::dataset::Dataset;
use crate::error::{Error, Result};

/// In-memory dataset of rows: features `x` of shape `[N, ...]` and targets `y` of shape `[N, ...]`.
///
/// An item is the pair of rows `(x[i], y[i])`; a batch is `(x[indices], y[indices])`, gathered with
/// one `index_select` per tensor. The tensors stay on the device they were created on; the data
/// loader moves batches to its own device.
#[derive(Debug, Clone)]
pub struct TensorDataset {
    x: Tensor,
    y: Tensor,
}

impl TensorDataset {
    /// A dataset of the rows of `x` and `y`; both need at least one dimension, the same first one.
    pub fn new(x: Tensor, y: Tensor) -> Result<Self> {
        if x.rank() == 0 || y.rank() == 0 {
            return Err(Error::Data(format!(
                "TensorDataset::new needs tensors of rows (rank >= 1, first dimension = samples); \
                 got x of shape {:?} and y of shape {:?}",
                x.dims(),
                y.dims()
            )));
        }
        if x.dim(0)? != y.dim(0)? {
            return Err(Error::Data(format!(
                "TensorDataset::new: x has {} rows (shape {:?}) but y has {} (shape {:?}); both \
                 need one row per sample",
                x.dim(0)?,
                x.dims(),
                y.dim(0)?,
                y.dims()
            )));
        }
        Ok(Self { x, y })
    }

    /// Reads the tensors `x` and `y` of a safetensors file, as written by PyTorch with
    /// `safetensors.torch.save_file({"x": x, "y": y}, path)` (labels are then usually int64, kept
    /// as `I64`). The tensors are loaded on the CPU.
    pub fn from_safetensors(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let (x, y) = read_xy(path)?;
        Self::new(x, y).map_err(|e| in_file(path, e))
    }

    /// As [`TensorDataset::from_safetensors`], and reshapes each row of `x` to `feature_shape`
    /// (e.g. images stored as `[N, 28, 28]` read as `[N, 784]`); an error if a row of `x` does not
    /// hold exactly that many elements.
    pub fn from_safetensors_with_features(
        path: impl AsRef<Path>,
        feature_shape: &[usize],
    ) -> Result<Self> {
        let path = path.as_ref();
        let (x, y) = read_xy(path)?;
        let dataset = Self::new(x, y).map_err(|e| in_file(path, e))?;
        let rows = dataset.len();
        let row_elems: usize = dataset.x.dims()[1..].iter().product();
        let wanted: usize = feature_shape.iter().product();
        if row_elems != wanted {
            return Err(Error::Data(format!(
                "{}: tensor \"x\" has shape {:?}, whose rows of shape {:?} ({row_elems} elements) do \
                 not fit the expected feature shape {feature_shape:?} ({wanted} elements); check \
                 that the file holds the data the model expects",
                path.display(),
                dataset.x.dims(),
                &dataset.x.dims()[1..],
            )));
        }
        let mut shape = vec![rows];
        shape.extend_from_slice(feature_shape);
        let x = dataset.x.reshape(shape)?;
        Ok(Self { x, y: dataset.y })
    }

    /// The features, `[N, ...]`.
    pub fn x(&self) -> &Tensor {
        &self.x
    }

    /// The targets, `[N, ...]`.
    pub fn y(&self) -> &Tensor {
        &self.y
    }

    fn check_index(&self, index: usize) -> Result<()> {
        if index >= self.len() {
            return Err(Error::Data(format!(
                "sample index {index} is out of range for a TensorDataset of {} rows",
                self.len()
            )));
        }
        Ok(())
    }
}

impl Dataset for TensorDataset {
    type Item = (Tensor, Tensor);
    type Batch = (Tensor, Tensor);

    fn len(&self) -> usize {
        self.x.dims()[0]
    }

    fn get(&self, index: usize) -> Result<Self::Item> {
        self.check_index(index)?;
        Ok((self.x.get(index)?, self.y.get(index)?))
    }

    fn collate(&self, items: Vec<Self::Item>) -> Result<Self::Batch> {
        let (xs, ys): (Vec<Tensor>, Vec<Tensor>) = items.into_iter().unzip();
        if xs.is_empty() {
            return Err(Error::Data(
                "cannot collate an empty list of samples".into(),
            ));
        }
        Ok((Tensor::stack(&xs, 0)?, Tensor::stack(&ys, 0)?))
    }

    fn get_batch(&self, indices: &[usize]) -> Result<Self::Batch> {
        if let Some(&bad) = indices.iter().find(|&&i| i >= self.len()) {
            self.check_index(bad)?;
        }
        let x_ids = index_tensor(indices, self.x.device())?;
        let y_ids = if self.y.device().same_device(self.x.device()) {
            x_ids.clone()
        } else {
            index_tensor(indices, self.y.device())?
        };
        Ok((
            self.x.index_select(&x_ids, 0)?,
            self.y.index_select(&y_ids, 0)?,
        ))
    }
}

/// The row indices as a tensor for `index_select`: u32 (supported by every backend) when they fit.
fn index_tensor(indices: &[usize], device: &Device) -> Result<Tensor> {
    let fits_u32 = indices.iter().all(|&i| u32::try_from(i).is_ok());
    let ids = if fits_u32 {
        let ids: Vec<u32> = indices.iter().map(|&i| i as u32).collect();
        Tensor::from_vec(ids, indices.len(), device)?
    } else {
        let ids: Vec<i64> = indices.iter().map(|&i| i as i64).collect();
        Tensor::from_vec(ids, indices.len(), device)?
    };
    Ok(ids)
}

/// Prefixes a dataset error with the file it came from.
fn in_file(path: &Path, error: Error) -> Error {
    match error {
        Error::Data(msg) => Error::Data(format!("{}: {msg}", path.display())),
        other => other,
    }
}

/// Reads tensors `x` and `y` of a safetensors file onto the CPU, with errors that name the file.
fn read_xy(path: &Path) -> Result<(Tensor, Tensor)> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::Data(format!(
                "dataset file {} does not exist; check the path, or write the file with \
                 safetensors.torch.save_file({{\"x\": x, \"y\": y}}, path)",
                path.display()
            )))
        }
        Err(e) => return Err(Error::io(path, e)),
    };
    let file = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
        Error::Data(format!(
            "{} is not a safetensors file ({e}); write datasets with \
             safetensors.torch.save_file({{\"x\": x, \"y\": y}}, path)",
            path.display()
        ))
    })?;
    let load = |key: &str| -> Result<Tensor> {
        let view = file.tensor(key).map_err(|_| {
            let mut found = file.names();
            found.sort();
            Error::Data(format!(
                "{} has no tensor \"{key}\" (it holds: {}); a TensorDataset file needs tensors \
                 named \"x\" (features) and \"y\" (targets)",
                path.display(),
                if found.is_empty() {
                    "no tensors".to_string()
                } else {
                    found.join(", ")
                }
            ))
        })?;
        view.load(&Device::Cpu).map_err(|e| {
            Error::Data(format!(
                "{}: cannot load tensor \"{key}\" (dtype {:?}, shape {:?}): {e}",
                path.display(),
                view.dtype(),
                view.shape()
            ))
        })
    };
    let x = load("x")?;
    let y = load("y")?;
    if x.rank() >= 1 && y.rank() >= 1 && x.dim(0)? != y.dim(0)? {
        return Err(Error::Data(format!(
            "{}: \"x\" has {} rows (shape {:?}) but \"y\" has {} (shape {:?}); both need one row \
             per sample",
            path.display(),
            x.dim(0)?,
            x.dims(),
            y.dim(0)?,
            y.dims()
        )));
    }
    Ok((x, y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use std::collections::HashMap;

    /// x row i = [3i, 3i+1, 3i+2], y row i = 10 + i (int64, as PyTorch labels).
    fn rows(n: usize) -> (Tensor, Tensor) {
        let x = Tensor::arange(0f32, (3 * n) as f32, &Device::Cpu)
            .unwrap()
            .reshape((n, 3))
            .unwrap();
        let y = Tensor::arange(10i64, 10 + n as i64, &Device::Cpu).unwrap();
        (x, y)
    }

    #[test]
    fn batches_gather_the_requested_rows_in_order() {
        let (x, y) = rows(5);
        let ds = TensorDataset::new(x, y).unwrap();
        assert_eq!(ds.len(), 5);
        let (bx, by) = ds.get_batch(&[3, 0, 3]).unwrap();
        assert_eq!(
            bx.to_vec2::<f32>().unwrap(),
            vec![
                vec![9.0, 10.0, 11.0],
                vec![0.0, 1.0, 2.0],
                vec![9.0, 10.0, 11.0]
            ]
        );
        assert_eq!(by.to_vec1::<i64>().unwrap(), vec![13, 10, 13]);

        // The generic path (one `get` per row, then `collate`) builds the same batch.
        let items = [3, 0, 3].iter().map(|&i| ds.get(i).unwrap()).collect();
        let (cx, cy) = ds.collate(items).unwrap();
        assert_eq!(cx.to_vec2::<f32>().unwrap(), bx.to_vec2::<f32>().unwrap());
        assert_eq!(cy.to_vec1::<i64>().unwrap(), vec![13, 10, 13]);
    }

    #[test]
    fn out_of_range_rows_and_mismatched_tensors_are_errors() {
        let (x, y) = rows(5);
        let ds = TensorDataset::new(x.clone(), y.clone()).unwrap();
        let err = ds.get_batch(&[1, 5]).unwrap_err().to_string();
        assert!(err.contains("index 5") && err.contains("5 rows"), "{err}");
        assert!(ds.get(7).is_err());

        let err = TensorDataset::new(x.clone(), y.narrow(0, 0, 4).unwrap())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("x has 5 rows") && err.contains("has 4"),
            "{err}"
        );
        let scalar = Tensor::new(1f32, &Device::Cpu).unwrap();
        let err = TensorDataset::new(scalar, y).unwrap_err().to_string();
        assert!(err.contains("rank >= 1"), "{err}");
    }

    fn save(path: &Path, tensors: &[(&str, Tensor)]) {
        let map: HashMap<String, Tensor> = tensors
            .iter()
            .map(|(k, t)| (k.to_string(), t.clone()))
            .collect();
        candle_core::safetensors::save(&map, path).unwrap();
    }

    #[test]
    fn safetensors_round_trip_keeps_values_and_int64_labels() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.safetensors");
        let x = Tensor::arange(0f32, 20.0, &Device::Cpu)
            .unwrap()
            .reshape((5, 2, 2))
            .unwrap();
        let y = Tensor::new(&[4i64, 3, 2, 1, 0], &Device::Cpu).unwrap();
        save(&path, &[("x", x), ("y", y)]);

        let ds = TensorDataset::from_safetensors(&path).unwrap();
        assert_eq!(ds.x().dims(), &[5, 2, 2]);
        assert_eq!(ds.y().dtype(), DType::I64);
        assert_eq!(ds.y().to_vec1::<i64>().unwrap(), vec![4, 3, 2, 1, 0]);
        assert_eq!(
            ds.x().get(1).unwrap().to_vec2::<f32>().unwrap(),
            vec![vec![4.0, 5.0], vec![6.0, 7.0]]
        );

        let flat = TensorDataset::from_safetensors_with_features(&path, &[4]).unwrap();
        assert_eq!(flat.x().dims(), &[5, 4]);
        assert_eq!(
            flat.x().get(4).unwrap().to_vec1::<f32>().unwrap(),
            vec![16.0, 17.0, 18.0, 19.0]
        );
    }

    #[test]
    fn safetensors_errors_name_the_file_and_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope.safetensors");
        let err = TensorDataset::from_safetensors(&missing)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("nope.safetensors") && err.contains("does not exist"),
            "{err}"
        );

        let garbage = dir.path().join("garbage.safetensors");
        std::fs::write(&garbage, b"definitely not a safetensors header").unwrap();
        let err = TensorDataset::from_safetensors(&garbage)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("garbage.safetensors") && err.contains("not a safetensors file"),
            "{err}"
        );

        let (x, y) = rows(4);
        let wrong_key = dir.path().join("labels.safetensors");
        save(&wrong_key, &[("x", x.clone()), ("labels", y.clone())]);
        let err = TensorDataset::from_safetensors(&wrong_key)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("labels.safetensors")
                && err.contains("no tensor \"y\"")
                && err.contains("it holds: labels, x"),
            "{err}"
        );

        let uneven = dir.path().join("uneven.safetensors");
        save(
            &uneven,
            &[("x", x.clone()), ("y", y.narrow(0, 0, 3).unwrap())],
        );
        let err = TensorDataset::from_safetensors(&uneven)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("uneven.safetensors") && err.contains("4 rows") && err.contains("has 3"),
            "{err}"
        );

        let good = dir.path().join("good.safetensors");
        save(&good, &[("x", x), ("y", y)]);
        let err = TensorDataset::from_safetensors_with_features(&good, &[2, 2])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("good.safetensors")
                && err.contains("[4, 3]")
                && err.contains("[2, 2]")
                && err.contains("do not fit"),
            "{err}"
        );
    }
}
