"""Writes tests/fixtures/llama-dir/: a tiny LlamaForCausalLM saved by transformers' save_pretrained
in several shards with an index (what `--model DIR` reads), and what transformers computes with it,
so the Rust tests check the loaded weights and the packed (segment-aware) forward against an
independent implementation without torch.

  config.json, generation_config.json          as save_pretrained writes them
  model-0000N-of-0000M.safetensors             the weights, f32, in M >= 2 shards
  model.safetensors.index.json                 metadata.total_size and the weight_map
  tokenizer files                              copied from tests/fixtures/text/tokenizer/ when that
                                               directory exists (the tokenizer the text tests use)
  tokens.safetensors    input_ids [4, 12] int64
  packed.safetensors    input_ids [3, 16] int64 and segment_ids [3, 16] int64: row 0 holds three
                        documents (5, 7 and 4 tokens), row 1 one of 10 then 6 padding tokens,
                        row 2 padding only (segment 0)
  reference.safetensors
      loss                 [] the causal-LM loss on tokens (labels = input_ids, shifted, mean)
      logits               [4, 12, vocab]
      packed_logits        [3, 16, vocab] of the packed rows, each document attending only to its
                           own earlier tokens (a 4D mask) with positions restarting at 0 (position
                           ids), as run_clm with document boundaries would; at padding the row
                           attends to itself only (values not compared)
      packed_token_loss    [3, 16] the cross-entropy of predicting token t+1 at t where t and t+1
                           are in the same document, else 0
      packed_grad.<name>   the gradient of the sum of packed_token_loss for every parameter

Usage (from the repository root):
  /work/main/target/torch-venv/bin/python tests/python/make_llama_dir_fixture.py [OUT_DIR]
Needs torch, transformers (5.x) and safetensors.
"""

import glob
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_llama_fixture import tiny_llama  # noqa: E402

# Small enough that the ~140 KB of weights are split into several shards.
MAX_SHARD_SIZE = "40KB"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
)


def packed_batch(vocab: int):
    lengths = [[5, 7, 4], [10], []]
    t = 16
    input_ids = torch.randint(0, vocab, (len(lengths), t), dtype=torch.int64)
    segment_ids = torch.zeros((len(lengths), t), dtype=torch.int64)
    for row, docs in enumerate(lengths):
        start = 0
        for i, n in enumerate(docs):
            segment_ids[row, start : start + n] = i + 1
            start += n
    return input_ids, segment_ids


def positions_and_mask(segment_ids: torch.Tensor, dtype: torch.dtype):
    """Position ids restarting at each document, and the additive 4D mask [B, 1, T, T]: query i sees
    key j <= i of its own document; a padding query sees itself only."""
    b, t = segment_ids.shape
    position_ids = torch.zeros_like(segment_ids)
    allowed = torch.zeros((b, t, t), dtype=torch.bool)
    for row in range(b):
        for i in range(t):
            s = segment_ids[row, i].item()
            if s == 0:
                allowed[row, i, i] = True
                continue
            start = i
            while start > 0 and segment_ids[row, start - 1].item() == s:
                start -= 1
            position_ids[row, i] = i - start
            allowed[row, i, start : i + 1] = True
    mask = torch.zeros((b, 1, t, t), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
    return position_ids, mask


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    fixtures = os.path.join(here, "..", "fixtures")
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(fixtures, "llama-dir")
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(out)
    # The text tests' tokenizer, when it is there, gives the special token ids.
    tokenizer_dir = os.path.join(fixtures, "text", "tokenizer")
    bos, eos = 1, 2
    if os.path.isdir(tokenizer_dir):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        assert len(tokenizer) <= 256, f"the tokenizer has {len(tokenizer)} tokens, the model 256"
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    model = tiny_llama(seed=4321, vocab=256, intermediate=64, bos=bos, eos=eos)
    config = model.config
    model.save_pretrained(out, safe_serialization=True, max_shard_size=MAX_SHARD_SIZE)
    shards = sorted(glob.glob(os.path.join(out, "model-*-of-*.safetensors")))
    assert len(shards) >= 2, f"expected several shards, got {shards}"
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))

    if os.path.isdir(tokenizer_dir):
        for name in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, name)
            if os.path.exists(src):
                shutil.copyfile(src, os.path.join(out, name))

    input_ids = torch.randint(0, config.vocab_size, (4, 12), dtype=torch.int64)
    save_file({"input_ids": input_ids}, os.path.join(out, "tokens.safetensors"))
    packed_ids, segment_ids = packed_batch(config.vocab_size)
    save_file(
        {"input_ids": packed_ids, "segment_ids": segment_ids},
        os.path.join(out, "packed.safetensors"),
    )

    model.train()
    with torch.no_grad():
        plain = model(input_ids=input_ids, labels=input_ids)
    reference = {
        "loss": plain.loss.detach().clone(),
        "logits": plain.logits.detach().clone().contiguous(),
    }

    position_ids, mask = positions_and_mask(segment_ids, torch.float32)
    packed = model(input_ids=packed_ids, attention_mask=mask, position_ids=position_ids)
    logits = packed.logits
    predicted = (segment_ids[:, :-1] == segment_ids[:, 1:]) & (segment_ids[:, :-1] != 0)
    per_token = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, config.vocab_size),
        packed_ids[:, 1:].reshape(-1),
        reduction="none",
    ).reshape(predicted.shape)
    per_token = torch.where(predicted, per_token, torch.zeros_like(per_token))
    per_token.sum().backward()
    token_loss = torch.zeros(segment_ids.shape, dtype=torch.float32)
    token_loss[:, :-1] = per_token.detach()
    reference["packed_logits"] = logits.detach().clone().contiguous()
    reference["packed_token_loss"] = token_loss
    for name, p in model.named_parameters():
        reference["packed_grad." + name] = p.grad.detach().clone().contiguous()
    save_file(reference, os.path.join(out, "reference.safetensors"))

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    print(
        f"loss {plain.loss.item():.6f}; packed loss sum {per_token.sum().item():.6f} over "
        f"{int(predicted.sum())} tokens; {len(shards)} shards, "
        f"{len(index['weight_map'])} tensors; wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
