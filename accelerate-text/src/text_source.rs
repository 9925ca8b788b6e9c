//! The documents of a plain-text file: its lines, paragraphs, or the whole file ([`SampleBy`]),
//! read lazily (a line or a paragraph at a time).

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::sync::Arc;

use crate::document::{Content, Document};
use crate::error::{Error, Result};
use crate::format::SampleBy;

/// The documents of one text file.
pub(crate) struct TextDocuments {
    path: Arc<PathBuf>,
    reader: Option<BufReader<File>>,
    sample_by: SampleBy,
    /// Lines read so far.
    line: usize,
}

impl TextDocuments {
    /// Opens `path`.
    pub fn open(path: Arc<PathBuf>, sample_by: SampleBy) -> Result<Self> {
        let file = File::open(path.as_path()).map_err(|e| {
            Error::Text(format!(
                "cannot open the text file {}: {e}; check the path",
                path.display()
            ))
        })?;
        Ok(Self {
            path,
            reader: Some(BufReader::new(file)),
            sample_by,
            line: 0,
        })
    }

    /// The next line without its ending, `None` at the end of the file.
    fn next_line(&mut self) -> Result<Option<String>> {
        let Some(reader) = self.reader.as_mut() else {
            return Ok(None);
        };
        let mut bytes = Vec::new();
        let read = reader.read_until(b'\n', &mut bytes);
        let number = self.line + 1;
        match read {
            Ok(0) => {
                self.reader = None;
                Ok(None)
            }
            Ok(_) => {
                self.line = number;
                if bytes.last() == Some(&b'\n') {
                    bytes.pop();
                    if bytes.last() == Some(&b'\r') {
                        bytes.pop();
                    }
                }
                String::from_utf8(bytes).map(Some).map_err(|e| {
                    self.reader = None;
                    Error::Text(format!(
                        "{}:{number}: not UTF-8 text ({e}); convert the file to UTF-8",
                        self.path.display()
                    ))
                })
            }
            Err(e) => {
                self.reader = None;
                Err(Error::Text(format!(
                    "{}:{number}: cannot read the line: {e}",
                    self.path.display()
                )))
            }
        }
    }

    fn document(&self, position: usize, text: String) -> Document {
        Document {
            source: Arc::clone(&self.path),
            position,
            content: Content::Text(text),
        }
    }

    fn next_paragraph(&mut self) -> Result<Option<Document>> {
        let mut lines: Vec<String> = Vec::new();
        let mut first = 0;
        while let Some(line) = self.next_line()? {
            if line.trim().is_empty() {
                if !lines.is_empty() {
                    break;
                }
            } else {
                if lines.is_empty() {
                    first = self.line;
                }
                lines.push(line);
            }
        }
        Ok((!lines.is_empty()).then(|| self.document(first, lines.join("\n"))))
    }

    fn whole_file(&mut self) -> Result<Option<Document>> {
        let Some(mut reader) = self.reader.take() else {
            return Ok(None);
        };
        let mut bytes = Vec::new();
        reader.read_to_end(&mut bytes).map_err(|e| {
            Error::Text(format!(
                "cannot read the text file {}: {e}",
                self.path.display()
            ))
        })?;
        let text = String::from_utf8(bytes).map_err(|e| {
            Error::Text(format!(
                "{}: not UTF-8 text ({e}); convert the file to UTF-8",
                self.path.display()
            ))
        })?;
        Ok(Some(self.document(1, text.replace("\r\n", "\n"))))
    }
}

impl Iterator for TextDocuments {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Result<Document>> {
        let next = match self.sample_by {
            SampleBy::Line => self
                .next_line()
                .map(|line| line.map(|text| self.document(self.line, text))),
            SampleBy::Paragraph => self.next_paragraph(),
            SampleBy::Document => self.whole_file(),
        };
        next.transpose()
    }
}
