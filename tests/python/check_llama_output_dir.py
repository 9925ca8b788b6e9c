"""Checks that transformers loads a `llama --output-dir` directory unchanged: from_pretrained
finds every weight (no missing, unexpected or mismatched keys; sharded or not) and the config, the
loaded model's causal-LM loss on a batch of tokens is the one our model computed, and, when the
directory holds tokenizer files, AutoTokenizer.from_pretrained loads them and encodes text.

Usage: check_llama_output_dir.py OUTPUT_DIR TOKENS_SAFETENSORS EXPECTED_LOSS
Prints "ok loss=..." (and the tokenizer's class and a few ids) on success.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaForCausalLM


def main() -> int:
    out, tokens_path, expected = sys.argv[1], sys.argv[2], float(sys.argv[3])
    model, info = LlamaForCausalLM.from_pretrained(
        out, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"loading {out}: {problems}"
    index = os.path.join(out, "model.safetensors.index.json")
    shards = len(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else 1
    input_ids = load_file(tokens_path)["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss.item()
    assert abs(loss - expected) <= 1e-4 * max(1.0, abs(expected)), f"loss {loss} vs ours {expected}"
    line = f"ok loss={loss:.6f} shards={shards}"
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        tokenizer = AutoTokenizer.from_pretrained(out)
        ids = tokenizer("Hello, world")["input_ids"]
        assert ids and max(ids) < model.config.vocab_size, ids
        line += f" tokenizer={type(tokenizer).__name__} ids={ids[:8]}"
    print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
