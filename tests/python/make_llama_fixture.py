"""Writes the fixtures of the `llama` tests (tests/fixtures/llama/) with Hugging Face transformers:
a tiny LlamaForCausalLM with seeded random weights, a batch of tokens, and what transformers
computes on it, so the Rust tests compare against an independent implementation without torch.

  config.json          the config as transformers 5.x writes it (rope_theta under rope_parameters)
  config_v4.json       the same model as transformers 4.x writes it (rope_theta at the top level)
  model.safetensors    the weights, f32, Hugging Face names
  tokens.safetensors   input_ids [4, 12] int64
  reference.safetensors
      loss                     [] the causal-LM loss with labels = input_ids (shifted, mean)
      logits                   [4, 12, vocab]
      grad.<name>              the gradient of the loss for every parameter
      after_sgd.<name>         every parameter after one SGD step (lr 0.1, no momentum) on the batch

Usage (from the repository root): python3 tests/python/make_llama_fixture.py [OUT_DIR]
Needs torch, transformers (5.x) and safetensors.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

LR = 0.1


def tiny_llama(seed: int, vocab: int, intermediate: int, bos, eos) -> LlamaForCausalLM:
    """The tests' tiny LlamaForCausalLM (f32, eager attention), its weights drawn from `seed`:
    large enough that attention is far from uniform and every gradient is well above rounding,
    norm weights away from 1 so a model that ignored them would not match."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        # Not the default 10000, so a model that ignored the config's theta would not match.
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=bos,
        eos_token_id=eos,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.config._attn_implementation = "eager"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(here, "..", "fixtures", "llama")
    os.makedirs(out, exist_ok=True)
    model = tiny_llama(seed=1234, vocab=32, intermediate=32, bos=None, eos=None)
    config = model.config
    model.save_pretrained(out, safe_serialization=True)
    # Not read by the tests (a training fixture has no generation settings).
    os.remove(os.path.join(out, "generation_config.json"))
    # save_pretrained's weights, as written: the test reads this file.
    names = sorted(load_file(os.path.join(out, "model.safetensors")).keys())
    params = dict(model.named_parameters())
    assert names == sorted(params), (names, sorted(params))

    input_ids = torch.randint(0, config.vocab_size, (4, 12), dtype=torch.int64)
    save_file({"input_ids": input_ids}, os.path.join(out, "tokens.safetensors"))

    model.train()
    out_model = model(input_ids=input_ids, labels=input_ids)
    out_model.loss.backward()
    reference = {
        "loss": out_model.loss.detach().clone(),
        "logits": out_model.logits.detach().clone().contiguous(),
    }
    for name in names:
        reference["grad." + name] = params[name].grad.detach().clone().contiguous()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.step()
    for name in names:
        reference["after_sgd." + name] = params[name].detach().clone().contiguous()
    save_file(reference, os.path.join(out, "reference.safetensors"))

    # The same config as transformers 4.x wrote it: rope_theta at the top level, rope_scaling null.
    with open(os.path.join(out, "config.json")) as f:
        v5 = json.load(f)
    v4 = dict(v5)
    rope = v4.pop("rope_parameters")
    v4["rope_theta"] = rope["rope_theta"]
    v4["rope_scaling"] = None
    v4["transformers_version"] = "4.46.3"
    with open(os.path.join(out, "config_v4.json"), "w") as f:
        json.dump(v4, f, indent=2, sort_keys=True)
        f.write("\n")
    print(f"loss {out_model.loss.item():.6f}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
