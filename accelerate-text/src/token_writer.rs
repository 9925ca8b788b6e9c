//! [`TokenFileWriter`]: writes a [`TokenFile`](crate::TokenFile) document by document, in bounded
//! memory, and atomically (a temporary file renamed over the target at the end, so a reader never
//! sees a half-written file and an interrupted run leaves the old file in place).

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::error::{Error, Result};
use crate::token_file::{align8, tokens_offset, Header, TokenDtype, FORMAT_NAME, MAGIC, VERSION};

/// What a finished token file holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TokenFileSummary {
    /// Documents written.
    pub documents: u64,
    /// Token ids written.
    pub tokens: u64,
    /// The file's size in bytes.
    pub bytes: u64,
}

/// Writes a token file: ids go to a temporary file beside the target, the document offsets to a
/// second one (so neither is held in memory), and [`TokenFileWriter::finish`] appends the offsets,
/// fills in the header and renames the result over `path`. Dropped unfinished, it removes its
/// temporary files and leaves `path` as it was.
#[derive(Debug)]
pub struct TokenFileWriter {
    path: PathBuf,
    tmp: PathBuf,
    offsets_tmp: PathBuf,
    ids: Option<BufWriter<File>>,
    offsets: Option<BufWriter<File>>,
    dtype: TokenDtype,
    tokenizer: String,
    header_len: u64,
    documents: u64,
    tokens: u64,
}

