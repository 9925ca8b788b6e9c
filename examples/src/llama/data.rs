//! The dataset of the `llama` workload: rows of token ids, all of one length `T`: as Hugging Face
//! tokenizers and `datasets` produce them (`input_ids` `[N, T]` int64 in a safetensors file), the
//! built-in text cut into rows, or documents of a text corpus packed into rows with their
//! boundaries (accelerate-text's [`PackedRows`]).
//!
//! A batch is `input_ids` `[B, T]`; with `labels = input_ids` the causal-LM loss predicts the
//! `T - 1` tokens after the first of each row (in packed rows, only those whose predecessor is of
//! the same document), and the batch's count of predicted tokens is its number of items for
//! item-weighted accumulation.

use std::path::Path;
use std::sync::Arc;

use accelerate_core::data::{Batch, Dataset};
use accelerate_text::{PackedRows, TextBatch, TokenRow};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::segments::Segments;

/// The name of the tensor a `--data` file holds.
pub const INPUT_IDS: &str = "input_ids";

/// Rows of `row_len` token ids (see the module docs).
#[derive(Debug, Clone)]
pub struct TokenRows {
    source: Source,
    row_len: usize,
}

/// Where the rows' tokens are.
#[derive(Debug, Clone)]
enum Source {
    /// Whole rows, one sequence each.
    Tokens(Arc<Vec<u32>>),
    /// Documents packed into rows, their boundaries kept.
    Packed(Arc<PackedRows>),
}

/// One batch of rows.
#[derive(Debug, Clone)]
pub struct RowBatch {
    /// `[B, T]` u32 token ids.
    pub input_ids: Tensor,
    /// Predicted tokens in the batch: `B · (T - 1)`, or for packed rows the tokens whose
    /// predecessor is of the same document.
    pub predicted: usize,
    /// Where the documents of packed rows are (found on the loader's thread, from the host's
    /// segment ids, so the step never waits on the device to read them); `None` for rows of one
    /// sequence each.
    pub segments: Option<Segments>,
}

impl Batch for RowBatch {
    fn to_device(self, device: &Device) -> accelerate_core::Result<Self> {
        Ok(Self {
            input_ids: self.input_ids.to_device(device)?,
            ..self
        })
    }
}

impl TokenRows {
    /// Rows of `row_len` tokens from `tokens` (whose length is a multiple of `row_len`).
    pub fn new(tokens: Vec<u32>, row_len: usize) -> Result<Self> {
        if row_len < 2 {
            bail!("rows of {row_len} token(s) predict nothing; rows need at least 2 tokens");
        }
        if tokens.is_empty() || !tokens.len().is_multiple_of(row_len) {
            bail!(
                "{} tokens do not make whole rows of {row_len}",
                tokens.len()
            );
        }
        Ok(Self {
            source: Source::Tokens(Arc::new(tokens)),
            row_len,
        })
    }

    /// The rows of a packed corpus, `block_size` tokens each.
    pub fn packed(rows: PackedRows) -> Self {
        Self {
            row_len: rows.block_size(),
            source: Source::Packed(Arc::new(rows)),
        }
    }

    /// `text_tokens` cut into consecutive rows of `row_len` tokens (a partial last row dropped).
    pub fn cut(text_tokens: &[u32], row_len: usize) -> Result<Self> {
        let rows = text_tokens.len() / row_len.max(1);
        if rows == 0 {
            bail!(
                "the text holds {} tokens, fewer than one row of --context {row_len}; lower \
                 --context",
                text_tokens.len()
            );
        }
        Self::new(text_tokens[..rows * row_len].to_vec(), row_len)
    }

    /// The `input_ids` `[N, T]` int64 of the safetensors file at `path`, every id below
    /// `vocab_size` (the model's vocabulary; `None` to take any). Errors name the file, the
    /// problem and the fix.
    pub fn from_safetensors(path: &Path, vocab_size: Option<usize>) -> Result<Self> {
        let file = format!("--data {}", path.display());
        let mut tensors =
            accelerate_core::load_safetensors(path, &Device::Cpu).with_context(|| file.clone())?;
        let Some(ids) = tensors.remove(INPUT_IDS) else {
            let mut names: Vec<&String> = tensors.keys().collect();
            names.sort();
            bail!(
                "{file} holds no `{INPUT_IDS}` tensor (it holds {names:?}); save the token ids \
                 as `{INPUT_IDS}`, [N, T] int64"
            );
        };
        if ids.dtype() != DType::I64 {
            bail!(
                "{file}: `{INPUT_IDS}` holds {:?}; expected int64 token ids (torch.long, what \
                 tokenizers return): convert with .long()",
                ids.dtype()
            );
        }
        let (n, t) = match ids.dims() {
            &[n, t] => (n, t),
            dims => bail!(
                "{file}: `{INPUT_IDS}` has shape {dims:?}; expected [N, T], one row of T token \
                 ids per sample"
            ),
        };
        if n == 0 || t < 2 {
            bail!(
                "{file}: `{INPUT_IDS}` has shape [{n}, {t}]; it needs at least one row of at \
                 least 2 tokens (the loss predicts each token from those before it)"
            );
        }
        let values = ids.flatten_all()?.to_vec1::<i64>()?;
        let limit = vocab_size.map_or(u32::MAX as i64, |v| v as i64);
        if let Some((i, &bad)) = values
            .iter()
            .enumerate()
            .find(|(_, &v)| v < 0 || v >= limit)
        {
            bail!(
                "{file}: `{INPUT_IDS}`[{}, {}] is {bad}, outside the vocabulary 0..{limit}; \
                 use a config whose vocab_size covers the tokenizer (or re-tokenize)",
                i / t,
                i % t
            );
        }
        Self::new(values.into_iter().map(|v| v as u32).collect(), t)
    }

