//! [`Corpus`]: the documents of a list of files (shards), read lazily in order.

use std::fmt;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::document::{Content, Document};
use crate::error::{Error, Result};
use crate::format::{Format, SampleBy, ACCEPTED_EXTENSIONS};
use crate::jsonl_source::{self, JsonlFile};
use crate::parquet_source::ParquetDocuments;
use crate::text_source::TextDocuments;

/// One file of a corpus and how it is read.
struct CorpusFile {
    path: Arc<PathBuf>,
    format: Format,
    /// accelerate-core's reader of the file's lines, for a JSON Lines file.
    jsonl: Option<JsonlFile>,
}

/// The documents of one or more files, in order: the files as given (a directory stands for its
/// files, sorted by name), each read lazily when the stream reaches it, so a corpus larger than
/// memory streams through.
///
/// - JSON Lines (`.jsonl`, `.json`): one object per line; the document is its `text` field by
///   default, or its `messages` list when it has no `text` (a conversation, for the tokenizer's
///   chat template), or the field named with [`Corpus::field`] (a string is text, a list is a
///   conversation). A line without the field is an error naming the file, the line and the
///   fields it has. Blank lines and `null` fields are skipped.
/// - Parquet (`.parquet`): a string column, `text` by default or the one named with
///   [`Corpus::field`], read row group by row group. Null rows are skipped; a missing column is an
///   error naming the columns present, and a column that is not of strings is refused.
/// - Plain text (`.txt`, `.text`, `.md`): by line (the default), paragraph or whole file
///   ([`Corpus::sample_by`]).
///
/// Documents that are empty or white space only are skipped (they would train on nothing but
/// EOS). A document's [`position`](Document::position) is its line (from 1) in JSON Lines and
/// text files, its row (from 0) in Parquet files. Cloning a corpus is cheap (the file list is
/// shared); every clone reads the files from their start.
#[derive(Clone)]
pub struct Corpus {
    files: Arc<[CorpusFile]>,
    field: Option<Arc<str>>,
    sample_by: SampleBy,
    /// The documents kept, by index in the whole stream (a split's side).
    range: Option<Range<usize>>,
}

impl Corpus {
    /// The corpus of `paths`, each file's format inferred from its extension (see [`Format`]).
    /// A directory stands for its files with a known extension (hidden files left out), sorted
    /// by name; they must all be of one format.
    pub fn new(paths: impl IntoIterator<Item = impl Into<PathBuf>>) -> Result<Self> {
        Self::build(paths, None)
    }

    /// The corpus of `paths`, every file read as `format` whatever its extension (a directory
    /// stands for its files with an extension of that format).
    pub fn with_format(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
        format: Format,
    ) -> Result<Self> {
        Self::build(paths, Some(format))
    }

    fn build(
        paths: impl IntoIterator<Item = impl Into<PathBuf>>,
        format: Option<Format>,
    ) -> Result<Self> {
        let paths: Vec<PathBuf> = paths.into_iter().map(Into::into).collect();
        if paths.is_empty() {
            return Err(Error::Text(
                "the corpus was given no file; pass the training files (or a directory of them)"
                    .into(),
            ));
        }
        let mut files = Vec::new();
        for path in paths {
            let meta = std::fs::metadata(&path).map_err(|e| {
                Error::Text(format!(
                    "cannot read the corpus file {}: {e}; check the path",
                    path.display()
                ))
            })?;
            if meta.is_dir() {
                for (file, format) in directory_files(&path, format)? {
                    files.push(corpus_file(file, format)?);
                }
            } else {
                let format = match format {
                    Some(f) => f,
                    None => Format::from_path(&path).ok_or_else(|| {
                        Error::Text(format!(
                            "{}: unknown corpus file extension; the accepted ones are \
                             {ACCEPTED_EXTENSIONS} (or name the format of the files)",
                            path.display()
                        ))
                    })?,
                };
                files.push(corpus_file(path, format)?);
            }
        }
        Ok(Self {
            files: files.into(),
            field: None,
            sample_by: SampleBy::default(),
            range: None,
        })
    }

    /// Reads each document from the JSON field or Parquet column `name` instead of the default
    /// (`text`; for JSON Lines, `messages` in records without `text`).
    pub fn field(mut self, name: impl Into<String>) -> Self {
        self.field = Some(name.into().into());
        self
    }

    /// How plain-text files are cut into documents (by line unless told otherwise).
    pub fn sample_by(mut self, sample_by: SampleBy) -> Self {
        self.sample_by = sample_by;
        self
    }

    /// The files in stream order, with their formats.
    pub fn files(&self) -> impl Iterator<Item = (&Path, Format)> {
        self.files.iter().map(|f| (f.path.as_path(), f.format))
    }

    /// Only the documents at `range` of this corpus' document stream (indices from 0 in the
    /// order [`Corpus::documents`] yields them; a range past the end keeps what there is).
    pub fn select(&self, range: Range<usize>) -> Corpus {
        let (base, limit) = match &self.range {
            Some(r) => (r.start, r.end),
            None => (0, usize::MAX),
        };
        let start = base.saturating_add(range.start).min(limit);
        let end = base.saturating_add(range.end).min(limit).max(start);
        Corpus {
            range: Some(start..end),
            ..self.clone()
        }
    }

