//! [`JsonlShards`]: an [`IterableDataset`] of JSON Lines files on disk, read lazily, line by line.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::batch::Batch;
use super::iterable::{IterableDataset, Records};
use crate::error::{Error, Result};

/// The user's function that turns one parsed JSON record into an item.
type ParseFn<I> = dyn Fn(serde_json::Value) -> Result<I> + Send + Sync;
/// The user's function that builds a batch out of items.
type CollateFn<I, B> = dyn Fn(Vec<I>) -> Result<B> + Send + Sync;

/// One line of a shard, not parsed yet: its text and where it came from (for error messages).
#[derive(Debug, Clone)]
pub struct JsonlRecord {
    /// The shard the line was read from.
    pub path: Arc<PathBuf>,
    /// Its line number in the shard, from 1.
    pub line: usize,
    /// The line's text, without the line ending.
    pub text: String,
}

/// JSON Lines shards read as one stream: the shards in the order given, each line by line, opened
/// only when the stream reaches them, so the data never has to fit in memory. Lines holding only
/// white space are skipped (a trailing empty line is common). Each line is parsed (serde_json) and
/// turned into an item by the user's `parse` function on the loading workers.
///
/// A shard that cannot be opened or read is an error naming the file; a line that is not JSON, or
/// that `parse` refuses, is an error naming the file and the line.
pub struct JsonlShards<I, B> {
    shards: Vec<Arc<PathBuf>>,
    parse: Box<ParseFn<I>>,
    collate: Box<CollateFn<I, B>>,
}

impl<I: Send + 'static, B: Batch> JsonlShards<I, B> {
    /// The stream of the lines of `shards`, in that order. `parse` turns a line's JSON value into
    /// an item (e.g. `serde_json::from_value` into a struct, then tokenize); `collate` builds a
    /// batch out of items. Refuses an empty list and a shard that is not a readable file.
    pub fn new(
        shards: impl IntoIterator<Item = impl Into<PathBuf>>,
        parse: impl Fn(serde_json::Value) -> Result<I> + Send + Sync + 'static,
        collate: impl Fn(Vec<I>) -> Result<B> + Send + Sync + 'static,
    ) -> Result<Self> {
        let shards: Vec<Arc<PathBuf>> = shards.into_iter().map(|p| Arc::new(p.into())).collect();
        if shards.is_empty() {
            return Err(Error::Data(
                "JsonlShards::new was given no shard; pass the paths of the .jsonl files".into(),
            ));
        }
        for path in &shards {
            match std::fs::metadata(path.as_path()) {
                Ok(m) if m.is_file() => {}
                Ok(_) => {
                    return Err(Error::Data(format!(
                        "{}: a JSONL shard must be a file, this is a directory",
                        path.display()
                    )))
                }
                Err(e) => return Err(shard_error(path, e)),
            }
        }
        Ok(Self {
            shards,
            parse: Box::new(parse),
            collate: Box::new(collate),
        })
    }

    /// The shards, in stream order.
    pub fn shards(&self) -> impl Iterator<Item = &Path> {
        self.shards.iter().map(|p| p.as_path())
    }
}

fn shard_error(path: &Path, e: std::io::Error) -> Error {
    Error::Data(format!(
        "cannot open the JSONL shard {}: {e}; check the path (every rank reads every shard)",
        path.display()
    ))
}

/// The lines of the shards, in order, each shard opened when the stream reaches it.
struct Lines {
    shards: std::vec::IntoIter<Arc<PathBuf>>,
    current: Option<(Arc<PathBuf>, std::io::Lines<BufReader<File>>, usize)>,
}

impl Iterator for Lines {
    type Item = Result<JsonlRecord>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.current.is_none() {
                let path = self.shards.next()?;
                match File::open(path.as_path()) {
                    Ok(file) => self.current = Some((path, BufReader::new(file).lines(), 0)),
                    Err(e) => {
                        self.shards = Vec::new().into_iter();
                        return Some(Err(shard_error(&path, e)));
                    }
                }
            }
            let (path, lines, number) = self.current.as_mut()?;
            match lines.next() {
                None => self.current = None,
                Some(Ok(mut text)) => {
                    *number += 1;
                    // A byte-order mark (editors on Windows write one) is not part of the JSON.
                    if *number == 1 && text.starts_with('\u{feff}') {
                        text.drain(..'\u{feff}'.len_utf8());
                    }
                    if text.trim().is_empty() {
                        continue;
                    }
                    return Some(Ok(JsonlRecord {
                        path: Arc::clone(path),
                        line: *number,
                        text,
                    }));
                }
                Some(Err(e)) => {
                    let message = format!(
                        "{}:{}: cannot read the line: {e}",
                        path.display(),
                        *number + 1
                    );
                    self.current = None;
                    self.shards = Vec::new().into_iter();
                    return Some(Err(Error::Data(message)));
                }
            }
        }
    }
}

impl<I: Send + 'static, B: Batch> IterableDataset for JsonlShards<I, B> {
    type Record = JsonlRecord;
    type Item = I;
    type Batch = B;

    /// The same stream every epoch: the shards in the order given.
    fn records(&self, _epoch: u64) -> Result<Records<'_, JsonlRecord>> {
        Ok(Box::new(Lines {
            shards: self.shards.clone().into_iter(),
            current: None,
        }))
    }

    fn transform(&self, record: JsonlRecord) -> Result<I> {
        let at = || format!("{}:{}", record.path.display(), record.line);
        let value: serde_json::Value = serde_json::from_str(&record.text).map_err(|e| {
            Error::Data(format!(
                "{}: not a JSON value ({e}); every line of a JSONL shard holds one JSON record",
                at()
            ))
        })?;
        (self.parse)(value).map_err(|e| Error::Data(format!("{}: {e}", at())))
    }

    fn collate(&self, items: Vec<I>) -> Result<B> {
        (self.collate)(items)
    }
}

impl<I, B> std::fmt::Debug for JsonlShards<I, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonlShards")
            .field("shards", &self.shards)
            .finish_non_exhaustive()
    }
}