    /// Tokens per row (`T`).
    pub fn row_len(&self) -> usize {
        self.row_len
    }

    /// The largest token id of whole rows (the vocabulary a model needs is one more); `None`
    /// for packed rows, whose tokenizer gives the vocabulary.
    pub fn max_token(&self) -> Option<u32> {
        match &self.source {
            Source::Tokens(tokens) => Some(tokens.iter().copied().max().unwrap_or(0)),
            Source::Packed(_) => None,
        }
    }
}

impl Dataset for TokenRows {
    /// Row `i`'s token ids, and for packed rows its segment ids (empty for whole rows).
    type Item = TokenRow;
    type Batch = RowBatch;

    fn len(&self) -> usize {
        match &self.source {
            Source::Tokens(tokens) => tokens.len() / self.row_len,
            Source::Packed(rows) => rows.len(),
        }
    }

    fn get(&self, index: usize) -> accelerate_core::Result<TokenRow> {
        if index >= self.len() {
            return Err(accelerate_core::Error::Data(format!(
                "row {index} requested from a dataset of {} rows",
                self.len()
            )));
        }
        match &self.source {
            Source::Tokens(tokens) => {
                let start = index * self.row_len;
                Ok(TokenRow {
                    input_ids: tokens[start..start + self.row_len].to_vec(),
                    segment_ids: Vec::new(),
                })
            }
            Source::Packed(rows) => rows.get(index),
        }
    }

    fn collate(&self, items: Vec<TokenRow>) -> accelerate_core::Result<RowBatch> {
        let rows = items.len();
        if rows == 0 {
            return Err(accelerate_core::Error::Data(
                "an empty batch of token rows cannot be collated".into(),
            ));
        }
        if let Source::Packed(_) = self.source {
            let batch = TextBatch::from_rows(&items, 0)
                .map_err(|e| accelerate_core::Error::Data(e.to_string()))?;
            let segments = Segments::new(&batch.segment_ids)
                .map_err(|e| accelerate_core::Error::Data(format!("{e:#}")))?;
            return Ok(RowBatch {
                input_ids: batch.input_ids,
                predicted: segments.predicted(),
                segments: Some(segments),
            });
        }
        let flat: Vec<u32> = items.into_iter().flat_map(|r| r.input_ids).collect();
        Ok(RowBatch {
            input_ids: Tensor::from_vec(flat, (rows, self.row_len), &Device::Cpu)?,
            predicted: rows * (self.row_len - 1),
            segments: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_cut_into_whole_rows() {
        let ds = TokenRows::cut(&(0..23).collect::<Vec<u32>>(), 5).unwrap();
        assert_eq!(ds.len(), 4);
        assert_eq!(ds.get(1).unwrap().input_ids, vec![5, 6, 7, 8, 9]);
        let b = ds
            .collate(vec![ds.get(0).unwrap(), ds.get(3).unwrap()])
            .unwrap();
        assert_eq!(b.predicted, 2 * 4);
        assert_eq!(
            b.input_ids.to_vec2::<u32>().unwrap(),
            vec![vec![0, 1, 2, 3, 4], vec![15, 16, 17, 18, 19]]
        );
        assert!(TokenRows::cut(&[1, 2], 5).is_err());
    }

    fn write(dir: &Path, name: &str, t: Tensor) -> std::path::PathBuf {
        let p = dir.join("d.safetensors");
        accelerate_core::save_safetensors(&p, &[(name.to_string(), t)]).unwrap();
        p
    }

    #[test]
    fn data_files_are_checked_with_errors_that_name_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        let ids = Tensor::new(&[[1i64, 2, 3], [4, 5, 6]], &Device::Cpu).unwrap();
        let ok = write(dir.path(), INPUT_IDS, ids.clone());
        let ds = TokenRows::from_safetensors(&ok, Some(7)).unwrap();
        assert_eq!((ds.len(), ds.row_len(), ds.max_token()), (2, 3, Some(6)));
        let e = TokenRows::from_safetensors(&ok, Some(6)).unwrap_err();
        assert!(format!("{e:#}").contains("[1, 2] is 6"), "{e:#}");

        let p = write(dir.path(), "ids", ids.clone());
        let e = format!("{:#}", TokenRows::from_safetensors(&p, None).unwrap_err());
        assert!(e.contains("no `input_ids`") && e.contains("\"ids\""), "{e}");

        let p = write(dir.path(), INPUT_IDS, ids.to_dtype(DType::F32).unwrap());
        let e = format!("{:#}", TokenRows::from_safetensors(&p, None).unwrap_err());
        assert!(e.contains("F32") && e.contains("int64"), "{e}");

        let p = write(dir.path(), INPUT_IDS, ids.flatten_all().unwrap());
        let e = format!("{:#}", TokenRows::from_safetensors(&p, None).unwrap_err());
        assert!(e.contains("[6]") && e.contains("[N, T]"), "{e}");
    }
}
