//! Token files: the byte layout read back independently, dtypes, atomic writes, and damaged
//! files refused naming the fix.

use std::path::Path;

use accelerate_text::{TokenDtype, TokenFile, TokenFileWriter};

/// Parses a token file by hand from its documented layout: (header JSON, ids, offsets).
fn parse_by_hand(path: &Path) -> (serde_json::Value, Vec<u32>, Vec<u64>) {
    let bytes = std::fs::read(path).unwrap();
    assert_eq!(&bytes[..8], b"ACTOKENS");
    let h = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
    assert_eq!(h % 8, 0);
    let header: serde_json::Value =
        serde_json::from_str(std::str::from_utf8(&bytes[16..16 + h]).unwrap().trim_end()).unwrap();
    let width = match header["dtype"].as_str().unwrap() {
        "u16" => 2,
        "u32" => 4,
        other => panic!("dtype {other}"),
    };
    let tokens = header["tokens"].as_u64().unwrap() as usize;
    let documents = header["documents"].as_u64().unwrap() as usize;
    let ids_at = 16 + h;
    let ids: Vec<u32> = bytes[ids_at..ids_at + tokens * width]
        .chunks(width)
        .map(|c| {
            c.iter()
                .rev()
                .fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
        })
        .collect();
    let offsets_at = (ids_at + tokens * width).div_ceil(8) * 8;
    assert!(bytes[ids_at + tokens * width..offsets_at]
        .iter()
        .all(|&b| b == 0));
    let offsets: Vec<u64> = bytes[offsets_at..]
        .chunks(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(offsets.len(), documents + 1);
    (header, ids, offsets)
}

fn write(path: &Path, dtype: TokenDtype, docs: &[Vec<u32>]) {
    let mut w = TokenFileWriter::create(path, dtype, "byte-tokenizer v1").unwrap();
    for d in docs {
        w.push_document(d).unwrap();
    }
    let summary = w.finish().unwrap();
    assert_eq!(summary.documents, docs.len() as u64);
    assert_eq!(summary.bytes, std::fs::metadata(path).unwrap().len());
}

#[test]
fn written_files_have_the_documented_layout_and_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let docs = vec![vec![1, 2, 3], vec![], vec![65_535, 0, 7, 8, 9], vec![4]];
    for (dtype, big) in [(TokenDtype::U16, 65_535), (TokenDtype::U32, 1_000_000)] {
        let path = dir.path().join(format!("{dtype:?}.tokens"));
        let mut docs = docs.clone();
        docs[2][0] = big;
        write(&path, dtype, &docs);

        let (header, ids, offsets) = parse_by_hand(&path);
        assert_eq!(header["format"], "accelerate-text token file");
        assert_eq!(header["version"], 1);
        assert_eq!(header["tokenizer"], "byte-tokenizer v1");
        assert_eq!(header["documents"], 4);
        assert_eq!(header["tokens"], 9);
        assert_eq!(ids, docs.concat());
        assert_eq!(offsets, vec![0, 3, 3, 8, 9]);

        let file = TokenFile::open(&path).unwrap();
        assert_eq!(
            (file.documents(), file.tokens(), file.dtype()),
            (4, 9, dtype)
        );
        assert_eq!(file.tokenizer(), "byte-tokenizer v1");
        for (i, d) in docs.iter().enumerate() {
            assert_eq!(&file.document(i).unwrap(), d, "document {i}");
        }
        assert_eq!(file.document_range(2).unwrap(), 3..8);
        let mut some = Vec::new();
        file.read_tokens(2, 3, &mut some).unwrap();
        assert_eq!(some, vec![3, big, 0]);
        assert!(file.read_tokens(8, 2, &mut some).is_err());
        assert!(file.document(4).is_err());
        file.verify().unwrap();
        file.check_tokenizer("byte-tokenizer v1").unwrap();
        let e = file.check_tokenizer("gpt2").unwrap_err().to_string();
        assert!(e.contains("was tokenized with \"byte-tokenizer v1\", not with the tokenizer in use (\"gpt2\")"), "{e}");
        assert!(e.contains("re-run the tokenize command"), "{e}");
    }
    // u16 files are half the size of u32 ones for the ids.
    let size = |n: &str| std::fs::metadata(dir.path().join(n)).unwrap().len();
    assert!(size("U16.tokens") < size("U32.tokens"));
}

#[test]
fn the_dtype_follows_the_vocabulary_and_refuses_ids_that_do_not_fit() {
    assert_eq!(TokenDtype::for_vocab(50_257), TokenDtype::U16);
    assert_eq!(TokenDtype::for_vocab(65_536), TokenDtype::U16);
    assert_eq!(TokenDtype::for_vocab(65_537), TokenDtype::U32);
    assert_eq!(TokenDtype::for_vocab(128_256), TokenDtype::U32);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.tokens");
    let mut w = TokenFileWriter::create(&path, TokenDtype::U16, "t").unwrap();
    let e = w.push_document(&[1, 65_536]).unwrap_err().to_string();
    assert!(e.contains("token id 65536 does not fit the U16 ids"), "{e}");
}

