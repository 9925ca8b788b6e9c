"""Checks a `save_model` directory with Python's safetensors package (as a PyTorch user would read
it): every tensor named in expected.json is present with that shape, dtype and values, and nothing
else; a sharded save has a Hugging Face index whose total_size and weight_map agree with the shards.

Usage: check_save_model.py MODEL_DIR EXPECTED_JSON
"""

import json
import os
import sys

import numpy as np
from safetensors.numpy import load_file


def main() -> int:
    model_dir, expected_path = sys.argv[1], sys.argv[2]
    with open(expected_path) as f:
        expected = json.load(f)
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    tensors = {}
    if os.path.exists(index_path):
        with open(index_path) as f:
            index = json.load(f)
        weight_map = index["weight_map"]
        for shard in sorted(set(weight_map.values())):
            for name, array in load_file(os.path.join(model_dir, shard)).items():
                assert weight_map.get(name) == shard, f"{name} is in {shard}, index says {weight_map.get(name)}"
                tensors[name] = array
        total = sum(a.nbytes for a in tensors.values())
        assert index["metadata"]["total_size"] == total, f"total_size {index['metadata']['total_size']} != {total}"
        assert set(weight_map) == set(tensors), "weight_map and shards name different tensors"
    else:
        tensors = load_file(os.path.join(model_dir, "model.safetensors"))
    assert set(tensors) == set(expected), f"names {sorted(tensors)} != {sorted(expected)}"
    for name, want in expected.items():
        got = tensors[name]
        assert list(got.shape) == want["shape"], f"{name}: shape {got.shape} != {want['shape']}"
        assert str(got.dtype) == want["dtype"], f"{name}: dtype {got.dtype} != {want['dtype']}"
        values = np.array(want["values"], dtype=np.float32).reshape(want["shape"])
        assert np.array_equal(got, values), f"{name}: values differ"
    print(f"ok: {len(tensors)} tensors in {model_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
