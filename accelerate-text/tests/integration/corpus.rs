//! Corpora: the fixtures' documents as the sidecar lists them, shards and directories in order,
//! and every refusal naming the problem.

use std::path::Path;

use accelerate_text::{Content, Corpus, Format, SampleBy};

use crate::common::{expected, fixture, read_all, sidecar, summary};

fn err(corpus: Result<Corpus, accelerate_text::Error>) -> String {
    corpus.unwrap_err().to_string()
}

#[test]
fn parquet_rows_are_the_string_column_without_nulls_or_blanks() {
    let want = expected();
    let corpus = Corpus::new([fixture("rows.parquet")]).unwrap();
    let docs = read_all(&corpus).unwrap();
    assert_eq!(summary(&docs), sidecar(&want["rows.parquet"]["text"]));
    assert_eq!(want["rows.parquet"]["row_groups"], 3, "several row groups");

    // Uncompressed, plain-encoded large_string column, named.
    let corpus = Corpus::new([fixture("plain.parquet")])
        .unwrap()
        .field("content");
    let docs = read_all(&corpus).unwrap();
    assert_eq!(summary(&docs), sidecar(&want["plain.parquet"]["content"]));
}

#[test]
fn parquet_columns_that_are_missing_or_not_strings_are_refused() {
    let read = |field: &str| {
        read_all(&Corpus::new([fixture("rows.parquet")]).unwrap().field(field)).unwrap_err()
    };
    let e = read("body");
    assert!(e.contains("rows.parquet: no column `body`"), "{e}");
    assert!(e.contains("`text`, `id`, `label`, `score`"), "{e}");
    let e = read("id");
    assert!(e.contains("column `id` is of type INT64"), "{e}");
    assert!(e.contains("not a string column"), "{e}");
    let e = read("label");
    assert!(e.contains("column `label` is a binary column"), "{e}");
    let e = read("score");
    assert!(e.contains("of type FLOAT"), "{e}");
    // The plain file has no `text` column: the default names the one it has.
    let e = read_all(&Corpus::new([fixture("plain.parquet")]).unwrap()).unwrap_err();
    assert!(
        e.contains("no column `text` (its columns: `content`)"),
        "{e}"
    );
}

#[test]
fn a_damaged_parquet_file_is_an_error_not_a_panic() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(fixture("rows.parquet")).unwrap();
    // Cut off the footer: not a Parquet file any more.
    let cut = dir.path().join("cut.parquet");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    let e = read_all(&Corpus::new([&cut]).unwrap()).unwrap_err();
    assert!(
        e.contains("cut.parquet: not a readable Parquet file"),
        "{e}"
    );
    // Damage the first column chunk's pages but keep the footer: the file opens, and reading
    // its rows fails with an error naming the file.
    let mut damaged = bytes.clone();
    for b in &mut damaged[20..60] {
        *b = 0xAB;
    }
    let path = dir.path().join("damaged.parquet");
    std::fs::write(&path, &damaged).unwrap();
    let e = read_all(&Corpus::new([&path]).unwrap()).unwrap_err();
    assert!(
        e.contains("damaged.parquet: the Parquet file cannot be read"),
        "{e}"
    );
}

#[test]
fn jsonl_text_messages_and_named_fields() {
    let want = expected();
    let docs = read_all(&Corpus::new([fixture("mixed.jsonl")]).unwrap()).unwrap();
    assert_eq!(summary(&docs), sidecar(&want["mixed.jsonl"]["text"]));
    assert!(matches!(docs[2].content, Content::Messages(_)));

    let chat = sidecar(&want["chat.jsonl"]["messages"]);
    let docs = read_all(&Corpus::new([fixture("chat.jsonl")]).unwrap()).unwrap();
    assert_eq!(summary(&docs), chat);
    let named = Corpus::new([fixture("chat.jsonl")])
        .unwrap()
        .field("messages");
    assert_eq!(summary(&read_all(&named).unwrap()), chat);
}

