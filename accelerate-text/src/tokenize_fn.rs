//! [`TokenizeFn`]: how corpus code turns a document into token ids without depending on the
//! tokenizer's type.

use std::sync::Arc;

use crate::document::Content;
use crate::error::Result;

/// Turns a document's content into token ids, as `Tokenizer::encode_document` does (special
/// tokens added, EOS last). Shared by the threads that tokenize, hence `Send + Sync` behind an
/// `Arc`; it must give the same ids whichever thread calls it.
pub type TokenizeFn = Arc<dyn Fn(&Content) -> Result<Vec<u32>> + Send + Sync>;
