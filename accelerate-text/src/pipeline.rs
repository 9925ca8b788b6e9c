//! Tokenizing a stream of documents on several threads, in order, in bounded memory: one reader
//! thread, `workers` tokenizing threads, and the caller's thread taking the ids in stream order.

use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Condvar, Mutex};

use crate::corpus::location;
use crate::document::Document;
use crate::error::{Error, Result};
use crate::tokenize_fn::TokenizeFn;

/// Documents handed out but not yet taken by the sink, per worker: bounds the memory held by
/// documents waiting behind a slow one.
const IN_FLIGHT_PER_WORKER: usize = 4;

/// Tokenizes `documents` with `tokenize` on `workers` threads and hands each document's ids to
/// `sink` in stream order, on the calling thread. At most `IN_FLIGHT_PER_WORKER × workers`
/// documents are read ahead of the sink, whatever their speed. The first error (reading,
/// tokenizing, or the sink's) stops the pipeline and is returned; a tokenizer error names the
/// document's file and line.
pub(crate) fn tokenize_in_order<I>(
    documents: I,
    tokenize: &TokenizeFn,
    workers: usize,
    mut sink: impl FnMut(Vec<u32>) -> Result<()>,
) -> Result<()>
where
    I: Iterator<Item = Result<Document>> + Send,
{
    if workers == 0 {
        return Err(Error::Text(
            "tokenizing with 0 workers; pass at least 1 thread".into(),
        ));
    }
    let window = IN_FLIGHT_PER_WORKER * workers;
    let (job_tx, job_rx) = sync_channel::<(usize, Document)>(workers);
    let job_rx = Arc::new(Mutex::new(job_rx));
    let (done_tx, done_rx) = sync_channel::<(usize, Result<Vec<u32>>)>(window);
    // How many documents the sink has taken, so the reader stays within the window.
    let taken = (Mutex::new(0usize), Condvar::new());
    let cancel = AtomicBool::new(false);

    std::thread::scope(|scope| {
        let reader_done = done_tx.clone();
        let (taken, cancel) = (&taken, &cancel);
        scope.spawn(move || {
            for (seq, doc) in documents.enumerate() {
                {
                    let mut n = taken.0.lock().unwrap_or_else(|e| e.into_inner());
                    while seq >= *n + window && !cancel.load(Ordering::Acquire) {
                        n = taken.1.wait(n).unwrap_or_else(|e| e.into_inner());
                    }
                }
                if cancel.load(Ordering::Acquire) {
                    return;
                }
                let sent = match doc {
                    Ok(doc) => job_tx.send((seq, doc)).is_ok(),
                    Err(e) => {
                        let _ = reader_done.send((seq, Err(e)));
                        false
                    }
                };
                if !sent {
                    return;
                }
            }
        });
        for _ in 0..workers {
            let (jobs, done) = (Arc::clone(&job_rx), done_tx.clone());
            scope.spawn(move || worker(&jobs, &done, tokenize));
        }
        drop(job_rx);
        drop(done_tx);

        let result = take_in_order(&done_rx, taken, &mut sink);
        if result.is_err() {
            cancel.store(true, Ordering::Release);
            taken.1.notify_all();
        }
        // Dropping the receiver makes the workers' sends fail, so they stop.
        drop(done_rx);
        result
    })
}

/// Takes documents from the queue and tokenizes them until the queue or the results close.
fn worker(
    jobs: &Mutex<Receiver<(usize, Document)>>,
    done: &std::sync::mpsc::SyncSender<(usize, Result<Vec<u32>>)>,
    tokenize: &TokenizeFn,
) {
    loop {
        let job = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv();
        let Ok((seq, doc)) = job else { return };
        // A panicking tokenizer must not leave the others waiting for this document forever.
        let ids = catch_unwind(AssertUnwindSafe(|| tokenize(&doc.content)))
            .unwrap_or_else(|_| Err(Error::Text("the tokenizer panicked".into())))
            .map_err(|e| {
                Error::Text(format!(
                    "{}: cannot tokenize the document: {e}",
                    location(&doc)
                ))
            });
        if done.send((seq, ids)).is_err() {
            return;
        }
    }
}