#[test]
fn jsonl_errors_name_the_file_the_line_the_field_and_the_fields_present() {
    let e = read_all(&Corpus::new([fixture("missing_field.jsonl")]).unwrap()).unwrap_err();
    assert!(
        e.contains("missing_field.jsonl:2: the record has neither a `text` nor a `messages` field (its fields: `body`, `id`)"),
        "{e}"
    );
    let named = Corpus::new([fixture("missing_field.jsonl")])
        .unwrap()
        .field("body");
    let e = read_all(&named).unwrap_err();
    assert!(
        e.contains("missing_field.jsonl:1: the record has no field `body` (its fields: `text`)"),
        "{e}"
    );
    let e = read_all(&Corpus::new([fixture("bad_json.jsonl")]).unwrap()).unwrap_err();
    assert!(e.contains("bad_json.jsonl:3: not a JSON value"), "{e}");
    // The documents before the error come first.
    let docs: Vec<_> = Corpus::new([fixture("bad_json.jsonl")])
        .unwrap()
        .documents()
        .collect();
    assert_eq!(docs.len(), 2);
    assert!(docs[0].is_ok() && docs[1].is_err());

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("odd.jsonl");
    std::fs::write(&path, "{\"text\": 5}\n").unwrap();
    let e = read_all(&Corpus::new([&path]).unwrap()).unwrap_err();
    assert!(
        e.contains("odd.jsonl:1: field `text` holds a number"),
        "{e}"
    );
    std::fs::write(&path, "[1, 2]\n").unwrap();
    let e = read_all(&Corpus::new([&path]).unwrap()).unwrap_err();
    assert!(
        e.contains("odd.jsonl:1: the record is a list, not an object"),
        "{e}"
    );
}

#[test]
fn text_files_by_line_paragraph_and_document() {
    let want = &expected()["lines.txt"];
    for (sample_by, key) in [
        (SampleBy::Line, "line"),
        (SampleBy::Paragraph, "paragraph"),
        (SampleBy::Document, "document"),
    ] {
        let corpus = Corpus::new([fixture("lines.txt")])
            .unwrap()
            .sample_by(sample_by);
        assert_eq!(
            summary(&read_all(&corpus).unwrap()),
            sidecar(&want[key]),
            "{key}"
        );
    }
}

#[test]
fn text_that_is_not_utf8_names_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("latin1.txt");
    std::fs::write(&path, b"fine\ncaf\xe9\n").unwrap();
    let e = read_all(&Corpus::new([&path]).unwrap()).unwrap_err();
    assert!(e.contains("latin1.txt:2: not UTF-8 text"), "{e}");
}

#[test]
fn shards_are_read_in_the_order_given_and_lazily() {
    let order = [
        fixture("lines.txt"),
        fixture("chat.jsonl"),
        fixture("rows.parquet"),
    ];
    let docs = read_all(&Corpus::new(&order).unwrap()).unwrap();
    let want = expected();
    let mut expect = sidecar(&want["lines.txt"]["line"]);
    expect.extend(sidecar(&want["chat.jsonl"]["messages"]));
    expect.extend(sidecar(&want["rows.parquet"]["text"]));
    assert_eq!(summary(&docs), expect);
    let sources: Vec<&Path> = docs.iter().map(|d| d.source.as_path()).collect();
    assert_eq!(sources[0], order[0].as_path());
    assert_eq!(*sources.last().unwrap(), order[2].as_path());

    // A shard removed after the corpus was made: the documents before it still stream, then
    // the error names it (each file is opened only when the stream reaches it).
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.txt"), dir.path().join("b.txt"));
    std::fs::write(&a, "one\ntwo\n").unwrap();
    std::fs::write(&b, "three\n").unwrap();
    let corpus = Corpus::new([&a, &b]).unwrap();
    std::fs::remove_file(&b).unwrap();
    let mut docs = corpus.documents();
    assert_eq!(
        docs.next().unwrap().unwrap().content,
        Content::Text("one".into())
    );
    assert_eq!(
        docs.next().unwrap().unwrap().content,
        Content::Text("two".into())
    );
    let e = docs.next().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("cannot open the text file") && e.contains("b.txt"),
        "{e}"
    );
    assert!(docs.next().is_none());
}

