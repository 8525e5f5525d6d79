#!/usr/bin/env python3
"""Regenerates tests/golden/<family>/{input.npy, output.npy, meta.json}.

    cargo build --release
    python3 tests/reference/make_golden.py [--bin target/release/distmind] [FAMILY ...]

For each family at tiny scale: writes the package with the project's own
generator (`distmind model gen --family F --scale tiny --seed 7`), draws a
seeded input, runs the NumPy reference (forward.py) and stores the model's
last output. meta.json records the manifest's group checksums so that
tests/numerics.rs notices when the generator (and so the weights) changed.
"""

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
import forward as F  # noqa: E402

FAMILIES = ["resnet152", "inception_v3", "densenet201", "bert_base", "gpt2"]
SEED = 7          # weights (distmind model gen --seed)
INPUT_SEED = 7    # numpy.random.default_rng(INPUT_SEED) for the input


def make_input(manifest, seed):
    spec = manifest["inputs"][0]
    rng = np.random.default_rng(seed)
    if spec["dtype"] == "I64":
        vocab = manifest["config"]["vocab_size"]
        return rng.integers(0, vocab, size=spec["shape"], dtype=np.int64)
    if spec["dtype"] == "F32":
        return rng.uniform(-1.0, 1.0, size=spec["shape"]).astype(np.float32)
    raise ValueError(f"unsupported input dtype {spec['dtype']}")


def gen_package(binary, family, out):
    cmd = [binary, "--log-level", "warn", "model", "gen", "--family", family,
           "--scale", "tiny", "--seed", str(SEED), "--out", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    dirs = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
    if len(dirs) != 1:
        raise RuntimeError(f"expected one package under {out}, found {dirs}")
    return os.path.join(out, dirs[0]), cmd


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(REPO, "target", "release", "distmind"))
    ap.add_argument("--out", default=os.path.join(REPO, "tests", "golden"))
    ap.add_argument("families", nargs="*", default=FAMILIES)
    args = ap.parse_args()
    if not os.path.exists(args.bin):
        sys.exit(f"{args.bin} not found: run `cargo build --release` first")

    for family in args.families:
        with tempfile.TemporaryDirectory() as tmp:
            pkg, cmd = gen_package(args.bin, family, tmp)
            manifest, weights = F.load_package(pkg)
            x = make_input(manifest, INPUT_SEED)
            outs = F.forward(manifest, weights, [x])
            y = outs[-1]
            dest = os.path.join(args.out, family)
            os.makedirs(dest, exist_ok=True)
            np.save(os.path.join(dest, "input.npy"), x)
            np.save(os.path.join(dest, "output.npy"), y)
            # The same path forward.py's command line takes, as a self-check.
            rerun = os.path.join(tmp, "rerun.npy")
            subprocess.run([sys.executable, os.path.join(HERE, "forward.py"), pkg,
                            os.path.join(dest, "input.npy"), rerun], check=True)
            assert np.array_equal(np.load(rerun), y), "forward.py CLI disagrees with forward()"
            cmd_str = " ".join(["distmind"] + cmd[1:-1] + ["DIR"])
            meta = {
                "family": family,
                "package": manifest["name"],
                "scale": manifest["scale"],
                "seed": SEED,
                "input_seed": INPUT_SEED,
                "input": {
                    "name": manifest["inputs"][0]["name"],
                    "shape": list(x.shape),
                    "dtype": str(x.dtype),
                    "how": ("numpy.random.default_rng(input_seed).integers(0, vocab_size, shape, int64)"
                            if x.dtype == np.int64 else
                            "numpy.random.default_rng(input_seed).uniform(-1, 1, shape).astype(float32)"),
                },
                "output": {
                    "name": manifest["outputs"][-1]["name"],
                    "layer": manifest["outputs"][-1]["layer"],
                    "shape": list(y.shape),
                    "dtype": str(y.dtype),
                },
                "group_checksums": [g["checksum"] for g in manifest["groups"]],
                "generator_command": cmd_str,
                "reference_command": "python3 tests/reference/forward.py DIR input.npy output.npy",
                "regenerate": "cargo build --release && python3 tests/reference/make_golden.py",
                "numpy_version": np.__version__,
                "python_version": platform.python_version(),
                "date": datetime.date.today().isoformat(),
            }
            with open(os.path.join(dest, "meta.json"), "w") as f:
                json.dump(meta, f, indent=2)
                f.write("\n")
            print(f"{family}: {manifest['name']} input {list(x.shape)} {x.dtype} -> "
                  f"output {list(y.shape)} max|y| {float(np.abs(y).max()):.4g}")


if __name__ == "__main__":
    main()
