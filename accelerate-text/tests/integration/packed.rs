//! Packed rows as a map-style dataset: the naive packing's rows, from a token file and from
//! memory, and the DataLoader's sharding, shuffle, resume and gather_for_metrics unchanged.

use std::collections::BTreeMap;
use std::sync::Arc;

use accelerate_core::data::{DataLoader, Dataset};
use accelerate_text::{
    pretokenize, Corpus, PackedRows, PretokenizeOptions, TokenDtype, TokenFile, TokenRow,
};

use crate::common::{batch_rows, byte_tokenizer, jsonl_corpus, naive_rows};

/// A corpus of `n` generated documents, their ids by the byte tokenizer, and a token file of it.
fn setup(n: usize) -> (tempfile::TempDir, Corpus, Vec<Vec<u32>>, Arc<TokenFile>) {
    let dir = tempfile::tempdir().unwrap();
    let (corpus, ids) = jsonl_corpus(dir.path(), "corpus.jsonl", n, 5);
    let out = dir.path().join("corpus.tokens");
    let options = PretokenizeOptions::new(TokenDtype::U16, "bytes");
    pretokenize(&corpus, byte_tokenizer(), 3, &out, options).unwrap();
    let file = Arc::new(TokenFile::open(&out).unwrap());
    (dir, corpus, ids, file)
}

fn all_rows(rows: &PackedRows) -> Vec<TokenRow> {
    (0..rows.len()).map(|i| rows.get(i).unwrap()).collect()
}

#[test]
fn rows_are_the_naive_packing_from_a_token_file_and_from_memory() {
    let (_dir, corpus, ids, file) = setup(300);
    for block_size in [1, 7, 64, 300, 1000] {
        let expected = naive_rows(&ids, block_size);
        let total: usize = ids.iter().map(Vec::len).sum();
        assert_eq!(expected.len(), total / block_size);

        let mapped = PackedRows::from_token_file(Arc::clone(&file), block_size).unwrap();
        assert_eq!(
            all_rows(&mapped),
            expected,
            "token file, block {block_size}"
        );
        assert_eq!(mapped.dropped_tokens(), (total % block_size) as u64);
        assert_eq!(mapped.documents(), 300);

        let memory = PackedRows::tokenize(&corpus, byte_tokenizer(), 4, block_size).unwrap();
        assert_eq!(all_rows(&memory), expected, "memory, block {block_size}");
        assert!(mapped.get(expected.len()).is_err());
    }
    // Documents longer than two rows of 64 exist in this corpus (lengths up to 300 + EOS).
    assert!(ids.iter().any(|d| d.len() > 128));
}

#[test]
fn a_document_range_of_a_token_file_packs_those_documents_only() {
    let (_dir, _corpus, ids, file) = setup(120);
    let rows = PackedRows::from_token_file_documents(Arc::clone(&file), 30..90, 50).unwrap();
    assert_eq!(all_rows(&rows), naive_rows(&ids[30..90], 50));
    assert!(PackedRows::from_token_file_documents(Arc::clone(&file), 30..121, 50).is_err());
    let e = PackedRows::from_token_file_documents(file, 3..4, 100_000)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("less than one row of 100000; lower the block size"),
        "{e}"
    );
}

#[test]
fn batches_have_one_shape_and_count_the_pairs_within_documents() {
    let (_dir, _corpus, ids, file) = setup(40);
    let block_size = 33;
    let rows = PackedRows::from_token_file(file, block_size).unwrap();
    let expected = naive_rows(&ids, block_size);
    let batch = rows.get_batch(&[3, 0, 5]).unwrap();
    assert_eq!(batch.input_ids.dims(), &[3, block_size]);
    assert_eq!(
        batch_rows(&batch),
        vec![
            expected[3].clone(),
            expected[0].clone(),
            expected[5].clone()
        ]
    );
    // Pairs within a document = (T - 1) - (segments - 1) per row.
    let pairs: usize = [3, 0, 5]
        .iter()
        .map(|&r| {
            let segments = *expected[r].segment_ids.last().unwrap() as usize;
            block_size - segments
        })
        .sum();
    assert_eq!(batch.predicted, pairs);
}

#[test]
fn two_ranks_share_the_rows_with_shuffle_resume_and_gather_for_metrics() {
    let (_dir, _corpus, ids, file) = setup(200);
    let block_size = 40;
    let dataset = Arc::new(PackedRows::from_token_file(file, block_size).unwrap());
    let expected = naive_rows(&ids, block_size);
    let n_rows = expected.len();
    assert!(
        n_rows % 6 != 0,
        "a last round the wrap-around completes: {n_rows} rows"
    );
    let world = 2;
    let batch_size = 3;
    let loaders: Vec<DataLoader<PackedRows>> = (0..world)
        .map(|r| {
            DataLoader::new(Arc::clone(&dataset), batch_size)
                .shuffle(true)
                .seed(11)
                .shard(r, world)
        })
        .collect();
    let epoch = 1;
    let per_rank: Vec<Vec<Vec<TokenRow>>> = loaders
        .iter()
        .map(|l| {
            l.iter_epoch(epoch, 0)
                .map(|b| batch_rows(&b.unwrap()))
                .collect()
        })
        .collect();
    assert_eq!(
        per_rank[0].len(),
        per_rank[1].len(),
        "ranks step equally often"
    );

    // What gather_for_metrics sees: each round's batches in rank order; the wrapped-around
    // duplicates come last and are dropped, leaving every row exactly once.
    let mut gathered: Vec<TokenRow> = Vec::new();
    for round in 0..per_rank[0].len() {
        for rank in &per_rank {
            gathered.extend(rank[round].iter().cloned());
        }
    }
    let real = loaders[0].samples_per_epoch();
    assert_eq!(real, n_rows);
    assert_eq!(
        gathered.len(),
        real + loaders[0].wrapped_samples_per_epoch()
    );
    let mut kept = gathered[..real].to_vec();
    let mut want = expected.clone();
    let key = |r: &TokenRow| (r.input_ids.clone(), r.segment_ids.clone());
    kept.sort_by_key(key);
    want.sort_by_key(key);
    assert_eq!(kept, want, "the union of the ranks' batches is the row set");

    // The order is the loader's seeded shuffle of the row indices, the same on both ranks.
    let plan = loaders[0].epoch_plan(epoch);
    assert_eq!(plan, loaders[1].epoch_plan(epoch));
    let by_plan: Vec<TokenRow> = plan.concat().iter().map(|&i| expected[i].clone()).collect();
    assert_eq!(gathered, by_plan);
    assert_ne!(
        plan,
        loaders[0].epoch_plan(epoch + 1),
        "another epoch, another order"
    );
    assert_ne!(
        plan.concat()[..real].to_vec(),
        (0..real).collect::<Vec<_>>(),
        "shuffled"
    );

    // Exact resume mid-epoch: the batches after the first `skip` are the same ones.
    for (rank, loader) in loaders.iter().enumerate() {
        let skip = 2;
        let resumed: Vec<Vec<TokenRow>> = loader
            .iter_epoch(epoch, skip)
            .map(|b| batch_rows(&b.unwrap()))
            .collect();
        assert_eq!(resumed, per_rank[rank][skip..].to_vec(), "rank {rank}");
    }

    // Every row of a batch is one of the packing's rows, with its boundaries.
    let index: BTreeMap<Vec<u32>, &TokenRow> =
        expected.iter().map(|r| (r.input_ids.clone(), r)).collect();
    for row in &gathered {
        assert_eq!(index[&row.input_ids], row);
    }
}
