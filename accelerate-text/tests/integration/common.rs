//! What the test modules share: the fixtures, a byte tokenizer, and the naive packing.

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_text::{Content, Corpus, Document, TokenRow, TokenizeFn};
use serde_json::Value;

/// The end-of-document id of [`byte_tokenizer`].
pub const EOS: u32 = 2;

/// A fixture of tests/fixtures/corpus (written by tests/python/make_corpus_fixtures.py).
pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/corpus")
        .join(name)
}

/// The fixtures' sidecar: what each file holds, computed in Python.
pub fn expected() -> Value {
    let text = std::fs::read_to_string(fixture("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The ids a document becomes, computed here without the code under test: each UTF-8 byte of
/// the text (of a conversation: of its JSON) plus 3, then EOS.
pub fn byte_ids(content: &Content) -> Vec<u32> {
    let text = match content {
        Content::Text(t) => t.clone(),
        Content::Messages(m) => m.to_string(),
    };
    let mut ids: Vec<u32> = text.bytes().map(|b| u32::from(b) + 3).collect();
    ids.push(EOS);
    ids
}

/// [`byte_ids`] as the tokenizer closure.
pub fn byte_tokenizer() -> TokenizeFn {
    Arc::new(|content: &Content| Ok(byte_ids(content)))
}

/// Every document of a corpus, or the first error's message.
pub fn read_all(corpus: &Corpus) -> Result<Vec<Document>, String> {
    corpus
        .documents()
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())
}

/// `(position, text or messages JSON)` of documents, for comparison with the sidecar.
pub fn summary(docs: &[Document]) -> Vec<(usize, Value)> {
    docs.iter()
        .map(|d| {
            let v = match &d.content {
                Content::Text(t) => serde_json::json!({ "text": t }),
                Content::Messages(m) => serde_json::json!({ "messages": m }),
            };
            (d.position, v)
        })
        .collect()
}

/// The sidecar's list of documents in the same form.
pub fn sidecar(list: &Value) -> Vec<(usize, Value)> {
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let position = e["position"].as_u64().unwrap() as usize;
            let v = if let Some(t) = e.get("text") {
                serde_json::json!({ "text": t })
            } else {
                serde_json::json!({ "messages": e["messages"] })
            };
            (position, v)
        })
        .collect()
}

/// The naive packing: concatenate, cut into rows, drop the remainder, number documents within
/// each row by counting changes of document.
pub fn naive_rows(docs: &[Vec<u32>], block_size: usize) -> Vec<TokenRow> {
    let flat: Vec<(u32, usize)> = docs
        .iter()
        .enumerate()
        .flat_map(|(d, ids)| ids.iter().map(move |&t| (t, d)))
        .collect();
    flat.chunks_exact(block_size)
        .map(|chunk| {
            let mut segment_ids = vec![1];
            for w in chunk.windows(2) {
                let last = *segment_ids.last().unwrap();
                segment_ids.push(if w[1].1 == w[0].1 { last } else { last + 1 });
            }
            TokenRow {
                input_ids: chunk.iter().map(|&(t, _)| t).collect(),
                segment_ids,
            }
        })
        .collect()
}

/// Rows `[B, T]` of a batch's tensors.
pub fn batch_rows(batch: &accelerate_text::TextBatch) -> Vec<TokenRow> {
    let ids = batch.input_ids.to_vec2::<u32>().unwrap();
    let segs = batch.segment_ids.to_vec2::<u32>().unwrap();
    ids.into_iter()
        .zip(segs)
        .map(|(input_ids, segment_ids)| TokenRow {
            input_ids,
            segment_ids,
        })
        .collect()
}

/// Writes a JSON Lines corpus of `n` documents of varied lengths and returns their texts.
pub fn write_jsonl(path: &std::path::Path, n: usize, seed: u64) -> Vec<String> {
    use std::io::Write;
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut state = seed;
    let texts: Vec<String> = (0..n)
        .map(|i| {
            // A small LCG: lengths from 1 to 300 characters.
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let len = 1 + (state >> 33) as usize % 300;
            let word = format!("doc{i}-");
            word.chars().cycle().take(len).collect()
        })
        .collect();
    for t in &texts {
        writeln!(f, "{}", serde_json::json!({ "text": t })).unwrap();
    }
    texts
}

/// A corpus of `n` generated documents in `dir/name` ([`write_jsonl`]), and each document's ids
/// under the byte tokenizer, read back through the corpus.
pub fn jsonl_corpus(
    dir: &std::path::Path,
    name: &str,
    n: usize,
    seed: u64,
) -> (Corpus, Vec<Vec<u32>>) {
    let path = dir.join(name);
    write_jsonl(&path, n, seed);
    let corpus = Corpus::new([&path]).unwrap();
    let ids = read_all(&corpus)
        .unwrap()
        .iter()
        .map(|d| byte_ids(&d.content))
        .collect();
    (corpus, ids)
}
