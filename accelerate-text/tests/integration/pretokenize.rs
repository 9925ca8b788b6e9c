//! Tokenizing ahead of time: a multi-megabyte corpus streamed through the pipeline into a token
//! file whose documents are the byte tokenizer's ids, computed here independently.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use accelerate_text::{
    pretokenize, Content, Corpus, Error, PretokenizeOptions, TokenDtype, TokenFile, TokenizeFn,
    PROGRESS_EVERY,
};

use crate::common::{byte_ids, byte_tokenizer, write_jsonl, EOS};

#[test]
fn a_multi_megabyte_corpus_streams_into_a_token_file_in_order() {
    let dir = tempfile::tempdir().unwrap();
    // Three shards, about 4.5 MB of text.
    let mut texts = Vec::new();
    let mut shards = Vec::new();
    for s in 0..3 {
        let path = dir.path().join(format!("shard-{s}.jsonl"));
        texts.extend(write_jsonl(&path, 10_000, s));
        shards.push(path);
    }
    let corpus = Corpus::new(&shards).unwrap();
    let out = dir.path().join("corpus.tokens");
    let reports = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&reports);
    let options = PretokenizeOptions::new(TokenDtype::U16, "bytes+3")
        .on_progress(move |s| seen.lock().unwrap().push(s.documents));
    let summary = pretokenize(&corpus, byte_tokenizer(), 4, &out, options).unwrap();

    let expected_tokens: u64 = texts.iter().map(|t| t.len() as u64 + 1).sum();
    assert!(expected_tokens > 4_000_000, "{expected_tokens}");
    assert_eq!(
        (summary.documents, summary.tokens),
        (30_000, expected_tokens)
    );
    assert_eq!(summary.bytes, std::fs::metadata(&out).unwrap().len());
    assert_eq!(summary.dtype, TokenDtype::U16);
    let every: Vec<u64> = (1..=30).map(|k| k * PROGRESS_EVERY).collect();
    assert_eq!(*reports.lock().unwrap(), every);

    let file = TokenFile::open(&out).unwrap();
    file.verify().unwrap();
    assert_eq!(file.tokenizer(), "bytes+3");
    assert_eq!(file.documents(), texts.len());
    for (i, text) in texts.iter().enumerate() {
        let mut want: Vec<u32> = text.bytes().map(|b| u32::from(b) + 3).collect();
        want.push(EOS);
        assert_eq!(file.document(i).unwrap(), want, "document {i}");
    }
}

#[test]
fn a_tokenizer_error_names_the_document_and_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.jsonl");
    let texts = write_jsonl(&path, 3000, 9);
    let corpus = Corpus::new([&path]).unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&calls);
    let bad = texts[2000].clone();
    let tokenize: TokenizeFn = Arc::new(move |c: &Content| {
        counted.fetch_add(1, Ordering::Relaxed);
        match c {
            Content::Text(t) if *t == bad => Err(Error::Text("no such token".into())),
            _ => Ok(byte_ids(c)),
        }
    });
    let out = dir.path().join("c.tokens");
    let e = pretokenize(
        &corpus,
        tokenize,
        3,
        &out,
        PretokenizeOptions::new(TokenDtype::U16, "t"),
    )
    .unwrap_err()
    .to_string();
    // The first line holding that text (lines are numbered from 1).
    let line = texts.iter().position(|t| *t == texts[2000]).unwrap() + 1;
    assert!(
        e.contains(&format!(
            "c.jsonl:{line}: cannot tokenize the document: no such token"
        )),
        "{e}"
    );
    assert!(!out.exists());
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "no temporary file left"
    );
    // The pipeline stopped early, within its bounded window of documents past the error.
    assert!(
        calls.load(Ordering::Relaxed) < 2100,
        "{}",
        calls.load(Ordering::Relaxed)
    );
    let e = pretokenize(
        &corpus,
        byte_tokenizer(),
        0,
        &out,
        PretokenizeOptions::new(TokenDtype::U16, "t"),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("0 workers"), "{e}");
}