/// Hands the results to `sink` in stream order until every sender is gone.
fn take_in_order(
    done: &Receiver<(usize, Result<Vec<u32>>)>,
    taken: &(Mutex<usize>, Condvar),
    sink: &mut impl FnMut(Vec<u32>) -> Result<()>,
) -> Result<()> {
    let mut waiting = BTreeMap::new();
    let mut next = 0;
    while let Ok((seq, ids)) = done.recv() {
        waiting.insert(seq, ids);
        while let Some(ids) = waiting.remove(&next) {
            sink(ids?)?;
            next += 1;
            *taken.0.lock().unwrap_or_else(|e| e.into_inner()) = next;
            taken.1.notify_all();
        }
    }
    match waiting.into_iter().next() {
        None => Ok(()),
        // Only a result after a lost one can wait here; the reader and workers send every one.
        Some((seq, _)) => Err(Error::Text(format!(
            "document {next} was never tokenized (document {seq} was); a tokenizing thread \
             stopped early"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::document::Content;
    use std::path::PathBuf;

    fn docs(n: usize) -> Vec<Result<Document>> {
        let source = Arc::new(PathBuf::from("mem.txt"));
        (0..n)
            .map(|i| {
                Ok(Document {
                    source: Arc::clone(&source),
                    position: i + 1,
                    content: Content::Text("x".repeat(i % 7 + 1)),
                })
            })
            .collect()
    }

    /// Ids = [position, text length]; documents of some lengths sleep so that workers finish
    /// out of order.
    fn tokenizer(fail_at: Option<usize>) -> TokenizeFn {
        Arc::new(move |content: &Content| {
            let Content::Text(t) = content else {
                unreachable!()
            };
            if t.len() == 3 {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            if fail_at == Some(t.len()) {
                return Err(Error::Text("unknown character".into()));
            }
            Ok(vec![t.len() as u32])
        })
    }

    #[test]
    fn results_come_in_stream_order_for_any_number_of_workers() {
        let expected: Vec<u32> = (0..200).map(|i| (i % 7 + 1) as u32).collect();
        for workers in [1, 2, 5] {
            let mut got = Vec::new();
            tokenize_in_order(docs(200).into_iter(), &tokenizer(None), workers, |ids| {
                got.extend(ids);
                Ok(())
            })
            .unwrap();
            assert_eq!(got, expected, "{workers} workers");
        }
    }

    #[test]
    fn the_first_error_in_stream_order_stops_the_pipeline_and_names_the_document() {
        let mut got = 0;
        // Lengths 1..=7 repeat; the first of length 5 is document 5 (position 5).
        let e = tokenize_in_order(docs(500).into_iter(), &tokenizer(Some(5)), 3, |_| {
            got += 1;
            Ok(())
        })
        .unwrap_err()
        .to_string();
        assert_eq!(got, 4);
        assert!(
            e.contains("mem.txt:5: cannot tokenize the document: unknown character"),
            "{e}"
        );

        let mut stream = docs(10);
        stream[6] = Err(Error::Text("bad line".into()));
        let e = tokenize_in_order(stream.into_iter(), &tokenizer(None), 2, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert_eq!(e, "bad line");

        // A failing sink stops the readers too (the test would hang otherwise).
        let e = tokenize_in_order(docs(10_000).into_iter(), &tokenizer(None), 2, |_| {
            Err(Error::Text("disk full".into()))
        })
        .unwrap_err();
        assert_eq!(e.to_string(), "disk full");

        let panicking: TokenizeFn = Arc::new(|_: &Content| panic!("boom"));
        let e = tokenize_in_order(docs(50).into_iter(), &panicking, 2, |_| Ok(()))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("mem.txt:1: cannot tokenize the document: the tokenizer panicked"),
            "{e}"
        );
        assert!(tokenize_in_order(docs(1).into_iter(), &tokenizer(None), 0, |_| Ok(())).is_err());
    }
}
