//! [`TokenFile`]: a corpus tokenized ahead of time into one file, read by mapping it into memory,
//! so that a corpus read many times (or larger than memory) is tokenized once and never loaded.
//!
//! Layout, all integers little-endian:
//!
//! | bytes | what |
//! |---|---|
//! | 8 | magic `ACTOKENS` |
//! | 8 | `H`, the length of the header (a multiple of 8) |
//! | `H` | JSON header, padded with spaces: `format`, `version`, `dtype` (`u16` or `u32`), `tokenizer`, `documents` (`D`), `tokens` (`T`) |
//! | `T × 2` or `T × 4` | the token ids of every document, in order |
//! | 0–7 | zero padding to a multiple of 8 |
//! | `(D + 1) × 8` | `u64` document offsets: where each document starts in the ids, then `T` |
//!
//! Written by [`TokenFileWriter`](crate::TokenFileWriter).

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::packing::StoredTokens;

/// The first 8 bytes of every token file.
pub(crate) const MAGIC: &[u8; 8] = b"ACTOKENS";
/// The `format` field of the header.
pub(crate) const FORMAT_NAME: &str = "accelerate-text token file";
/// The version written; a reader refuses others.
pub(crate) const VERSION: u32 = 1;
/// What every message about a bad token file says to do.
pub(crate) const REWRITE_HINT: &str =
    "re-run the tokenize command on the corpus to write the token file again";

/// How token ids are stored: 2 bytes when every id fits, 4 otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// `u16`: vocabularies of at most 65 536 ids.
    U16,
    /// `u32`: larger vocabularies.
    U32,
}