#[test]
fn a_directory_is_its_files_of_one_format_sorted() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("part-2.jsonl"), "{\"text\": \"c\"}\n").unwrap();
    std::fs::write(d.join("part-10.jsonl"), "{\"text\": \"b\"}\n").unwrap();
    std::fs::write(d.join("part-1.jsonl"), "{\"text\": \"a\"}\n").unwrap();
    std::fs::write(d.join(".hidden.jsonl"), "{\"text\": \"hidden\"}\n").unwrap();
    std::fs::write(d.join("LICENSE"), "no extension").unwrap();
    let corpus = Corpus::new([d]).unwrap();
    let names: Vec<String> = corpus
        .files()
        .map(|(p, f)| {
            assert_eq!(f, Format::Jsonl);
            p.file_name().unwrap().to_string_lossy().into_owned()
        })
        .collect();
    // Sorted by name as strings (as `sorted(os.listdir())`), hidden files left out.
    assert_eq!(names, ["part-1.jsonl", "part-10.jsonl", "part-2.jsonl"]);
    let texts: Vec<Content> = read_all(&corpus)
        .unwrap()
        .into_iter()
        .map(|d| d.content)
        .collect();
    assert_eq!(
        texts,
        ["a", "b", "c"].map(|t| Content::Text(t.into())).to_vec()
    );

    // A dataset card beside the data is left out; a text file is another format.
    std::fs::write(d.join("README.md"), "# a dataset card\n").unwrap();
    assert_eq!(Corpus::new([d]).unwrap().files().count(), 3);
    std::fs::write(d.join("notes.txt"), "some text\n").unwrap();
    let e = err(Corpus::new([d]));
    assert!(
        e.contains("holds files of several formats (json, text)"),
        "{e}"
    );
    let only = Corpus::with_format([d], Format::Jsonl).unwrap();
    assert_eq!(only.files().count(), 3);

    let empty = tempfile::tempdir().unwrap();
    let e = err(Corpus::new([empty.path()]));
    assert!(
        e.contains("holds no file; the accepted extensions are .jsonl"),
        "{e}"
    );
    let e = err(Corpus::with_format([d], Format::Parquet));
    assert!(e.contains("holds no parquet file"), "{e}");
}

#[test]
fn bad_file_lists_are_refused_naming_the_fix() {
    let none: [&Path; 0] = [];
    let e = err(Corpus::new(none));
    assert!(e.contains("given no file"), "{e}");
    let e = err(Corpus::new([fixture("nowhere.jsonl")]));
    assert!(
        e.contains("nowhere.jsonl") && e.contains("check the path"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("data.csv");
    std::fs::write(&csv, "text\nhello\n").unwrap();
    let e = err(Corpus::new([&csv]));
    assert!(
        e.contains("data.csv: unknown corpus file extension; the accepted ones are .jsonl or .json (JSON Lines), .parquet (Parquet), .txt, .text or .md (plain text)"),
        "{e}"
    );
    // Named, the format overrides the extension.
    let docs = read_all(&Corpus::with_format([&csv], Format::Text).unwrap()).unwrap();
    assert_eq!(docs.len(), 2);
}

#[test]
fn select_keeps_a_range_of_the_document_stream_and_passes_errors_on() {
    let corpus = Corpus::new([fixture("lines.txt")]).unwrap();
    let all = read_all(&corpus).unwrap();
    let middle = read_all(&corpus.select(2..5)).unwrap();
    assert_eq!(middle, all[2..5].to_vec());
    let nested = read_all(&corpus.select(2..5).select(1..10)).unwrap();
    assert_eq!(nested, all[3..5].to_vec());
    assert_eq!(
        corpus.select(3..100).count_documents().unwrap(),
        all.len() - 3
    );
    assert_eq!(corpus.count_documents().unwrap(), 7);

    // An error before the range still ends the stream with that error.
    let bad = Corpus::new([fixture("bad_json.jsonl")])
        .unwrap()
        .select(5..6);
    let e = read_all(&bad).unwrap_err();
    assert!(e.contains("bad_json.jsonl:3"), "{e}");
}

#[test]
fn a_byte_order_mark_is_skipped_and_a_dataset_folder_is_read_without_its_card() {
    let dir = tempfile::tempdir().unwrap();
    let bom = dir.path().join("bom.jsonl");
    std::fs::write(
        &bom,
        "\u{feff}{\"text\": \"first\"}\n{\"text\": \"second\"}\n",
    )
    .unwrap();
    let docs = read_all(&Corpus::new([&bom]).unwrap()).unwrap();
    let texts: Vec<_> = docs.iter().map(|d| d.content.clone()).collect();
    assert_eq!(
        texts,
        [
            Content::Text("first".into()),
            Content::Text("second".into())
        ]
    );

    // A Hugging Face dataset folder: a card beside the data files, left out.
    let folder = dir.path().join("dataset");
    std::fs::create_dir(&folder).unwrap();
    std::fs::write(folder.join("README.md"), "# My dataset\nlicense: mit\n").unwrap();
    std::fs::write(folder.join("train.txt"), "a line\nanother line\n").unwrap();
    let docs = read_all(&Corpus::new([&folder]).unwrap()).unwrap();
    assert_eq!(docs.len(), 2);
    assert!(docs.iter().all(|d| d.source.ends_with("train.txt")));
    // A subdirectory (the data of a snapshot under data/) is refused by name, not skipped.
    std::fs::create_dir(folder.join("data")).unwrap();
    let e = Corpus::new([&folder]).unwrap_err().to_string();
    assert!(e.contains("data") && e.contains("not read"), "{e}");
}
