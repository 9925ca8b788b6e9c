//! The documents of a JSON Lines file: its lines as accelerate-core's [`JsonlShards`] reads and
//! parses them, each record's text field (or its list of messages) made a [`Document`].

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_core::data::{IterableDataset, JsonlShards};
use serde_json::Value;

use crate::batch::TextBatch;
use crate::document::{Content, Document};
use crate::error::{Error, Result};

/// One JSON Lines file read by accelerate-core's shard reader: its lines (blank ones skipped,
/// numbered from 1) and their JSON parsing, with errors naming the file and line. The items are
/// the parsed records; its batches are never built (only `records` and `transform` are used).
pub(crate) type JsonlFile = JsonlShards<Value, TextBatch>;

/// The shard reader of `path` (refused if it is not a readable file).
pub(crate) fn open(path: PathBuf) -> Result<JsonlFile> {
    Ok(JsonlShards::new(
        [path],
        Ok,
        |_: Vec<Value>| -> accelerate_core::Result<TextBatch> {
            Err(accelerate_core::Error::Data(
                "a corpus file's records are read as documents, not collated".into(),
            ))
        },
    )?)
}

/// The documents of `file`, in order. `field` is the record field holding the document; `None`
/// is `text`, or `messages` in a record without `text`. A record whose field is `null` holds no
/// document and is skipped.
pub(crate) fn documents<'a>(
    file: &'a JsonlFile,
    field: Option<&'a str>,
) -> Box<dyn Iterator<Item = Result<Document>> + Send + 'a> {
    let records = match file.records(0) {
        Ok(records) => records,
        Err(e) => return Box::new(std::iter::once(Err(e.into()))),
    };
    Box::new(records.filter_map(move |record| {
        let record = match record {
            Ok(r) => r,
            Err(e) => return Some(Err(e.into())),
        };
        let (path, line) = (Arc::clone(&record.path), record.line);
        let value = match file.transform(record) {
            Ok(v) => v,
            Err(e) => return Some(Err(e.into())),
        };
        match content(value, field, &path, line) {
            Ok(Some(content)) => Some(Ok(Document {
                source: path,
                position: line,
                content,
            })),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }))
}

/// The document of one record, `None` when its field is `null`.
fn content(
    value: Value,
    field: Option<&str>,
    path: &Arc<PathBuf>,
    line: usize,
) -> Result<Option<Content>> {
    let at = || format!("{}:{line}", path.display());
    let Value::Object(mut record) = value else {
        return Err(Error::Text(format!(
            "{}: the record is {}, not an object; each line of a JSON Lines corpus holds an \
             object with the document in a field (by default `text`)",
            at(),
            kind(&value)
        )));
    };
    let name = match field {
        Some(name) => name,
        None if record.contains_key("text") => "text",
        None if record.contains_key("messages") => "messages",
        None => "text",
    };
    let Some(value) = record.remove(name) else {
        let mut fields: Vec<&String> = record.keys().collect();
        fields.sort();
        let fields = fields
            .iter()
            .map(|f| format!("`{f}`"))
            .collect::<Vec<_>>()
            .join(", ");
        let wanted = match field {
            Some(name) => format!("no field `{name}`"),
            None => "neither a `text` nor a `messages` field".into(),
        };
        return Err(Error::Text(format!(
            "{}: the record has {wanted} (its fields: {}); name the field that holds the \
             document",
            at(),
            if fields.is_empty() {
                "none".into()
            } else {
                fields
            }
        )));
    };
    match value {
        Value::String(text) => Ok(Some(Content::Text(text))),
        Value::Array(_) => Ok(Some(Content::Messages(value))),
        Value::Null => Ok(None),
        other => Err(Error::Text(format!(
            "{}: field `{name}` holds {}; it must hold a string (text) or a list of messages \
             (a conversation for the chat template)",
            at(),
            kind(&other)
        ))),
    }
}

fn kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}