    /// The documents, in order, read lazily file by file. The first error (a file that cannot
    /// be read, a bad record) ends the stream.
    pub fn documents(&self) -> impl Iterator<Item = Result<Document>> + Send + '_ {
        let field = self.field.as_deref();
        let sample_by = self.sample_by;
        let all = self
            .files
            .iter()
            .flat_map(move |file| file_documents(file, field, sample_by))
            .filter(|doc| !matches!(doc, Ok(d) if is_blank(&d.content)));
        Selected {
            inner: all,
            next_index: 0,
            range: self.range.clone().unwrap_or(0..usize::MAX),
            done: false,
        }
    }

    /// Number of documents, by reading the whole corpus once.
    pub fn count_documents(&self) -> Result<usize> {
        let mut n = 0;
        for doc in self.documents() {
            doc?;
            n += 1;
        }
        Ok(n)
    }
}

/// Whether a document holds nothing to train on.
fn is_blank(content: &Content) -> bool {
    match content {
        Content::Text(text) => text.trim().is_empty(),
        Content::Messages(messages) => messages.as_array().is_some_and(Vec::is_empty),
    }
}

fn corpus_file(path: PathBuf, format: Format) -> Result<CorpusFile> {
    let jsonl = match format {
        Format::Jsonl => Some(jsonl_source::open(path.clone())?),
        _ => None,
    };
    Ok(CorpusFile {
        path: Arc::new(path),
        format,
        jsonl,
    })
}

/// The files of `dir` with a known extension (of `format` when given), sorted by name. Markdown
/// files count only when named one by one: in a directory they are a dataset card (README.md),
/// not text to train on. Subdirectories (a Hugging Face dataset's `data/`) are refused by name,
/// so that no data is silently left out.
fn directory_files(dir: &Path, format: Option<Format>) -> Result<Vec<(PathBuf, Format)>> {
    let read_error = |e: std::io::Error| {
        Error::Text(format!(
            "cannot list the corpus directory {}: {e}",
            dir.display()
        ))
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(read_error)? {
        let path = entry.map_err(read_error)?.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.'));
        if hidden {
            continue;
        }
        if path.is_dir() {
            return Err(Error::Text(format!(
                "the corpus directory {} holds the directory {}, which is not read; pass the \
                 files or directories of the data themselves",
                dir.display(),
                path.display()
            )));
        }
        let markdown = path.extension().and_then(|e| e.to_str()) == Some("md");
        if markdown || !path.is_file() {
            continue;
        }
        match Format::from_path(&path) {
            Some(f) if format.is_none_or(|wanted| wanted == f) => files.push((path, f)),
            _ => {}
        }
    }
    files.sort_by(|a, b| a.0.cmp(&b.0));
    let mut formats: Vec<Format> = files.iter().map(|(_, f)| *f).collect();
    formats.sort_by_key(|f| f.name());
    formats.dedup();
    match formats.len() {
        0 => Err(Error::Text(format!(
            "the corpus directory {} holds no {}file; the accepted extensions are \
             {ACCEPTED_EXTENSIONS}",
            dir.display(),
            format.map(|f| format!("{f} ")).unwrap_or_default()
        ))),
        1 => Ok(files),
        _ => Err(Error::Text(format!(
            "the corpus directory {} holds files of several formats ({}); name the format to \
             read (--format jsonl|parquet|text), or pass the files themselves",
            dir.display(),
            formats
                .iter()
                .map(|f| f.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

fn file_documents<'a>(
    file: &'a CorpusFile,
    field: Option<&'a str>,
    sample_by: SampleBy,
) -> Box<dyn Iterator<Item = Result<Document>> + Send + 'a> {
    match (file.format, &file.jsonl) {
        (Format::Jsonl, Some(jsonl)) => jsonl_source::documents(jsonl, field),
        (Format::Parquet, _) => {
            match ParquetDocuments::open(Arc::clone(&file.path), field.unwrap_or("text")) {
                Ok(docs) => Box::new(docs),
                Err(e) => Box::new(std::iter::once(Err(e))),
            }
        }
        (Format::Text, _) => match TextDocuments::open(Arc::clone(&file.path), sample_by) {
            Ok(docs) => Box::new(docs),
            Err(e) => Box::new(std::iter::once(Err(e))),
        },
        (Format::Jsonl, None) => Box::new(std::iter::once(Err(Error::Text(format!(
            "{}: the JSON Lines reader was not opened",
            file.path.display()
        ))))),
    }
}

/// The documents of a stream at indices `range`, and its first error (which ends it; an error is
/// passed on even while documents before the range are skipped).
struct Selected<I> {
    inner: I,
    next_index: usize,
    range: Range<usize>,
    done: bool,
}

impl<I: Iterator<Item = Result<Document>>> Iterator for Selected<I> {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Result<Document>> {
        while !self.done && self.next_index < self.range.end {
            match self.inner.next() {
                Some(Ok(doc)) => {
                    self.next_index += 1;
                    if self.next_index > self.range.start {
                        return Some(Ok(doc));
                    }
                }
                Some(Err(e)) => {
                    self.done = true;
                    return Some(Err(e));
                }
                None => self.done = true,
            }
        }
        None
    }
}

impl fmt::Debug for Corpus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Corpus")
            .field("files", &self.files().collect::<Vec<_>>())
            .field("field", &self.field)
            .field("sample_by", &self.sample_by)
            .field("range", &self.range)
            .finish()
    }
}

/// Where a document was read, for messages: `file:line`, or `file row N` for Parquet.
pub(crate) fn location(doc: &Document) -> String {
    match Format::from_path(&doc.source) {
        Some(Format::Parquet) => format!("{} row {}", doc.source.display(), doc.position),
        _ => format!("{}:{}", doc.source.display(), doc.position),
    }
}
