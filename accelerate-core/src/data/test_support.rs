//! Test datasets whose batches are their own sample indices, so tests can see exactly what a
//! loader handed out.

use candle_core::Device;

use super::batch::Batch;
use super::dataset::Dataset;
use crate::error::{Error, Result};

/// A batch that is the list of its sample indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct IndexBatch(pub Vec<usize>);

impl Batch for IndexBatch {
    fn to_device(self, _device: &Device) -> Result<Self> {
        Ok(self)
    }
}

/// Items are their own indices; one sample can be made to fail or to panic.
#[derive(Debug, Default)]
pub(crate) struct IndexDataset {
    pub len: usize,
    pub fail_at: Option<usize>,
    pub panic_at: Option<usize>,
}

impl IndexDataset {
    pub fn new(len: usize) -> Self {
        Self {
            len,
            ..Self::default()
        }
    }
}

impl Dataset for IndexDataset {
    type Item = usize;
    type Batch = IndexBatch;

    fn len(&self) -> usize {
        self.len
    }

    fn get(&self, index: usize) -> Result<usize> {
        if self.panic_at == Some(index) {
            panic!("sample {index} is cursed");
        }
        if self.fail_at == Some(index) || index >= self.len {
            return Err(Error::Data(format!("sample {index} is unreadable")));
        }
        Ok(index)
    }

    fn collate(&self, items: Vec<usize>) -> Result<IndexBatch> {
        Ok(IndexBatch(items))
    }
}
