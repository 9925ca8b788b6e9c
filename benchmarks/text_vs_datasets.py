#!/usr/bin/env python3
"""Hugging Face's side of the text-loading benchmark (`target/release/bench_text`): what
`run_clm.py` does to a JSON Lines corpus before training, timed on the same corpus with the same
tokenizer. `datasets.load_dataset("json")`, then `Dataset.map(tokenize, batched=True,
num_proc=N)`, then `group_texts` into rows of `--block-size` tokens (run_clm's two maps, EOS
appended to each document as our packing does). The cache is off, so every round tokenizes.

Prints one JSON line per worker count: documents, tokens, seconds of the tokenizing map, of the
grouping map, and tokens per second of both together (`tokens / (tokenize + group)`).

    python3 benchmarks/text_vs_datasets.py --tokenizer DIR --corpus FILE.jsonl [--workers 1,2,4]

Needs transformers and datasets. `bench_text` runs it itself when given `--python`.
"""

import argparse
import json
import time
from itertools import chain


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    parser.add_argument("--corpus", required=True, help="a JSON Lines file with a `text` field")
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--workers", default="1,2,4", help="num_proc values, comma-separated")
    args = parser.parse_args()

    import datasets
    from transformers import AutoTokenizer

    datasets.disable_caching()
    datasets.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    eos = tokenizer.eos_token_id
    block = args.block_size

    def tokenize(batch):
        ids = tokenizer(batch["text"])["input_ids"]
        return {"input_ids": [x if x and x[-1] == eos else x + [eos] for x in ids]}

    def group_texts(batch):
        joined = list(chain(*batch["input_ids"]))
        total = len(joined) // block * block
        return {"input_ids": [joined[i : i + block] for i in range(0, total, block)]}

    raw = datasets.load_dataset("json", data_files=args.corpus, split="train")
    for workers in [int(w) for w in args.workers.split(",")]:
        proc = workers if workers > 1 else None
        start = time.perf_counter()
        tokenized = raw.map(tokenize, batched=True, num_proc=proc, remove_columns=raw.column_names)
        mid = time.perf_counter()
        grouped = tokenized.map(group_texts, batched=True, num_proc=proc)
        end = time.perf_counter()
        tokens = sum(len(x) for x in tokenized["input_ids"])
        print(
            json.dumps(
                {
                    "side": "datasets.map",
                    "workers": workers,
                    "documents": len(raw),
                    "tokens": tokens,
                    "rows": len(grouped),
                    "tokenize_s": round(mid - start, 4),
                    "group_s": round(end - mid, 4),
                    "tokens_per_s": round(tokens / (end - start), 1),
                }
            ),
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
