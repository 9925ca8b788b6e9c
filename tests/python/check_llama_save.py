"""Checks that transformers loads a `llama --save-model` directory unchanged: from_pretrained finds
every weight (no missing, unexpected or mismatched keys) and the config beside it, and the loaded
model's causal-LM loss on a batch of tokens is the one the test computed with our model.

Usage: check_llama_save.py MODEL_DIR TOKENS_SAFETENSORS EXPECTED_LOSS
Prints "ok loss=..." on success.
"""

import sys

import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM


def main() -> int:
    model_dir, tokens_path, expected = sys.argv[1], sys.argv[2], float(sys.argv[3])
    model, info = LlamaForCausalLM.from_pretrained(
        model_dir, output_loading_info=True, attn_implementation="eager", dtype=torch.float32
    )
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"loading {model_dir}: {problems}"
    input_ids = load_file(tokens_path)["input_ids"]
    with torch.no_grad():
        loss = model(input_ids=input_ids, labels=input_ids).loss.item()
    assert abs(loss - expected) <= 1e-4 * max(1.0, abs(expected)), f"loss {loss} vs ours {expected}"
    print(f"ok loss={loss:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