impl TokenFileWriter {
    /// Starts writing `path` with ids stored as `dtype` and the tokenizer's name or fingerprint
    /// recorded in the header (readers compare it with [`TokenFile::check_tokenizer`]).
    ///
    /// [`TokenFile::check_tokenizer`]: crate::TokenFile::check_tokenizer
    pub fn create(path: impl AsRef<Path>, dtype: TokenDtype, tokenizer: &str) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let dir = match path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let name = path
            .file_name()
            .ok_or_else(|| {
                Error::Text(format!(
                    "{} is not a file path; name the token file to write",
                    path.display()
                ))
            })?
            .to_string_lossy()
            .into_owned();
        static WRITES: AtomicU64 = AtomicU64::new(0);
        let unique = format!(
            "{}.{}",
            std::process::id(),
            WRITES.fetch_add(1, Ordering::Relaxed)
        );
        let tmp = dir.join(format!(".{name}.tmp.{unique}"));
        let offsets_tmp = dir.join(format!(".{name}.offsets.tmp.{unique}"));
        // The header is written last, when the counts are known; its room is reserved now, as
        // long as the longest header (the counts at their largest) can be.
        let longest = header_json(dtype, tokenizer, u64::MAX, u64::MAX)?;
        let header_len = align8(longest.len() as u64);
        let create = |p: &Path| {
            File::create(p).map(BufWriter::new).map_err(|e| {
                Error::Text(format!(
                    "cannot create {}: {e}; check that the directory exists and is writable",
                    p.display()
                ))
            })
        };
        let mut writer = Self {
            ids: None,
            offsets: None,
            path,
            tmp,
            offsets_tmp,
            dtype,
            tokenizer: tokenizer.to_owned(),
            header_len,
            documents: 0,
            tokens: 0,
        };
        let mut ids = create(&writer.tmp)?;
        let offsets = create(&writer.offsets_tmp)?;
        ids.write_all(&vec![0; tokens_offset(header_len) as usize])
            .map_err(|e| writer.io(e))?;
        writer.ids = Some(ids);
        writer.offsets = Some(offsets);
        writer.write_offset(0)?;
        Ok(writer)
    }

    /// The ids' type.
    pub fn dtype(&self) -> TokenDtype {
        self.dtype
    }

    /// Documents written so far.
    pub fn documents(&self) -> u64 {
        self.documents
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    fn io(&self, e: std::io::Error) -> Error {
        Error::Text(format!(
            "cannot write the token file {}: {e}",
            self.path.display()
        ))
    }

    fn write_offset(&mut self, offset: u64) -> Result<()> {
        let result = match self.offsets.as_mut() {
            Some(w) => w.write_all(&offset.to_le_bytes()),
            None => return Err(self.finished()),
        };
        result.map_err(|e| self.io(e))
    }

    fn finished(&self) -> Error {
        Error::Text(format!(
            "the token file {} was already finished",
            self.path.display()
        ))
    }

    /// Appends one document's ids. Refuses an id too large for the file's dtype (a vocabulary
    /// larger than the one the dtype was chosen for).
    pub fn push_document(&mut self, ids: &[u32]) -> Result<()> {
        let max = self.dtype.max_id();
        if let Some(&id) = ids.iter().find(|&&id| id > max) {
            return Err(Error::Text(format!(
                "token id {id} does not fit the {:?} ids of {}; choose the dtype from the \
                 tokenizer's whole vocabulary (TokenDtype::for_vocab)",
                self.dtype,
                self.path.display()
            )));
        }
        let result = match (self.ids.as_mut(), self.dtype) {
            (None, _) => return Err(self.finished()),
            (Some(w), TokenDtype::U16) => ids
                .iter()
                .try_for_each(|&id| w.write_all(&(id as u16).to_le_bytes())),
            (Some(w), TokenDtype::U32) => ids
                .iter()
                .try_for_each(|&id| w.write_all(&id.to_le_bytes())),
        };
        result.map_err(|e| self.io(e))?;
        self.tokens += ids.len() as u64;
        self.documents += 1;
        self.write_offset(self.tokens)
    }

    /// Completes the file (offsets appended, header filled in, synced) and renames it over the
    /// target path.
    pub fn finish(mut self) -> Result<TokenFileSummary> {
        let (Some(ids), Some(offsets)) = (self.ids.take(), self.offsets.take()) else {
            return Err(self.finished());
        };
        let summary = self.complete(ids, offsets).map_err(|e| self.io(e))?;
        self.remove_temporaries();
        Ok(summary)
    }

    fn complete(
        &self,
        ids: BufWriter<File>,
        offsets: BufWriter<File>,
    ) -> std::io::Result<TokenFileSummary> {
        let mut file = ids.into_inner().map_err(|e| e.into_error())?;
        let ids_end = tokens_offset(self.header_len) + self.tokens * self.dtype.width() as u64;
        let padding = align8(ids_end) - ids_end;
        file.write_all(&vec![0; padding as usize])?;
        let mut offsets = offsets.into_inner().map_err(|e| e.into_error())?;
        offsets.flush()?;
        drop(offsets);
        std::io::copy(&mut File::open(&self.offsets_tmp)?, &mut file)?;

        let header = header_json(self.dtype, &self.tokenizer, self.documents, self.tokens)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let mut block = Vec::with_capacity(tokens_offset(self.header_len) as usize);
        block.extend_from_slice(MAGIC);
        block.extend_from_slice(&self.header_len.to_le_bytes());
        block.extend_from_slice(header.as_bytes());
        block.resize(tokens_offset(self.header_len) as usize, b' ');
        file.seek(SeekFrom::Start(0))?;
        file.write_all(&block)?;
        file.sync_all()?;
        let bytes = file.metadata()?.len();
        drop(file);
        std::fs::rename(&self.tmp, &self.path)?;
        // Make the rename itself durable.
        if let Some(dir) = self.path.parent() {
            let dir = if dir.as_os_str().is_empty() {
                Path::new(".")
            } else {
                dir
            };
            if let Ok(d) = File::open(dir) {
                let _ = d.sync_all();
            }
        }
        Ok(TokenFileSummary {
            documents: self.documents,
            tokens: self.tokens,
            bytes,
        })
    }

    fn remove_temporaries(&self) {
        let _ = std::fs::remove_file(&self.tmp);
        let _ = std::fs::remove_file(&self.offsets_tmp);
    }
}

impl Drop for TokenFileWriter {
    fn drop(&mut self) {
        // Unfinished (an error, or dropped on purpose): leave no temporary file behind. After a
        // successful finish `tmp` has been renamed away and removing it does nothing.
        self.ids = None;
        self.offsets = None;
        self.remove_temporaries();
    }
}

fn header_json(dtype: TokenDtype, tokenizer: &str, documents: u64, tokens: u64) -> Result<String> {
    serde_json::to_string(&Header {
        format: FORMAT_NAME.into(),
        version: VERSION,
        dtype,
        tokenizer: tokenizer.into(),
        documents,
        tokens,
    })
    .map_err(|e| Error::Text(format!("cannot write the token file header: {e}")))
}