#[test]
fn writes_are_atomic_and_leave_no_temporary_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("corpus.tokens");
    write(&path, TokenDtype::U16, &[vec![1, 2]]);
    let before = std::fs::read(&path).unwrap();
    // An unfinished rewrite (an error, an interrupted run) leaves the old file untouched.
    let mut w = TokenFileWriter::create(&path, TokenDtype::U16, "t").unwrap();
    w.push_document(&[9, 9, 9]).unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 3);
    drop(w);
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let names: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("corpus.tokens")]);
    // A mapping of the old file survives a finished rewrite (rename, not change in place).
    let old = TokenFile::open(&path).unwrap();
    write(&path, TokenDtype::U16, &[vec![5, 6, 7]]);
    assert_eq!(old.document(0).unwrap(), vec![1, 2]);
    assert_eq!(
        TokenFile::open(&path).unwrap().document(0).unwrap(),
        vec![5, 6, 7]
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    let e = TokenFileWriter::create(
        dir.path().join("missing/dir/x.tokens"),
        TokenDtype::U16,
        "t",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("check that the directory exists"), "{e}");
}

#[test]
fn damaged_files_are_refused_naming_the_file_and_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.tokens");
    write(&good, TokenDtype::U32, &[vec![1, 2, 3], vec![4, 5]]);
    let bytes = std::fs::read(&good).unwrap();
    let check = |name: &str, content: &[u8], wanted: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        let e = TokenFile::open(&path).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains(wanted), "{name}: {e}");
        assert!(e.contains("re-run the tokenize command"), "{name}: {e}");
    };
    check(
        "truncated.tokens",
        &bytes[..bytes.len() - 1],
        "truncated or damaged",
    );
    check("short.tokens", &bytes[..10], "less than a header");
    check("header_cut.tokens", &bytes[..40], "does not fit");
    let mut magic = bytes.clone();
    magic[..8].copy_from_slice(b"PAR1PAR1");
    check("magic.tokens", &magic, "token file magic");
    let mut header = bytes.clone();
    header[16] = b'#';
    check("header.tokens", &header, "not readable JSON");
    let mut longer = bytes.clone();
    longer.extend_from_slice(&[0; 8]);
    check("longer.tokens", &longer, "not the");
    // The last offset no longer the token count.
    let mut offsets = bytes.clone();
    let n = offsets.len();
    offsets[n - 8] = 4;
    check("offsets.tokens", &offsets, "offsets run from 0 to 4");
    let e = TokenFile::open(dir.path().join("absent.tokens"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("absent.tokens") && e.contains("re-run the tokenize command"),
        "{e}"
    );

    // A middle offset that goes backwards passes `open` (which reads only the first and last)
    // and is found by `verify` and by reading that document.
    let mut backwards = bytes.clone();
    backwards[n - 16] = 9;
    let path = dir.path().join("backwards.tokens");
    std::fs::write(&path, &backwards).unwrap();
    let file = TokenFile::open(&path).unwrap();
    let e = file.verify().unwrap_err().to_string();
    assert!(
        e.contains("backwards.tokens is damaged") && e.contains("re-run"),
        "{e}"
    );
    assert!(file.document(1).is_err());
}

#[test]
fn absurd_header_and_count_fields_are_errors_not_panics() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.tokens");
    write(&good, TokenDtype::U16, &[vec![1, 2, 3], vec![4]]);
    let bytes = std::fs::read(&good).unwrap();
    let header_len = u64::from_le_bytes(bytes[8..16].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[16..16 + header_len])
        .unwrap()
        .to_string();
    let cases: Vec<Vec<u8>> = vec![
        // A header length near 2^64 (and a multiple of 8).
        [&bytes[..8], &(u64::MAX - 7).to_le_bytes()[..], &bytes[16..]].concat(),
        // Token and document counts whose byte sizes overflow.
        {
            let big = header
                .replacen("\"tokens\":4", &format!("\"tokens\":{}", u64::MAX / 2), 1)
                .replacen(
                    "\"documents\":2",
                    &format!("\"documents\":{}", u64::MAX - 1),
                    1,
                );
            let mut padded = big.into_bytes();
            padded.resize(header_len, b' ');
            [
                &bytes[..16],
                &padded[..header_len],
                &bytes[16 + header_len..],
            ]
            .concat()
        },
    ];
    for (i, damaged) in cases.iter().enumerate() {
        let path = dir.path().join(format!("bad{i}.tokens"));
        std::fs::write(&path, damaged).unwrap();
        let e = TokenFile::open(&path).unwrap_err().to_string();
        assert!(e.contains("re-run the tokenize command"), "case {i}: {e}");
    }
}
