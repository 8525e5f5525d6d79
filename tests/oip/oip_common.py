"""What the check_*.py scripts share: their arguments (see tests/oip.rs),
the expected outputs `distmind infer` computed, and the record of checks.
Not a check script itself: tests/oip.rs runs only check_*.py."""

import argparse
import json
import os
import sys

import numpy as np
from tritonclient.utils import InferenceServerException

# Frontend::BODY_BYTES_MAX of controller/src/oip/mod.rs.
BODY_BYTES_MAX = 64 << 20

_parser = argparse.ArgumentParser()
_parser.add_argument("--url", required=True, help="HOST:PORT of the endpoint checked")
_parser.add_argument("--models-dir", required=True)
_parser.add_argument("--expected-dir", required=True)
_parser.add_argument("--token", default=None)
args = _parser.parse_args()

with open(os.path.join(args.expected_dir, "models.json")) as f:
    MODELS = json.load(f)

failures = []


def check(cond, what):
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)


def close(got, want):
    """As tests/runtime.rs compares the GPU server with `distmind infer`."""
    if got is None or got.shape != want.shape or got.dtype != want.dtype:
        return False
    if want.dtype.kind == "f":
        return bool(np.all(np.abs(got - want) <= 1e-6 * np.maximum(np.abs(want), 1.0)))
    return bool(np.array_equal(got, want))


def load(name):
    """An expected array (`M.input.npy`, `M.<output>.npy`)."""
    return np.load(os.path.join(args.expected_dir, name))


def expect_raised(what, call, status, words):
    """`call()` raises tritonclient's error with `status` (its text: "413",
    "StatusCode.NOT_FOUND") and a message holding every one of `words`."""
    try:
        call()
        check(False, f"{what}: no error raised")
        return
    except InferenceServerException as e:
        msg = e.message() or ""
        check(
            e.status() == status and all(w in msg for w in words),
            f"{what}: tritonclient raises {e.status()} {msg!r}",
        )


def finish(protocol):
    """Exits 1 naming every failed check, else says all passed."""
    if failures:
        print(f"{len(failures)} checks failed:", *failures, sep="\n  ")
        sys.exit(1)
    print(f"all {protocol} checks passed")
