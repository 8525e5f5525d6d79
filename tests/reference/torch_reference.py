#!/usr/bin/env python3
"""PyTorch reference for `distmind model import`.

Builds one model family in PyTorch (torchvision or Hugging Face transformers,
random init, nothing downloaded), saves its state_dict as a safetensors
checkpoint, runs a fixed seeded input in eval mode and saves the outputs.
The Rust importer must reproduce these outputs from the checkpoint to a
relative error of 1e-4 (max|a - b| / max|b|).

    torch_reference.py --family F --size {reduced,full} --out DIR
                       [--dtype f32|f16|bf16] [--batch N] [--seq-len L] [--image-size S]
    torch_reference.py --goldens   # rewrites tests/golden/import/<case>/
    torch_reference.py --family {bert_base,gpt2} --seq-lens 16,64,128 --max-positions 128 --out DIR

With --seq-lens, one checkpoint answers several sequence lengths: DIR gets
input.L<n>.npy and output.L<n>.npy (and BERT's output.L<n>.last_hidden_state.npy)
per length, and meta.json lists them under "seq_cases".

Files written into DIR:
  model.safetensors             model.state_dict() as is (buffers included),
                                floating tensors rounded to --dtype
  config.json                   Hugging Face config (transformers only)
  input.npy                     float32 NCHW images U(-1, 1), or int64 token ids
  output.npy                    the model's last output, float32
  output.last_hidden_state.npy  BERT only
  meta.json                     shapes, seeds, importer arguments, versions
  <output>.f64.npy              with --f64: the same model and input in float64

With --dtype f16/bf16 the forward pass still runs in float32, on weights that
were first rounded to the half type (PyTorch's own widening), so a package
that keeps the half weights and widens them exactly on the device, or an
import that widens them to f32 (--widen), matches to float32 tolerance.

Needs tests/reference/requirements-torch.txt (torch, torchvision,
transformers, safetensors, numpy).
"""

import argparse
import functools
import json
import math
import os
import platform
import shlex
import shutil
import sys
import time

import numpy as np
import safetensors
import safetensors.torch
import torch
import torch.nn as nn
import torchvision
import torchvision.models.densenet as tv_densenet
import torchvision.models.inception as tv_inception
import torchvision.models.resnet as tv_resnet
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
GOLDEN_DIR = os.path.join(REPO, "tests", "golden", "import")

FAMILIES = ["resnet152", "inception_v3", "densenet201", "bert_base", "gpt2"]
CNNS = {"resnet152", "inception_v3", "densenet201"}
DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}

TORCH_SEED = 0       # torch.manual_seed before building the model
# torch.Generator for the extra randomization below. With seed 3 no
# BatchNorm+ReLU of the reduced CNNs is all zero on the golden input, so every
# conv is exercised (checked with forward hooks).
RANDOMIZE_SEED = 3
INPUT_SEED = 7       # numpy.random.default_rng for the input
DATE = "2026-11-21"
# Cases checked in later than DATE, with the date they were written.
CASE_DATES = {"resnet152_bf16": "2026-11-25"}

# Checked-in cases for --goldens: case name -> (family, size, dtype).
GOLDEN_CASES = {
    "resnet152": ("resnet152", "reduced", "f32"),
    "inception_v3": ("inception_v3", "reduced", "f32"),
    "densenet201": ("densenet201", "reduced", "f32"),
    "bert_base": ("bert_base", "reduced", "f32"),
    "gpt2": ("gpt2", "reduced", "f32"),
    "resnet152_f16": ("resnet152", "reduced", "f16"),
    "gpt2_bf16": ("gpt2", "reduced", "bf16"),
    # BatchNorm running statistics in bf16 too: the CNN half of the bf16 check.
    "resnet152_bf16": ("resnet152", "reduced", "bf16"),
}

# Checked-in per-request-length cases for --goldens: case name -> family.
# One reduced checkpoint with a 128-row position table answers 16, 64 and 128
# tokens; the package is imported at SEQ_CASE_IMPORT_LEN (its default length).
SEQ_GOLDEN_CASES = {"bert_base_seqs": "bert_base", "gpt2_seqs": "gpt2"}
SEQ_CASE_LENS = [16, 64, 128]
SEQ_CASE_MAX_POSITIONS = 128
SEQ_CASE_IMPORT_LEN = 64
SEQ_CASE_DATE = "2026-11-25"

