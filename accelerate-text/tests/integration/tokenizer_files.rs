//! Reading and writing tokenizer directories: the errors for what cannot be read, and
//! `save_to` writing the files back byte for byte.

use std::collections::BTreeMap;
use std::path::Path;

use accelerate_text::{Content, Tokenizer};

use crate::tokenizer_conformance::copy;
use crate::{expected, tokenizer_dir};

/// The error message of reading `dir`, which must fail.
fn from_dir_error(dir: &Path) -> String {
    Tokenizer::from_dir(dir).unwrap_err().to_string()
}

/// A directory holding the fixture's tokenizer.json and `config` as tokenizer_config.json.
fn dir_with_config(config: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    copy(&tokenizer_dir(), dir.path(), "tokenizer.json");
    std::fs::write(dir.path().join("tokenizer_config.json"), config).unwrap();
    dir
}

#[test]
fn a_missing_directory_or_file_is_named_with_the_fix() {
    let root = tempfile::tempdir().unwrap();
    let missing = root.path().join("no-such-model");
    let err = from_dir_error(&missing);
    assert!(
        err.contains("no-such-model") && err.contains("does not exist"),
        "{err}"
    );
    assert!(err.contains("tokenizer.json"), "{err}");

    let err = Tokenizer::from_file(&missing.join("tokenizer.json"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("does not exist"), "{err}");

    // An empty directory: no tokenizer.json, and what a model directory holds.
    let err = from_dir_error(root.path());
    assert!(
        err.contains("no tokenizer.json") && err.contains("save_pretrained"),
        "{err}"
    );

    // A sentencepiece-only directory: convert it with transformers.
    std::fs::write(root.path().join("tokenizer.model"), b"not read").unwrap();
    let err = from_dir_error(root.path());
    assert!(
        err.contains("tokenizer.model") && err.contains("sentencepiece"),
        "{err}"
    );
    assert!(
        err.contains("AutoTokenizer.from_pretrained") && err.contains("save_pretrained"),
        "{err}"
    );

    // A file where a directory is expected, and the reverse.
    let file = root.path().join("tokenizer.model");
    assert!(from_dir_error(&file).contains("is a file"));
    let err = Tokenizer::from_file(root.path()).unwrap_err().to_string();
    assert!(
        err.contains("is a directory") && err.contains("from_dir"),
        "{err}"
    );

    // A tokenizer.json that is not one.
    std::fs::write(root.path().join("tokenizer.json"), b"{\"model\": 3}").unwrap();
    let err = from_dir_error(root.path());
    assert!(
        err.contains("tokenizer.json") && err.contains("cannot read"),
        "{err}"
    );
}

#[test]
fn a_special_token_missing_from_the_vocabulary_is_named() {
    let dir = dir_with_config(r#"{"bos_token": "<s>", "eos_token": "<|endoftext|>"}"#);
    let err = from_dir_error(dir.path());
    assert!(err.contains("tokenizer_config.json"), "{err}");
    assert!(
        err.contains("eos_token") && err.contains("<|endoftext|>"),
        "{err}"
    );
    assert!(err.contains("vocabulary"), "{err}");

    // In an AddedToken object, in special_tokens_map.json.
    let dir = dir_with_config("{}");
    let map = r#"{"pad_token": {"content": "[PAD]", "lstrip": false}}"#;
    std::fs::write(dir.path().join("special_tokens_map.json"), map).unwrap();
    let err = from_dir_error(dir.path());
    assert!(
        err.contains("special_tokens_map.json") && err.contains("[PAD]"),
        "{err}"
    );
    assert!(err.contains("pad_token"), "{err}");
}

#[test]
fn malformed_config_files_are_named() {
    let err = from_dir_error(dir_with_config(r#"{"bos_token": 7}"#).path());
    assert!(
        err.contains("tokenizer_config.json") && err.contains("bos_token"),
        "{err}"
    );
    assert!(err.contains("\"content\""), "{err}");

    let err = from_dir_error(dir_with_config("{not json").path());
    assert!(
        err.contains("tokenizer_config.json") && err.contains("not valid JSON"),
        "{err}"
    );

    let err = from_dir_error(dir_with_config("[1, 2]").path());
    assert!(
        err.contains("tokenizer_config.json") && err.contains("JSON object"),
        "{err}"
    );
}

/// Plain text works without a chat template; a conversation needs one and says where it goes.
#[test]
fn messages_without_a_chat_template_say_where_it_goes() {
    let dir = dir_with_config(r#"{"bos_token": "<s>", "eos_token": "</s>"}"#);
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(
        tokenizer.encode("Hello, world!", true).unwrap(),
        crate::ids(&expected()["texts"][0]["ids"])
    );
    let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
    let err = tokenizer
        .encode_document(&Content::Messages(messages.clone()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no chat template") && err.contains("chat_template.jinja"),
        "{err}"
    );
    assert!(err.contains(&dir.path().display().to_string()), "{err}");

    // A template that does not compile is reported when a conversation needs it.
    std::fs::write(
        dir.path().join("chat_template.jinja"),
        "{% for m in messages %}",
    )
    .unwrap();
    let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
    assert!(!tokenizer.encode("x", true).unwrap().is_empty());
    let err = tokenizer.render_chat(&messages).unwrap_err().to_string();
    assert!(
        err.contains("chat_template.jinja") && err.contains("compile"),
        "{err}"
    );

    // A role the template refuses: its raise_exception message comes through.
    let err = Tokenizer::from_dir(&tokenizer_dir())
        .unwrap()
        .render_chat(&serde_json::json!([{"role": "tool", "content": "x"}]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("Unknown role: tool"), "{err}");
}

/// The files of a directory, by name.
fn files_of(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|entry| {
            let entry = entry.unwrap();
            (
                entry.file_name().to_string_lossy().into_owned(),
                std::fs::read(entry.path()).unwrap(),
            )
        })
        .collect()
}

#[test]
fn save_to_writes_the_files_back_byte_for_byte() {
    let expected = expected();
    for source in [tokenizer_dir(), crate::fixtures().join("tokenizer_legacy")] {
        let tokenizer = Tokenizer::from_dir(&source).unwrap();
        let root = tempfile::tempdir().unwrap();
        let target = root.path().join("checkpoint/tokenizer");
        tokenizer.save_to(&target).unwrap();
        // Exactly the source's files (no temporary files left), identical.
        assert_eq!(files_of(&target), files_of(&source), "{}", source.display());
        // Saving again over them leaves them as they are.
        tokenizer.save_to(&target).unwrap();
        assert_eq!(files_of(&target), files_of(&source));

        let reread = Tokenizer::from_dir(&target).unwrap();
        let chat = &expected["chats"][1];
        assert_eq!(
            reread.render_chat(&chat["messages"]).unwrap(),
            chat["rendered"].as_str().unwrap()
        );
        assert_eq!(reread.eos_id(), tokenizer.eos_id());
    }

    // A lone tokenizer.json is saved as the directory's tokenizer.json.
    let file = tokenizer_dir().join("tokenizer.json");
    let root = tempfile::tempdir().unwrap();
    Tokenizer::from_file(&file)
        .unwrap()
        .save_to(root.path())
        .unwrap();
    let saved = files_of(root.path());
    assert_eq!(saved.keys().collect::<Vec<_>>(), ["tokenizer.json"]);
    assert_eq!(saved["tokenizer.json"], std::fs::read(&file).unwrap());
}
