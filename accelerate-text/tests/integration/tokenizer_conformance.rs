//! The tokenizer against transformers: every id, special token and rendered chat that
//! expected.json records, for the directory transformers saved and for an older layout.

use std::path::Path;

use accelerate_text::{Content, Tokenizer};
use serde_json::Value;

use crate::{expected, fixtures, id, ids, tokenizer_dir};

/// Checks a tokenizer against one tokenizer's record in expected.json (special, texts, chats).
fn check_against(tokenizer: &Tokenizer, record: &Value) {
    let special = &record["special"];
    assert_eq!(tokenizer.bos_id(), id(&special["bos_id"]), "bos");
    assert_eq!(tokenizer.eos_id(), id(&special["eos_id"]), "eos");
    assert_eq!(tokenizer.pad_id(), id(&special["pad_id"]), "pad");
    assert_eq!(
        tokenizer.vocab_size() as u64,
        special["vocab_size"].as_u64().unwrap()
    );

    let texts = record["texts"].as_array().unwrap();
    assert!(!texts.is_empty());
    let mut mismatches = Vec::new();
    for entry in texts {
        let text = entry["text"].as_str().unwrap();
        for (add_special, key) in [(true, "ids"), (false, "ids_no_special")] {
            let got = tokenizer.encode(text, add_special).unwrap();
            if got != ids(&entry[key]) {
                mismatches.push(format!(
                    "{text:?} ({key}): got {got:?}, transformers {}",
                    entry[key]
                ));
            }
        }
    }
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );

    let chats = record["chats"].as_array().unwrap();
    assert!(!chats.is_empty());
    for chat in chats {
        let rendered = tokenizer.render_chat(&chat["messages"]).unwrap();
        assert_eq!(
            rendered,
            chat["rendered"].as_str().unwrap(),
            "{}",
            chat["messages"]
        );
        assert_eq!(
            tokenizer.encode(&rendered, false).unwrap(),
            ids(&chat["ids"])
        );
    }
}

#[test]
fn ids_special_tokens_and_chats_match_transformers() {
    let tokenizer = Tokenizer::from_dir(&tokenizer_dir()).unwrap();
    check_against(&tokenizer, &expected());
}

/// Special tokens only in the BPE vocabulary, bos_token as an AddedToken object, the template
/// as a named list in tokenizer_config.json, eos_token overridden by special_tokens_map.json.
#[test]
fn an_older_directory_layout_reads_as_transformers_reads_it() {
    let tokenizer = Tokenizer::from_dir(&fixtures().join("tokenizer_legacy")).unwrap();
    check_against(&tokenizer, &expected()["legacy"]);
}

/// Which of tokenizer_config.json and special_tokens_map.json names the special tokens, and
/// which tokens are then matched whole in text, for each layout transformers was run on.
#[test]
fn special_token_files_resolve_as_in_transformers() {
    let legacy_json = fixtures().join("tokenizer_legacy/tokenizer.json");
    let layouts = expected()["layouts"].as_array().unwrap().clone();
    assert_eq!(layouts.len(), 5);
    for layout in layouts {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(&legacy_json, dir.path().join("tokenizer.json")).unwrap();
        for name in ["tokenizer_config", "special_tokens_map"] {
            if !layout[name].is_null() {
                let path = dir.path().join(format!("{name}.json"));
                std::fs::write(path, layout[name].to_string()).unwrap();
            }
        }
        let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
        let what = format!(
            "{} / {}",
            layout["tokenizer_config"], layout["special_tokens_map"]
        );
        assert_eq!(tokenizer.bos_id(), id(&layout["bos_id"]), "bos: {what}");
        assert_eq!(tokenizer.eos_id(), id(&layout["eos_id"]), "eos: {what}");
        assert_eq!(tokenizer.pad_id(), id(&layout["pad_id"]), "pad: {what}");
        assert_eq!(
            tokenizer.vocab_size() as u64,
            layout["vocab_size"].as_u64().unwrap()
        );
        let probe = layout["probe"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(probe, true).unwrap(),
            ids(&layout["probe_ids"]),
            "{what}"
        );
    }
}

