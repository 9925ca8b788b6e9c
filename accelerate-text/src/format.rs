//! [`Format`] and [`SampleBy`]: how the files of a corpus are read.

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The file formats a corpus reads, as `datasets`' `json`, `parquet` and `text` builders.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Format {
    /// JSON Lines: one JSON object per line (`.jsonl`, `.json`).
    Jsonl,
    /// Apache Parquet, a string column (`.parquet`).
    Parquet,
    /// Plain UTF-8 text (`.txt`, `.text`, `.md`), cut into documents by [`SampleBy`].
    Text,
}

/// The extensions a format is inferred from, for messages.
pub(crate) const ACCEPTED_EXTENSIONS: &str =
    ".jsonl or .json (JSON Lines), .parquet (Parquet), .txt, .text or .md (plain text)";

impl Format {
    /// Every format.
    pub const ALL: [Format; 3] = [Format::Jsonl, Format::Parquet, Format::Text];

    /// The format a file's extension names (case-insensitive), if it names one.
    pub fn from_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "jsonl" | "json" => Some(Format::Jsonl),
            "parquet" => Some(Format::Parquet),
            "txt" | "text" | "md" => Some(Format::Text),
            _ => None,
        }
    }

    /// The format's name, as [`FromStr`] reads it (`json`, `parquet`, `text`: the names of
    /// `datasets`' builders).
    pub fn name(self) -> &'static str {
        match self {
            Format::Jsonl => "json",
            Format::Parquet => "parquet",
            Format::Text => "text",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Format {
    type Err = Error;

    /// `json` or `jsonl`, `parquet`, `text` or `txt` (case-insensitive).
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "json" | "jsonl" => Ok(Format::Jsonl),
            "parquet" => Ok(Format::Parquet),
            "text" | "txt" => Ok(Format::Text),
            _ => Err(Error::Text(format!(
                "unknown corpus format {s:?}; the formats are json (JSON Lines), parquet and text"
            ))),
        }
    }
}

/// How a plain-text file is cut into documents (`datasets`' `sample_by`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SampleBy {
    /// One document per line (the default, as `datasets`' text builder): the line without its
    /// `\n` or `\r\n` ending. A lone `\r` is not a line break.
    #[default]
    Line,
    /// One document per paragraph: a run of lines that are not blank (white space only),
    /// joined with `\n`; its position is its first line. Unlike `datasets`, which splits on
    /// `"\n\n"` only, a line of spaces also separates paragraphs and no paragraph starts with a
    /// newline.
    Paragraph,
    /// The whole file as one document, `\r\n` read as `\n` (as Python reads text files).
    Document,
}

impl FromStr for SampleBy {
    type Err = Error;

    /// `line`, `paragraph` or `document`.
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "line" => Ok(SampleBy::Line),
            "paragraph" => Ok(SampleBy::Paragraph),
            "document" => Ok(SampleBy::Document),
            _ => Err(Error::Text(format!(
                "unknown sample_by {s:?}; a text file is read by line, paragraph or document"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_from_extensions_and_names() {
        let f = |p: &str| Format::from_path(Path::new(p));
        assert_eq!(f("a/b.JSONL"), Some(Format::Jsonl));
        assert_eq!(f("b.json"), Some(Format::Jsonl));
        assert_eq!(f("x.parquet"), Some(Format::Parquet));
        assert_eq!(f("notes.md"), Some(Format::Text));
        assert_eq!(f("t.text"), Some(Format::Text));
        assert_eq!(f("t.csv"), None);
        assert_eq!(f("t.jsonl.gz"), None);
        assert_eq!(f("README"), None);
        for format in Format::ALL {
            assert_eq!(format.name().parse::<Format>().unwrap(), format);
        }
        let e = "csv".parse::<Format>().unwrap_err().to_string();
        assert!(e.contains("json (JSON Lines), parquet and text"), "{e}");
        assert_eq!(
            "Paragraph".parse::<SampleBy>().unwrap(),
            SampleBy::Paragraph
        );
        assert!("word".parse::<SampleBy>().is_err());
    }
}
