//! The `accelerate-tokenize` command, run as a user runs it, against ids from Python's
//! transformers (expected.json).

use std::collections::HashMap;
use std::process::Command;

use accelerate_text::TokenFile;

use crate::{expected, fixtures, ids, tokenizer_dir};

fn tokenize_command() -> Command {
    Command::new(env!("CARGO_BIN_EXE_accelerate-tokenize"))
}

#[test]
fn the_token_file_holds_transformers_ids_plus_eos_for_every_non_empty_document_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("corpus.tokens");
    let corpus = fixtures().join("corpus.jsonl");
    let run = tokenize_command()
        .args([
            "--tokenizer",
            tokenizer_dir().to_str().unwrap(),
            "--workers",
            "3",
        ])
        .arg("--output")
        .arg(&out)
        .arg(&corpus)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        stdout.contains("documents=") && stdout.contains("tokens_per_s="),
        "{stdout}"
    );

    let expected = expected();
    let eos = expected["special"]["eos_id"].as_u64().unwrap() as u32;
    let by_text: HashMap<&str, Vec<u32>> = expected["texts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["text"].as_str().unwrap(), ids(&t["ids"])))
        .collect();
    // The documents of corpus.jsonl in file order, blank ones skipped (the corpus' rule).
    let texts: Vec<String> = std::fs::read_to_string(&corpus)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .filter(|t| !t.trim().is_empty())
        .collect();
    let file = TokenFile::open(&out).unwrap();
    assert_eq!(file.documents(), texts.len());
    for (i, text) in texts.iter().enumerate() {
        let mut want = by_text[text.as_str()].clone();
        if want.last() != Some(&eos) {
            want.push(eos);
        }
        assert_eq!(file.document(i).unwrap(), want, "document {i}: {text:?}");
    }
}

#[test]
fn a_missing_tokenizer_and_zero_workers_are_refused_by_name_and_write_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.tokens");
    let corpus = fixtures().join("corpus.txt");
    for (args, says) in [
        (vec!["--tokenizer", "/nonexistent/model"], "tokenizer.json"),
        (
            vec![
                "--tokenizer",
                tokenizer_dir().to_str().unwrap(),
                "--workers",
                "0",
            ],
            "--workers",
        ),
    ] {
        let run = tokenize_command()
            .args(&args)
            .arg("-o")
            .arg(&out)
            .arg(&corpus)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&run.stderr);
        assert!(
            !run.status.success() && stderr.contains(says),
            "{args:?}: {stderr}"
        );
        assert!(!out.exists());
    }
}
