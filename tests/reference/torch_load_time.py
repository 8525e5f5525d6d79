#!/usr/bin/env python3
"""PyTorch's side of `distmind bench load` (the paper's figure 11b).

Builds the family's torchvision / Hugging Face model on the CPU (the same
builders as torch_reference.py), fills it with a distmind package's weights
(its standard weights.safetensors; tensors whose shape differs from the
PyTorch model's are left out and counted), then times, from bytes already
in memory, median of --repeat:
  whole_model_load_ms   torch.load of torch.save(model): a whole pickled
                        model, as the paper's MPS baseline keeps its models;
  state_dict_load_ms    torch.load of the state dict, then load_state_dict
                        into a model built beforehand (not timed).
Prints one JSON line last.

    torch_load_time.py --family F --weights DIR/<name>/weights.safetensors [--repeat N]

Needs tests/reference/requirements-torch.txt.
"""

import argparse
import io
import json
import os
import statistics
import sys
import time

import safetensors.torch
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_reference import build_model  # noqa: E402


def timed_ms(fn):
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True)
    ap.add_argument("--weights", required=True, help="a distmind package's weights.safetensors")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    if a.repeat < 1:
        ap.error("--repeat must be at least 1")
    torch.manual_seed(0)
    model, _ = build_model(a.family, "full")
    model.eval()
    own = model.state_dict()
    with open(a.weights, "rb") as f:
        loaded = safetensors.torch.load(f.read())
    usable = {k: v for k, v in loaded.items() if k in own and own[k].shape == v.shape}
    model.load_state_dict(usable, strict=False)

    whole = io.BytesIO()
    torch.save(model, whole)
    whole = whole.getvalue()
    state = io.BytesIO()
    torch.save(model.state_dict(), state)
    state = state.getvalue()
    target, _ = build_model(a.family, "full")

    def load_whole():
        torch.load(io.BytesIO(whole), weights_only=False)

    def load_state():
        target.load_state_dict(torch.load(io.BytesIO(state), weights_only=True))

    whole_ms = statistics.median(timed_ms(load_whole) for _ in range(a.repeat))
    state_ms = statistics.median(timed_ms(load_state) for _ in range(a.repeat))
    print(json.dumps({
        "whole_model_load_ms": whole_ms,
        "state_dict_load_ms": state_ms,
        "torch_version": torch.__version__,
        "tensors_from_package": len(usable),
        "tensors_left_out": len(loaded) - len(usable),
    }))


if __name__ == "__main__":
    main()