/// A text document is transformers' ids with special tokens, then EOS unless already last.
#[test]
fn encode_document_appends_eos_exactly_once() {
    let tokenizer = Tokenizer::from_dir(&tokenizer_dir()).unwrap();
    let expected = expected();
    let eos = id(&expected["special"]["eos_id"]).unwrap();
    let mut already_ending = 0;
    for entry in expected["texts"].as_array().unwrap() {
        let text = entry["text"].as_str().unwrap();
        let mut want = ids(&entry["ids"]);
        if want.last() == Some(&eos) {
            already_ending += 1;
        } else {
            want.push(eos);
        }
        let got = tokenizer
            .encode_document(&Content::Text(text.to_owned()))
            .unwrap();
        assert_eq!(got, want, "{text:?}");
    }
    // The corpus has texts ending in "</s>", where nothing is appended.
    assert!(already_ending >= 2, "{already_ending}");

    for chat in expected["chats"].as_array().unwrap() {
        let mut want = ids(&chat["ids"]);
        if want.last() != Some(&eos) {
            want.push(eos);
        }
        let got = tokenizer
            .encode_document(&Content::Messages(chat["messages"].clone()))
            .unwrap();
        assert_eq!(got, want);
        assert_eq!(
            got.iter().filter(|&&t| t == eos).count(),
            want.iter().filter(|&&t| t == eos).count()
        );
    }
}

/// A lone tokenizer.json is the raw tokenizer, which the fixture script checked agrees with
/// transformers on every text.
#[test]
fn a_lone_tokenizer_json_gives_the_same_ids() {
    let tokenizer = Tokenizer::from_file(&tokenizer_dir().join("tokenizer.json")).unwrap();
    assert_eq!(
        (tokenizer.bos_id(), tokenizer.eos_id(), tokenizer.pad_id()),
        (None, None, None)
    );
    let expected = expected();
    assert_eq!(
        tokenizer.vocab_size() as u64,
        expected["special"]["vocab_size"].as_u64().unwrap()
    );
    for entry in expected["texts"].as_array().unwrap() {
        let text = entry["text"].as_str().unwrap();
        assert_eq!(
            tokenizer.encode(text, true).unwrap(),
            ids(&entry["ids"]),
            "{text:?}"
        );
    }
    let err = tokenizer
        .encode_document(&Content::Text("x".into()))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no EOS token") && err.contains("eos_token"),
        "{err}"
    );
}

/// The chat template embedded in tokenizer_config.json (the older place) renders the same,
/// and chat_template.jinja takes precedence over it, as in transformers.
#[test]
fn chat_template_sources_and_precedence() {
    let expected = expected();
    let jinja = std::fs::read_to_string(tokenizer_dir().join("chat_template.jinja")).unwrap();
    let config_text =
        std::fs::read_to_string(tokenizer_dir().join("tokenizer_config.json")).unwrap();
    let config: Value = serde_json::from_str(&config_text).unwrap();
    let with_template = |template: Value, jinja_file: Option<&str>| {
        let dir = tempfile::tempdir().unwrap();
        copy(&tokenizer_dir(), dir.path(), "tokenizer.json");
        let mut config = config.clone();
        config["chat_template"] = template;
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        if let Some(source) = jinja_file {
            std::fs::write(dir.path().join("chat_template.jinja"), source).unwrap();
        }
        let tokenizer = Tokenizer::from_dir(dir.path()).unwrap();
        (dir, tokenizer)
    };
    let refusing = "{{ raise_exception('the config template was used') }}";
    let cases = [
        with_template(Value::from(jinja.as_str()), None),
        with_template(Value::from(refusing), Some(&jinja)),
    ];
    for (_dir, tokenizer) in &cases {
        for chat in expected["chats"].as_array().unwrap() {
            let rendered = tokenizer.render_chat(&chat["messages"]).unwrap();
            assert_eq!(rendered, chat["rendered"].as_str().unwrap());
        }
    }
    // A list of templates without "default": transformers refuses; so does this, naming them.
    let list = serde_json::json!([{"name": "tool_use", "template": jinja}]);
    let (_dir, tokenizer) = with_template(list, None);
    assert!(!tokenizer.encode("Hello", false).unwrap().is_empty());
    let err = tokenizer
        .render_chat(&expected["chats"][0]["messages"])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("tool_use") && err.contains("\"default\""),
        "{err}"
    );
}

/// Copies one file between directories.
pub fn copy(from: &Path, to: &Path, name: &str) {
    std::fs::copy(from.join(name), to.join(name)).unwrap();
}

/// The loader's workers share one tokenizer through an Arc.
#[test]
fn tokenizer_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
}
