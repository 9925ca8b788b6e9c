//! The documents of a Parquet file: one string column read through the `parquet` crate's row API
//! (no Arrow), row group by row group, so only one row group's pages of that column are in memory.

use std::fs::File;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parquet::basic::{ConvertedType, LogicalType, Repetition, Type as PhysicalType};
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::Field;
use parquet::schema::types::Type;

use crate::document::{Content, Document};
use crate::error::{Error, Result};

/// The rows of one string column of a Parquet file, as documents; null rows are skipped.
pub(crate) struct ParquetDocuments {
    path: Arc<PathBuf>,
    rows: RowIter<'static>,
    /// The next row's index in the file, from 0.
    row: usize,
    failed: bool,
}

impl ParquetDocuments {
    /// Opens `path` and checks that `column` is a top-level string column.
    pub fn open(path: Arc<PathBuf>, column: &str) -> Result<Self> {
        let file = File::open(path.as_path()).map_err(|e| {
            Error::Text(format!(
                "cannot open the Parquet file {}: {e}; check the path",
                path.display()
            ))
        })?;
        let reader = SerializedFileReader::new(file).map_err(|e| {
            Error::Text(format!(
                "{}: not a readable Parquet file ({e}); check that it was written completely",
                path.display()
            ))
        })?;
        let schema = reader.metadata().file_metadata().schema();
        let projection = string_column(&path, schema, column)?;
        let rows = RowIter::from_file_into(Box::new(reader))
            .project(Some(projection))
            .map_err(|e| corrupt(&path, &e.to_string()))?;
        Ok(Self {
            path,
            rows,
            row: 0,
            failed: false,
        })
    }
}

/// The file's schema reduced to `column`, after checking that it is a string column.
fn string_column(path: &Path, schema: &Type, column: &str) -> Result<Type> {
    let fields = schema.get_fields();
    let Some(field) = fields.iter().find(|f| f.name() == column) else {
        let names: Vec<String> = fields.iter().map(|f| format!("`{}`", f.name())).collect();
        return Err(Error::Text(format!(
            "{}: no column `{column}` (its columns: {}); name the column that holds the text",
            path.display(),
            names.join(", ")
        )));
    };
    let refuse = |what: String| {
        Error::Text(format!(
            "{}: column `{column}` is {what}, not a string column; a Parquet corpus reads its \
             documents from a column of strings (name another column, or convert this one)",
            path.display()
        ))
    };
    if !field.is_primitive() {
        return Err(refuse(
            "a nested column (a list, map or struct; a conversation in Parquet is not read, \
             write it as JSON Lines with a `messages` field)"
                .into(),
        ));
    }
    let info = field.get_basic_info();
    if info.has_repetition() && info.repetition() == Repetition::REPEATED {
        return Err(refuse("a repeated column".into()));
    }
    let physical = field.get_physical_type();
    let string = physical == PhysicalType::BYTE_ARRAY
        && (matches!(info.logical_type_ref(), Some(LogicalType::String))
            || info.converted_type() == ConvertedType::UTF8);
    if !string {
        let what = match (physical, info.logical_type_ref()) {
            (PhysicalType::BYTE_ARRAY, None) => {
                "a binary column (bytes without a string type)".into()
            }
            (p, Some(l)) => format!("of type {p} ({l:?})"),
            (p, None) => format!("of type {p}"),
        };
        return Err(refuse(what));
    }
    Type::group_type_builder(schema.name())
        .with_fields(vec![Arc::clone(field)])
        .build()
        .map_err(|e| corrupt(path, &e.to_string()))
}

fn corrupt(path: &Path, problem: &str) -> Error {
    Error::Text(format!(
        "{}: the Parquet file cannot be read ({problem}); check that it was written completely",
        path.display()
    ))
}

impl Iterator for ParquetDocuments {
    type Item = Result<Document>;

    fn next(&mut self) -> Option<Result<Document>> {
        while !self.failed {
            // The parquet crate may panic on a damaged file instead of returning an error; a bad
            // file is the user's input, so it becomes an error naming the file.
            let next =
                catch_unwind(AssertUnwindSafe(|| self.rows.next())).unwrap_or_else(|_| {
                    Some(Err(parquet::errors::ParquetError::General(
                        "the reader failed on damaged data".into(),
                    )))
                })?;
            let row = self.row;
            self.row += 1;
            let value = match next {
                Ok(r) => r.into_columns().into_iter().next().map(|(_, v)| v),
                Err(e) => {
                    self.failed = true;
                    return Some(Err(corrupt(&self.path, &format!("row {row}: {e}"))));
                }
            };
            match value {
                Some(Field::Str(text)) => {
                    return Some(Ok(Document {
                        source: Arc::clone(&self.path),
                        position: row,
                        content: Content::Text(text),
                    }))
                }
                // A null row holds no document.
                Some(Field::Null) | None => continue,
                Some(other) => {
                    self.failed = true;
                    return Some(Err(corrupt(
                        &self.path,
                        &format!("row {row} holds {other:?} in a string column"),
                    )));
                }
            }
        }
        None
    }
}