DEFAULT_BATCH = 2
DEFAULT_IMAGE = {
    ("resnet152", "full"): 224, ("densenet201", "full"): 224, ("inception_v3", "full"): 299,
    ("resnet152", "reduced"): 32, ("densenet201", "reduced"): 32, ("inception_v3", "reduced"): 75,
}
DEFAULT_SEQ = {"full": 128, "reduced": 16}

CALIBRATION_SEED = 8  # numpy.random.default_rng for the BatchNorm calibration input

RANDOMIZATION = (
    f"after default init, with torch.Generator().manual_seed({RANDOMIZE_SEED}) in model.modules() order: "
    "every BatchNorm gets weight ~ U(0.5, 1.5), bias ~ N(0, 0.1), then running statistics from "
    f"one training-mode pass (momentum None) over an input from default_rng({CALIBRATION_SEED}) "
    "of the test input's shape, mean m and variance v, stored as running_mean = u m and "
    "running_var = v + ((1 - u) m)^2 with u ~ U(0, 0.5) (unit RMS, no catastrophic cancellation); "
    "for the transformers every 1-D parameter "
    "(biases, LayerNorm weight and bias) in named_parameters() order gets += N(0, 0.02)"
)


# ---------------------------------------------------------------- reduced CNNs

class ReducedResNet(tv_resnet.ResNet):
    """torchvision's ResNet.__init__ with narrower widths.

    Stem width 8 and stage widths 8, 16, 32, 64 instead of 64..512. The
    blocks come from torchvision's own `_make_layer` and `Bottleneck`, and
    `forward` is inherited, so the module tree and key names are those of
    resnet152.
    """

    def __init__(self, layers=(1, 1, 1, 1), num_classes=10, widths=(8, 16, 32, 64), stem=8):
        nn.Module.__init__(self)  # skip ResNet.__init__, mirror it below
        block = tv_resnet.Bottleneck
        self._norm_layer = nn.BatchNorm2d
        self.inplanes = stem
        self.dilation = 1
        self.groups = 1
        self.base_width = 64  # Bottleneck's width = planes * base_width / 64 = planes
        self.conv1 = nn.Conv2d(3, self.inplanes, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, widths[0], layers[0])
        self.layer2 = self._make_layer(block, widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(block, widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(block, widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * block.expansion, num_classes)  # 256 -> 10
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)


INCEPTION_DIVISOR = 16


def _div_channels(n):
    # The image's 3 input channels are the only 3 in the network; keep them.
    return n if n == 3 else math.ceil(n / INCEPTION_DIVISOR)


def div_conv(in_c, out_c, **kw):
    """torchvision's BasicConv2d with both channel counts divided by 16."""
    return tv_inception.BasicConv2d(_div_channels(in_c), _div_channels(out_c), **kw)


def reduced_inception():
    # Every block class is torchvision's own; only the convolutions they build
    # are narrower. With divisor 16 each block's concatenated output equals
    # the next block's divided input (e.g. 192/16 = 12 in, 4+4+6+2 = 16 = 256/16
    # out), so the stock Inception3 wiring still holds.
    blocks = [div_conv] + [
        functools.partial(cls, conv_block=div_conv)
        for cls in (tv_inception.InceptionA, tv_inception.InceptionB, tv_inception.InceptionC,
                    tv_inception.InceptionD, tv_inception.InceptionE, tv_inception.InceptionAux)
    ]
    model = tv_inception.Inception3(num_classes=10, aux_logits=False, transform_input=False,
                                    init_weights=True, inception_blocks=blocks)
    model.fc = nn.Linear(2048 // INCEPTION_DIVISOR, 10)
    return model


# ---------------------------------------------------------------- transformers

def bert_config(size, max_positions=64):
    if size == "full":
        return transformers.BertConfig(attn_implementation="eager")
    return transformers.BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=max_positions, type_vocab_size=2,
        layer_norm_eps=1e-12, hidden_act="gelu", pad_token_id=0, attn_implementation="eager")


def gpt2_config(size, max_positions=64):
    if size == "full":
        return transformers.GPT2Config(attn_implementation="eager")
    # The default bos/eos id 50256 lies outside a 100-token vocabulary and
    # makes transformers warn; use the last id instead.
    return transformers.GPT2Config(
        vocab_size=100, n_positions=max_positions, n_embd=32, n_layer=2, n_head=2, n_inner=64,
        layer_norm_epsilon=1e-5, activation_function="gelu_new",
        bos_token_id=99, eos_token_id=99, attn_implementation="eager")


def build_model(family, size, max_positions=None):
    """Returns (model, config or None). Call after torch.manual_seed.

    `max_positions` (reduced transformers only) replaces the 64-row position
    table."""
    if max_positions is not None and (family in CNNS or size != "reduced"):
        raise ValueError("--max-positions applies only to reduced bert_base and gpt2")
    positions = {} if max_positions is None else {"max_positions": max_positions}
    if family == "resnet152":
        return (torchvision.models.resnet152(weights=None) if size == "full" else ReducedResNet()), None
    if family == "inception_v3":
        if size == "full":
            # Default aux_logits=True keeps AuxLogits.* in the checkpoint like a
            # real one; in eval mode forward returns only the logits.
            return torchvision.models.inception_v3(weights=None, init_weights=True), None
        return reduced_inception(), None
    if family == "densenet201":
        if size == "full":
            return torchvision.models.densenet201(weights=None), None
        return tv_densenet.DenseNet(growth_rate=4, block_config=(1, 2, 2, 1), num_init_features=8,
                                    bn_size=4, num_classes=10), None
    if family == "bert_base":
        config = bert_config(size, **positions)
        return transformers.BertModel(config, add_pooling_layer=True), config
    if family == "gpt2":
        config = gpt2_config(size, **positions)
        return transformers.GPT2Model(config), config
    raise ValueError(f"unknown family {family}")


@torch.no_grad()
def randomize(model, family, calibration):
    """Makes parameters that default init leaves trivial matter.

    Fresh BatchNorms are the identity in eval mode (mean 0, var 1, weight 1,
    bias 0), and transformers start with zero biases and unit LayerNorms, so
    an importer could get those wrong unnoticed. CNNs: every BatchNorm gets a
    random affine, then its running statistics from one training-mode pass
    over `calibration` (another input than the test's), as training leaves
    them: activations stay normalized through the full-depth networks
    instead of growing to 1e11 with the identity statistics.
    """
    gen = torch.Generator().manual_seed(RANDOMIZE_SEED)

    def normal(t, std):
        return torch.randn(t.shape, generator=gen) * std

    def uniform(t, lo, hi):
        return torch.rand(t.shape, generator=gen) * (hi - lo) + lo

    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.weight.copy_(uniform(m.weight, 0.5, 1.5))
        m.bias.copy_(normal(m.bias, 0.1))
    if bns:
        for m in bns:
            m.reset_running_stats()
            m.momentum = None  # cumulative average: the pass's exact statistics
        model.train()
        model(torch.from_numpy(calibration))
        model.eval()
        # Subtract only part of each channel's mean (u ~ U(0, 0.5)) and scale
        # to unit RMS. Full batch statistics of noise images make the deep
        # layers nearly constant per channel, so `x - mean` cancels and
        # amplifies rounding: PyTorch's own float32 output then differs from
        # its float64 output by 3e-4 on ResNet-152, and no float32
        # implementation could be checked to 1e-4 against it.
        for m in bns:
            u = uniform(m.running_mean, 0.0, 0.5)
            mean, var = m.running_mean.clone(), m.running_var.clone()
            m.running_mean.copy_(u * mean)
            m.running_var.copy_(var + ((1 - u) * mean) ** 2)
            m.momentum = 0.1
    if family not in CNNS:
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(normal(p, 0.02))


# ---------------------------------------------------------------- one case

def make_input(family, config, batch, image_size, seq_len):
    rng = np.random.default_rng(INPUT_SEED)
    if family in CNNS:
        return rng.uniform(-1.0, 1.0, (batch, 3, image_size, image_size)).astype(np.float32)
    return rng.integers(0, config.vocab_size, (batch, seq_len), dtype=np.int64)


@torch.no_grad()
def round_weights(model, dtype):
    """Rounds every floating tensor of the state_dict to `dtype`.

    Returns the state_dict to save (floating tensors in `dtype`, integer
    buffers untouched) and loads the rounded values, widened back to float32,
    into the model so the reference forward runs in float32 on them.
    """
    saved = {}
    for name, t in model.state_dict().items():
        t = t.detach().contiguous()
        if t.is_floating_point() and dtype != torch.float32:
            t = t.to(dtype)
        saved[name] = t.clone()
    if dtype != torch.float32:
        model.load_state_dict({k: (v.float() if v.is_floating_point() else v) for k, v in saved.items()})
    return saved


def versions():
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def check_output(name, arr):
    if not np.all(np.isfinite(arr)):
        raise RuntimeError(f"{name} has non-finite values")
    if not np.any(arr != 0):
        raise RuntimeError(f"{name} is all zero")


def run_case(family, size, out, dtype="f32", batch=None, image_size=None, seq_len=None, command=None,
             f64=False, date=DATE):
    batch = batch or DEFAULT_BATCH
    if family in CNNS:
        image_size = image_size or DEFAULT_IMAGE[(family, size)]
        seq_len = None
    else:
        seq_len = seq_len or DEFAULT_SEQ[size]
        image_size = None

    start = time.time()
    torch.manual_seed(TORCH_SEED)
    model, config = build_model(family, size)
    calibration = None
    if family in CNNS:
        calibration = np.random.default_rng(CALIBRATION_SEED).uniform(
            -1.0, 1.0, (batch, 3, image_size, image_size)).astype(np.float32)
    randomize(model, family, calibration)
    model = model.float().eval()
    state = round_weights(model, DTYPES[dtype])

    x = make_input(family, config, batch, image_size, seq_len)
    with torch.no_grad():
        y = model(torch.from_numpy(x))

    # (file, name, array); the last one is the model's last output.
    if family in CNNS:
        if not isinstance(y, torch.Tensor):  # e.g. InceptionOutputs if not in eval mode
            raise RuntimeError(f"{family}: expected a tensor from eval forward, got {type(y)}")
        outputs = [("output.npy", "logits", y)]
    elif family == "bert_base":
        outputs = [("output.last_hidden_state.npy", "last_hidden_state", y.last_hidden_state),
                   ("output.npy", "pooler_output", y.pooler_output)]
    else:
        outputs = [("output.npy", "last_hidden_state", y.last_hidden_state)]

    if f64:
        # The same weights and input in float64: what the float32 results
        # (PyTorch's and the importer's) are measured against for conditioning.
        with torch.no_grad():
            y64 = model.double()(torch.from_numpy(x).double() if family in CNNS else torch.from_numpy(x))
        model.float()
        if family in CNNS:
            exact = [y64]
        elif family == "bert_base":
            exact = [y64.last_hidden_state, y64.pooler_output]
        else:
            exact = [y64.last_hidden_state]
    os.makedirs(out, exist_ok=True)
    safetensors.torch.save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        config.to_json_file(os.path.join(out, "config.json"))
    np.save(os.path.join(out, "input.npy"), x)
    out_meta = []
    for i, (fname, name, t) in enumerate(outputs):
        arr = t.detach().float().contiguous().numpy()
        check_output(f"{family}.{name}", arr)
        np.save(os.path.join(out, fname), arr)
        entry = {"file": fname, "name": name, "shape": list(arr.shape)}
        print(f"  {family} {size} {dtype}: {name} {list(arr.shape)} max|v| = {np.abs(arr).max():.6g}")
        if f64:
            # Rounded to float32 for the readers; that rounding (6e-8) is far
            # below the differences measured against it.
            exact_arr = exact[i].detach().float().contiguous().numpy()
            entry["f64_file"] = fname.replace(".npy", ".f64.npy")
            np.save(os.path.join(out, entry["f64_file"]), exact_arr)
            rel = np.abs(arr - exact_arr).max() / np.abs(exact_arr).max()
            print(f"  {family} {size} {dtype}: {name} PyTorch float32 vs float64: max rel err {rel:.2e}")
        out_meta.append(entry)

    if family in CNNS:
        import_args = ["--batch-size", str(batch), "--image-size", str(image_size)]
    else:
        import_args = ["--batch-size", str(batch), "--seq-len", str(seq_len)]
    meta = {
        "family": family,
        "size": size,
        "dtype": dtype,
        "batch": batch,
        "image_size": image_size,
        "seq_len": seq_len,
        "import_args": import_args,
        "config": "config.json" if config is not None else None,
        "input": {"file": "input.npy", "shape": list(x.shape), "dtype": str(x.dtype),
                  "note": ("float32 NCHW uniform(-1, 1)" if family in CNNS else
                           "int64 token ids in [0, vocab_size); only input_ids are passed "
                           "(no attention mask, token_type_ids default to 0)")},
        "outputs": out_meta,
        "torch_seed": TORCH_SEED,
        "randomize_seed": RANDOMIZE_SEED,
        "input_seed": INPUT_SEED,
        "randomization": RANDOMIZATION,
        "weights_note": ("floating tensors saved as float32" if dtype == "f32" else
                         f"floating tensors rounded to {dtype} and saved as {dtype}; integer buffers "
                         "unchanged; the reference forward ran in float32 on the rounded weights"),
        "tolerance": "max|a - b| / max|b| <= 1e-4",
        "command": command,
        "versions": versions(),
        "date": date,
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"  {family} {size} {dtype}: wrote {out} in {time.time() - start:.1f} s")


def run_seq_case(family, out, seq_lens, max_positions, batch=None, command=None, date=SEQ_CASE_DATE):
    """One reduced transformer checkpoint, one input and output per length.

    The model, its randomization and the checkpoint are those of `run_case`
    (reduced, f32) except the position table of `max_positions` rows; each
    length's token ids come from a fresh `default_rng(INPUT_SEED)`. The
    package imported from it must answer every length with these outputs.
    """
    if family in CNNS:
        raise ValueError("--seq-lens applies only to bert_base and gpt2")
    batch = batch or DEFAULT_BATCH
    for n in seq_lens:
        if not 1 <= n <= max_positions:
            raise ValueError(f"sequence length {n} is outside 1..={max_positions}")
    start = time.time()
    torch.manual_seed(TORCH_SEED)
    model, config = build_model(family, "reduced", max_positions)
    randomize(model, family, None)
    model = model.float().eval()
    state = round_weights(model, torch.float32)
    os.makedirs(out, exist_ok=True)
    safetensors.torch.save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(os.path.join(out, "config.json"))
    cases = []
    for n in seq_lens:
        x = make_input(family, config, batch, None, n)
        with torch.no_grad():
            y = model(torch.from_numpy(x))
        if family == "bert_base":
            outputs = [(f"output.L{n}.last_hidden_state.npy", "last_hidden_state", y.last_hidden_state),
                       (f"output.L{n}.npy", "pooler_output", y.pooler_output)]
        else:
            outputs = [(f"output.L{n}.npy", "last_hidden_state", y.last_hidden_state)]
        np.save(os.path.join(out, f"input.L{n}.npy"), x)
        out_meta = []
        for fname, name, t in outputs:
            arr = t.detach().float().contiguous().numpy()
            check_output(f"{family}.{name} L={n}", arr)
            np.save(os.path.join(out, fname), arr)
            out_meta.append({"file": fname, "name": name, "shape": list(arr.shape)})
            print(f"  {family} L={n}: {name} {list(arr.shape)} max|v| = {np.abs(arr).max():.6g}")
        cases.append({"seq_len": n, "input": {"file": f"input.L{n}.npy", "shape": list(x.shape),
                                              "dtype": str(x.dtype)},
                      "outputs": out_meta})
    import_len = SEQ_CASE_IMPORT_LEN if SEQ_CASE_IMPORT_LEN in seq_lens else seq_lens[0]
    meta = {
        "family": family,
        "size": "reduced",
        "dtype": "f32",
        "batch": batch,
        "max_positions": max_positions,
        "seq_lens": seq_lens,
        "import_args": ["--batch-size", str(batch), "--seq-len", str(import_len)],
        "import_note": ("--seq-len is the package's default (profiled) length; every request "
                        f"length up to the {max_positions}-row position table is served"),
        "config": "config.json",
        "input_note": ("int64 token ids in [0, vocab_size) from default_rng(INPUT_SEED) per length; "
                       "only input_ids are passed (no attention mask, token_type_ids default to 0)"),
        "seq_cases": cases,
        "torch_seed": TORCH_SEED,
        "randomize_seed": RANDOMIZE_SEED,
        "input_seed": INPUT_SEED,
        "randomization": RANDOMIZATION,
        "weights_note": "floating tensors saved as float32",
        "tolerance": "max|a - b| / max|b| <= 1e-4",
        "command": command,
        "versions": versions(),
        "date": date,
    }
    with open(os.path.join(out, "meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    print(f"  {family} seq lens {seq_lens}: wrote {out} in {time.time() - start:.1f} s")


def seq_case_command(family, out, seq_lens, max_positions):
    return shlex.join(["python3", "tests/reference/torch_reference.py", "--family", family,
                       "--seq-lens", ",".join(map(str, seq_lens)), "--max-positions",
                       str(max_positions), "--out", out])


def case_command(family, size, out, dtype, batch=None, image_size=None, seq_len=None):
    args = ["python3", "tests/reference/torch_reference.py", "--family", family, "--size", size,
            "--out", out, "--dtype", dtype]
    if batch:
        args += ["--batch", str(batch)]
    if image_size:
        args += ["--image-size", str(image_size)]
    if seq_len:
        args += ["--seq-len", str(seq_len)]
    return shlex.join(args)


def write_goldens():
    for case, (family, size, dtype) in GOLDEN_CASES.items():
        out = os.path.join(GOLDEN_DIR, case)
        if os.path.isdir(out):
            shutil.rmtree(out)  # drop stale files from an earlier layout
        # Recorded as the single-case command; `--goldens` writes the same files.
        rel = os.path.relpath(out, REPO)
        run_case(family, size, out, dtype, command=case_command(family, size, rel, dtype),
                 date=CASE_DATES.get(case, DATE))
    for case, family in SEQ_GOLDEN_CASES.items():
        out = os.path.join(GOLDEN_DIR, case)
        if os.path.isdir(out):
            shutil.rmtree(out)
        rel = os.path.relpath(out, REPO)
        run_seq_case(family, out, SEQ_CASE_LENS, SEQ_CASE_MAX_POSITIONS,
                     command=seq_case_command(family, rel, SEQ_CASE_LENS, SEQ_CASE_MAX_POSITIONS))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=FAMILIES)
    ap.add_argument("--size", choices=["reduced", "full"], default="reduced")
    ap.add_argument("--out", help="output directory")
    ap.add_argument("--dtype", choices=list(DTYPES), default="f32", help="checkpoint dtype (default f32)")
    ap.add_argument("--batch", type=int, help=f"batch size (default {DEFAULT_BATCH})")
    ap.add_argument("--seq-len", type=int, help="sequence length (default 128 full, 16 reduced)")
    ap.add_argument("--seq-lens", help="comma-separated sequence lengths served by one checkpoint "
                    "(bert_base, gpt2; reduced)")
    ap.add_argument("--max-positions", type=int,
                    help="position table rows of a reduced transformer (default 64)")
    ap.add_argument("--image-size", type=int,
                    help="image side (default 224 full, 299 full inception, 32 reduced, 75 reduced inception)")
    ap.add_argument("--f64", action="store_true",
                    help="also run in float64 and write <output>.f64.npy (rounded to float32)")
    ap.add_argument("--goldens", action="store_true", help=f"(re)write the checked-in cases under {os.path.relpath(GOLDEN_DIR, REPO)}/")
    args = ap.parse_args()

    torch.set_num_threads(2)
    if args.goldens:
        write_goldens()
        return
    if not args.family or not args.out:
        ap.error("--family and --out are required (or use --goldens)")
    if args.seq_lens:
        if args.size != "reduced" or args.dtype != "f32" or args.seq_len or args.image_size:
            ap.error("--seq-lens takes a reduced f32 transformer and no --seq-len or --image-size")
        lens = [int(v) for v in args.seq_lens.split(",")]
        positions = args.max_positions or 64
        run_seq_case(args.family, args.out, lens, positions, args.batch,
                     command=seq_case_command(args.family, args.out, lens, positions))
        return
    if args.max_positions:
        ap.error("--max-positions goes with --seq-lens")
    run_case(args.family, args.size, args.out, args.dtype, args.batch, args.image_size, args.seq_len,
             command=case_command(args.family, args.size, args.out, args.dtype, args.batch,
                                  args.image_size, args.seq_len) + (" --f64" if args.f64 else ""),
             f64=args.f64)


if __name__ == "__main__":
    sys.exit(main())