impl TokenDtype {
    /// The smallest type that holds every id of a vocabulary of `vocab_size` ids (`0 ..
    /// vocab_size`).
    pub fn for_vocab(vocab_size: usize) -> Self {
        if vocab_size <= 1 << 16 {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Bytes per id.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The largest id it holds.
    pub fn max_id(self) -> u32 {
        match self {
            TokenDtype::U16 => u32::from(u16::MAX),
            TokenDtype::U32 => u32::MAX,
        }
    }
}

/// The JSON header of a token file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Header {
    pub format: String,
    pub version: u32,
    pub dtype: TokenDtype,
    pub tokenizer: String,
    pub documents: u64,
    pub tokens: u64,
}

/// Where the ids start in a file whose header is `header_len` bytes.
pub(crate) fn tokens_offset(header_len: u64) -> u64 {
    16 + header_len
}

/// Rounds up to a multiple of 8 (offsets are 8-byte aligned in the file, so in the mapping).
pub(crate) fn align8(n: u64) -> u64 {
    n.div_ceil(8) * 8
}

/// A token file mapped into memory: its ids and document offsets, read without loading the file.
///
/// The file must not be changed in place while it is open (a changed mapping is undefined
/// behaviour); the writer never does that: it writes a new file and renames it over the old one,
/// which leaves open mappings of the old file intact.
#[derive(Debug)]
pub struct TokenFile {
    path: PathBuf,
    map: Mmap,
    header: Header,
    documents: usize,
    tokens_at: usize,
    offsets_at: usize,
}

impl TokenFile {
    /// Opens and checks `path`: the magic, the header, and that the file's length is the one the
    /// header implies (so a truncated file is refused), and that the offsets start at 0 and end
    /// at the token count.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| {
            Error::Text(format!(
                "cannot open the token file {}: {e}; check the path, or {REWRITE_HINT}",
                path.display()
            ))
        })?;
        // SAFETY: the mapping is only read, and token files are replaced by rename, never
        // changed in place (see the type's documentation).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| {
            Error::Text(format!("cannot map the token file {}: {e}", path.display()))
        })?;
        let shown = path.display().to_string();
        let bad = |problem: String| {
            Error::Text(format!(
                "{shown} is not a valid token file: {problem}; {REWRITE_HINT}"
            ))
        };
        let len = map.len() as u64;
        if len < 16 {
            return Err(bad(format!("it holds {len} bytes, less than a header")));
        }
        if &map[..8] != MAGIC {
            return Err(bad(
                "it does not start with the token file magic (ACTOKENS)".into(),
            ));
        }
        let header_len = u64::from_le_bytes(map[8..16].try_into().expect("8 bytes"));
        if header_len % 8 != 0 || header_len > len.saturating_sub(16) {
            return Err(bad(format!(
                "its header length {header_len} does not fit in its {len} bytes (truncated?)"
            )));
        }
        let header_bytes = &map[16..tokens_offset(header_len) as usize];
        let header: Header = serde_json::from_slice(header_bytes)
            .map_err(|e| bad(format!("its header is not readable JSON ({e})")))?;
        if header.format != FORMAT_NAME {
            return Err(bad(format!(
                "its header names the format {:?}",
                header.format
            )));
        }
        if header.version != VERSION {
            return Err(bad(format!(
                "it is of version {}, this reader reads version {VERSION}",
                header.version
            )));
        }
        let width = header.dtype.width() as u64;
        let expected = header
            .tokens
            .checked_mul(width)
            .and_then(|ids| tokens_offset(header_len).checked_add(ids))
            .and_then(|end| end.checked_add(7))
            .map(|end| end / 8 * 8)
            .and_then(|at| {
                let offsets = header.documents.checked_add(1)?.checked_mul(8)?;
                Some((at, at.checked_add(offsets)?))
            });
        let Some((offsets_at, expected)) = expected.filter(|&(_, end)| end == len) else {
            return Err(bad(format!(
                "it holds {len} bytes, not the {} its header implies ({} documents, {} tokens of \
                 {width} bytes): it is truncated or damaged",
                expected.map_or("many".into(), |(_, e)| e.to_string()),
                header.documents,
                header.tokens
            )));
        };
        debug_assert_eq!(expected, len);
        let documents = usize::try_from(header.documents)
            .map_err(|_| bad("it holds more documents than this machine can address".into()))?;
        let tokens_at = usize::try_from(tokens_offset(header_len))
            .map_err(|_| bad("its header is too large".into()))?;
        let file = Self {
            path,
            map,
            header,
            documents,
            tokens_at,
            offsets_at: offsets_at as usize,
        };
        let (first, last) = (file.offset(0), file.offset(documents));
        if first != 0 || last != file.header.tokens {
            return Err(bad(format!(
                "its document offsets run from {first} to {last}, not from 0 to its {} tokens",
                file.header.tokens
            )));
        }
        Ok(file)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// How the ids are stored.
    pub fn dtype(&self) -> TokenDtype {
        self.header.dtype
    }

    /// The tokenizer's name or fingerprint, as the writer recorded it.
    pub fn tokenizer(&self) -> &str {
        &self.header.tokenizer
    }

    /// Refuses the file if it was tokenized with another tokenizer than `expected` (a name or
    /// fingerprint, compared as the writer recorded it).
    pub fn check_tokenizer(&self, expected: &str) -> Result<()> {
        if self.header.tokenizer != expected {
            return Err(Error::Text(format!(
                "{} was tokenized with {:?}, not with the tokenizer in use ({expected:?}); its ids \
                 would mean other tokens: {REWRITE_HINT} with this tokenizer",
                self.path.display(),
                self.header.tokenizer
            )));
        }
        Ok(())
    }

    /// Number of documents.
    pub fn documents(&self) -> usize {
        self.documents
    }

    /// Number of tokens.
    pub fn tokens(&self) -> u64 {
        self.header.tokens
    }

    /// The offset stored at `index` (`0..=documents`), read from the mapping.
    fn offset(&self, index: usize) -> u64 {
        let at = self.offsets_at + index * 8;
        u64::from_le_bytes(self.map[at..at + 8].try_into().expect("8 bytes"))
    }

    fn damaged(&self, problem: String) -> Error {
        Error::Text(format!(
            "{} is damaged: {problem}; {REWRITE_HINT}",
            self.path.display()
        ))
    }

    /// The token range of document `doc`.
    pub fn document_range(&self, doc: usize) -> Result<Range<u64>> {
        if doc >= self.documents {
            return Err(Error::Text(format!(
                "document {doc} requested from {}, which holds {}",
                self.path.display(),
                self.documents
            )));
        }
        let (start, end) = (self.offset(doc), self.offset(doc + 1));
        if start > end || end > self.header.tokens {
            return Err(self.damaged(format!(
                "document {doc} spans tokens {start}..{end} of {}",
                self.header.tokens
            )));
        }
        Ok(start..end)
    }

    /// The ids of document `doc`.
    pub fn document(&self, doc: usize) -> Result<Vec<u32>> {
        let range = self.document_range(doc)?;
        let mut ids = Vec::with_capacity((range.end - range.start) as usize);
        self.read_tokens(range.start, (range.end - range.start) as usize, &mut ids)?;
        Ok(ids)
    }

    /// Appends the ids `start .. start + len` to `out`.
    pub fn read_tokens(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()> {
        let end = start
            .checked_add(len as u64)
            .filter(|&e| e <= self.header.tokens);
        if end.is_none() {
            return Err(Error::Text(format!(
                "tokens {start}..+{len} requested from {}, which holds {}",
                self.path.display(),
                self.header.tokens
            )));
        }
        let width = self.header.dtype.width();
        let from = self.tokens_at + start as usize * width;
        let bytes = &self.map[from..from + len * width];
        match self.header.dtype {
            TokenDtype::U16 => out.extend(
                bytes
                    .chunks_exact(2)
                    .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]]))),
            ),
            TokenDtype::U32 => out.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            ),
        }
        Ok(())
    }

    /// Checks every document offset (that they never decrease): reads the whole offset table,
    /// which [`TokenFile::open`] does not.
    pub fn verify(&self) -> Result<()> {
        let mut previous = 0;
        for index in 1..=self.documents {
            let offset = self.offset(index);
            if offset < previous {
                return Err(self.damaged(format!(
                    "document offset {index} ({offset}) is below the one before it ({previous})"
                )));
            }
            previous = offset;
        }
        Ok(())
    }
}

impl StoredTokens for TokenFile {
    fn token_count(&self) -> u64 {
        self.header.tokens
    }

    fn document_count(&self) -> usize {
        self.documents
    }

    fn document_start(&self, doc: usize) -> Result<u64> {
        if doc > self.documents {
            return Err(Error::Text(format!(
                "document {doc} requested from {}, which holds {}",
                self.path.display(),
                self.documents
            )));
        }
        let offset = self.offset(doc);
        if offset > self.header.tokens {
            return Err(self.damaged(format!(
                "document {doc} starts at token {offset} of {}",
                self.header.tokens
            )));
        }
        Ok(offset)
    }

    fn read_tokens(&self, start: u64, len: usize, out: &mut Vec<u32>) -> Result<()> {
        TokenFile::read_tokens(self, start, len, out)
    }
}
