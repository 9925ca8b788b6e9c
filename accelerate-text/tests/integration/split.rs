//! The held-out split against `datasets`' percent slicing (the sidecar's table).

use accelerate_text::{validation_split, Corpus};

use crate::common::{expected, fixture, read_all};

#[test]
fn boundaries_are_the_ones_datasets_slices_at() {
    let table = expected()["validation_split"].as_array().unwrap().clone();
    assert!(table.len() > 100);
    let (mut ok, mut refused) = (0, 0);
    for entry in table {
        let n = entry["documents"].as_u64().unwrap() as usize;
        let p = entry["percentage"].as_u64().unwrap() as u32;
        let held = entry["validation"].as_u64().unwrap() as usize;
        let got = validation_split(n, p);
        if held == 0 || held == n {
            // An empty side: refused, naming the flag.
            let e = got.unwrap_err().to_string();
            assert!(e.contains("--validation-split-percentage"), "{e}");
            refused += 1;
        } else {
            assert_eq!(got.unwrap(), (0..held, held..n), "{n} documents, {p}%");
            ok += 1;
        }
    }
    assert!(ok > 80 && refused > 5, "{ok} {refused}");
    for p in [0, 100] {
        let e = validation_split(10, p).unwrap_err().to_string();
        assert!(e.contains("not in 1..=99"), "{e}");
    }
}

#[test]
fn the_validation_side_is_the_first_documents_in_corpus_order() {
    let corpus = Corpus::new([fixture("lines.txt")]).unwrap();
    let all = read_all(&corpus).unwrap();
    assert_eq!(all.len(), 7);
    // 50% of 7 = 3.5, rounded to even: 4 held out.
    let (train, validation) = corpus.split_validation(50).unwrap();
    assert_eq!(read_all(&validation).unwrap(), all[..4].to_vec());
    assert_eq!(read_all(&train).unwrap(), all[4..].to_vec());
    let e = corpus.split_validation(5).unwrap_err().to_string();
    assert!(e.contains("of 7 documents holds out none"), "{e}");
}
