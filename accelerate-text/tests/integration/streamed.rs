//! A corpus through the StreamingLoader: tokenized on its workers, one document per row, padded
//! per batch, sharded between ranks and resumed as any stream.

use std::sync::Arc;

use accelerate_core::data::StreamingLoader;
use accelerate_text::{Content, Corpus, Error, TokenRow, TokenizeFn, TokenizedCorpus};

use crate::common::{batch_rows, byte_ids, byte_tokenizer, jsonl_corpus};

const PAD: u32 = 1;

/// The rows a batch of these documents should be: each cut to `max_length`, padded at the end
/// to the longest with PAD and segment 0.
fn padded(docs: &[Vec<u32>], max_length: usize) -> Vec<TokenRow> {
    let cut: Vec<Vec<u32>> = docs
        .iter()
        .map(|d| d[..d.len().min(max_length)].to_vec())
        .collect();
    let width = cut.iter().map(Vec::len).max().unwrap();
    cut.iter()
        .map(|d| {
            let mut input_ids = d.clone();
            let mut segment_ids = vec![1; d.len()];
            input_ids.resize(width, PAD);
            segment_ids.resize(width, 0);
            TokenRow {
                input_ids,
                segment_ids,
            }
        })
        .collect()
}

#[test]
fn ranks_get_their_slices_of_each_global_batch_tokenized_and_padded() {
    let dir = tempfile::tempdir().unwrap();
    let (corpus, ids) = jsonl_corpus(dir.path(), "stream.jsonl", 47, 3);
    let max_length = 100;
    let dataset =
        Arc::new(TokenizedCorpus::new(corpus, byte_tokenizer(), max_length, PAD).unwrap());
    let (world, batch_size) = (2, 4);
    // 47 documents in global batches of 8: 5 full, and a last one of 7 completed with the first
    // document of the stream.
    let mut stream = ids.clone();
    stream.push(ids[0].clone());
    for rank in 0..world {
        let loader = StreamingLoader::new(Arc::clone(&dataset), batch_size)
            .num_workers(3)
            .shard(rank, world);
        let batches: Vec<Vec<TokenRow>> = loader
            .iter_epoch(0, 0)
            .map(|b| batch_rows(&b.unwrap()))
            .collect();
        let expected: Vec<Vec<TokenRow>> = stream
            .chunks(batch_size * world)
            .map(|global| {
                padded(
                    &global[rank * batch_size..(rank + 1) * batch_size],
                    max_length,
                )
            })
            .collect();
        assert_eq!(batches, expected, "rank {rank}");
        let resumed: Vec<Vec<TokenRow>> = loader
            .iter_epoch(0, 4)
            .map(|b| batch_rows(&b.unwrap()))
            .collect();
        assert_eq!(resumed, expected[4..].to_vec(), "rank {rank} resumed");
    }
    // Some documents were longer than the limit and cut.
    assert!(ids.iter().any(|d| d.len() > max_length));
    assert!(ids.iter().any(|d| d.len() < max_length));
}

#[test]
fn predicted_pairs_and_errors_in_the_stream() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.txt");
    std::fs::write(&path, "ab\nabcd\n\nbad\nxyz\n").unwrap();
    let tokenize: TokenizeFn = Arc::new(|c: &Content| match c {
        Content::Text(t) if t == "bad" => Err(Error::Text("unknown word".into())),
        _ => Ok(byte_ids(c)),
    });
    let corpus = Corpus::new([&path]).unwrap();
    let dataset = Arc::new(TokenizedCorpus::new(corpus, tokenize, 3, PAD).unwrap());
    let mut batches = StreamingLoader::new(dataset, 2).iter_epoch(0, 0);
    let first = batches.next().unwrap().unwrap();
    // "ab" + EOS = 3 ids (2 pairs); "abcd" + EOS cut to 3 ids (2 pairs).
    assert_eq!(first.input_ids.dims(), &[2, 3]);
    assert_eq!(first.predicted, 4);
    let e = batches.next().unwrap().unwrap_err().to_string();
    assert!(
        e.contains("s.txt:4: cannot tokenize the document: unknown word"),
        "{e}"
    );
    assert!(TokenizedCorpus::new(Corpus::new([&path]).unwrap(), byte_tokenizer(), 0, PAD).is_err());
}
