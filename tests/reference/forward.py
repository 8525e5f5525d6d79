#!/usr/bin/env python3
"""Independent NumPy reference of a distmind model package's forward pass.

Reads DIR/manifest.json and DIR/weights.safetensors and runs
manifest["layers"] in order, implementing every op exactly as
models/OPS.md describes it (PyTorch eval-mode conventions: torchvision and
Hugging Face). Written from OPS.md alone, not from the Rust executor, so the
two can check each other.

Arithmetic is float64 throughout; outputs are returned as float32.

    python3 tests/reference/forward.py PACKAGE_DIR INPUT.npy OUTPUT.npy

writes the model's last output (the last layer) to OUTPUT.npy.
"""

import json
import math
import os
import struct
import sys

import numpy as np

# Largest safetensors JSON header accepted (bounded before reading it).
SAFETENSORS_HEADER_MAX = 100 << 20

_ST_DTYPES = {
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
    "F16": np.dtype("<f2"),
    # NumPy has no bfloat16: read the bits, widened below (exactly: a bf16
    # is the top half of a float32).
    "BF16": np.dtype("<u2"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}


# --------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------

def load_safetensors(path):
    """Returns {name: np.ndarray} from a safetensors file (parsed by hand)."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise ValueError(f"{path}: too short for a safetensors header")
    (hlen,) = struct.unpack("<Q", data[:8])
    if hlen > SAFETENSORS_HEADER_MAX or 8 + hlen > len(data):
        raise ValueError(f"{path}: header length {hlen} out of bounds")
    header = json.loads(data[8:8 + hlen].decode("utf-8"))
    body = memoryview(data)[8 + hlen:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = _ST_DTYPES.get(info["dtype"])
        if dt is None:
            raise ValueError(f"{path}: tensor {name}: unsupported dtype {info['dtype']}")
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(v) for v in info["data_offsets"])
        n = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= begin <= end <= len(body)) or end - begin != n * dt.itemsize:
            raise ValueError(f"{path}: tensor {name}: bad data_offsets {begin}..{end}")
        arr = np.frombuffer(body[begin:end], dtype=dt).reshape(shape)
        if info["dtype"] == "BF16":
            arr = (arr.astype("<u4") << 16).view("<f4")
        out[name] = arr.copy()
    return out


def load_package(pkg_dir):
    with open(os.path.join(pkg_dir, "manifest.json")) as f:
        manifest = json.load(f)
    weights = load_safetensors(os.path.join(pkg_dir, "weights.safetensors"))
    for p in manifest["params"]:
        w = weights.get(p["name"])
        if w is None:
            raise ValueError(f"param {p['name']} missing from weights.safetensors")
        if list(w.shape) != list(p["shape"]):
            raise ValueError(f"param {p['name']}: shape {list(w.shape)} != manifest {p['shape']}")
    return manifest, weights


# --------------------------------------------------------------------------
# ops (float64 in, float64 out)
# --------------------------------------------------------------------------

def conv2d(x, weight, bias, stride, padding):
    """Cross-correlation, zero padding on both sides, dilation 1, groups 1."""
    n, c, h, w = x.shape
    oc, ic, kh, kw = weight.shape
    assert ic == c, f"conv2d: input has {c} channels, weight expects {ic}"
    sh, sw = stride
    ph, pw = padding
    ho = (h + 2 * ph - kh) // sh + 1
    wo = (w + 2 * pw - kw) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    # cols[n, c, i, j, oh, ow] = xp[n, c, oh*sh + i, ow*sw + j]
    cols = np.empty((n, c, kh, kw, ho, wo), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            cols[:, :, i, j] = xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw]
    y = np.tensordot(cols, weight, axes=([1, 2, 3], [1, 2, 3]))  # [n, ho, wo, oc]
    y = y.transpose(0, 3, 1, 2)
    if bias is not None:
        y = y + bias.reshape(1, oc, 1, 1)
    return y


def batch_norm(x, weight, bias, mean, var, eps):
    shape = (1, -1) + (1,) * (x.ndim - 2)
    return (x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * weight.reshape(shape) + bias.reshape(shape)


def pool_out_size(size, k, s, p, ceil_mode):
    """PyTorch's pooling output size (pooling_output_shape, dilation 1)."""
    num = size + 2 * p - k
    if ceil_mode:
        o = -(-num // s) + 1  # ceil division (num >= 0 here)
        # The last window must start inside the input or the left padding.
        if (o - 1) * s >= size + p:
            o -= 1
    else:
        o = num // s + 1
    return o


def max_pool2d(x, kernel, stride, padding, ceil_mode):
    n, c, h, w = x.shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    ho = pool_out_size(h, kh, sh, ph, ceil_mode)
    wo = pool_out_size(w, kw, sw, pw, ceil_mode)
    # Pad with -inf: left by p, right by enough to cover the last window
    # (windows running past the right edge in ceil mode see only -inf there).
    rh = max(ph, (ho - 1) * sh + kh - h - ph)
    rw = max(pw, (wo - 1) * sw + kw - w - pw)
    xp = np.pad(x, ((0, 0), (0, 0), (ph, rh), (pw, rw)), constant_values=-np.inf)
    y = np.full((n, c, ho, wo), -np.inf)
    for i in range(kh):
        for j in range(kw):
            y = np.maximum(y, xp[:, :, i:i + sh * (ho - 1) + 1:sh, j:j + sw * (wo - 1) + 1:sw])
    return y


def avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad):
    """PyTorch's avg_pool2d. With count_include_pad the divisor is the window
    clipped to the padded input ([-p, size + p)), which is kh*kw unless a
    ceil_mode window runs past the right padding; without it, the number of
    in-bounds elements."""
    n, c, h, w = x.shape
    kh, kw = kernel
    sh, sw = stride
    ph, pw = padding
    ho = pool_out_size(h, kh, sh, ph, ceil_mode)
    wo = pool_out_size(w, kw, sw, pw, ceil_mode)
    y = np.zeros((n, c, ho, wo))
    for oh in range(ho):
        hs = oh * sh - ph
        he = min(hs + kh, h + ph)
        pool_h = he - hs
        hs0, he0 = max(hs, 0), min(he, h)
        for ow in range(wo):
            ws = ow * sw - pw
            we = min(ws + kw, w + pw)
            pool_w = we - ws
            ws0, we0 = max(ws, 0), min(we, w)
            s = x[:, :, hs0:he0, ws0:we0].sum(axis=(2, 3))
            if count_include_pad:
                div = pool_h * pool_w
            else:
                div = (he0 - hs0) * (we0 - ws0)
            y[:, :, oh, ow] = s / div
    return y


def adaptive_avg_pool2d(x, output_size):
    n, c, h, w = x.shape
    oh, ow = output_size
    y = np.zeros((n, c, oh, ow))
    for i in range(oh):
        hs = (i * h) // oh
        he = -(-((i + 1) * h) // oh)
        for j in range(ow):
            ws = (j * w) // ow
            we = -(-((j + 1) * w) // ow)
            y[:, :, i, j] = x[:, :, hs:he, ws:we].mean(axis=(2, 3))
    return y


def linear(x, weight, bias, transposed):
    y = x @ weight if transposed else x @ weight.T
    if bias is not None:
        y = y + bias
    return y


def embedding(ids, weight, mode):
    n, l = ids.shape
    if mode == "input":
        idx = ids.astype(np.int64)
        if idx.min(initial=0) < 0 or idx.max(initial=0) >= weight.shape[0]:
            raise ValueError(f"token id out of range [0, {weight.shape[0]})")
    elif mode == "positions":
        if l > weight.shape[0]:
            raise ValueError(f"sequence length {l} > {weight.shape[0]} positions")
        idx = np.broadcast_to(np.arange(l, dtype=np.int64), (n, l))
    elif mode == "zeros":
        idx = np.zeros((n, l), dtype=np.int64)
    else:
        raise ValueError(f"embedding: unknown ids mode {mode!r}")
    return weight[idx]


def layer_norm(x, weight, bias, eps):
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)  # biased
    return (x - mean) / np.sqrt(var + eps) * weight + bias


_erf = np.vectorize(math.erf, otypes=[np.float64])


def gelu(x, approximate):
    if approximate == "erf":
        return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))
    if approximate == "tanh":
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    raise ValueError(f"gelu: unknown approximate {approximate!r}")


def softmax(x, axis=-1):
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / e.sum(axis=axis, keepdims=True)


def attention(inputs, hidden, heads, causal):
    if len(inputs) == 3:
        q, k, v = inputs
    elif len(inputs) == 1:
        qkv = inputs[0]
        assert qkv.shape[-1] == 3 * hidden, f"fused qkv last dim {qkv.shape[-1]} != 3*{hidden}"
        q, k, v = qkv[..., :hidden], qkv[..., hidden:2 * hidden], qkv[..., 2 * hidden:]
    else:
        raise ValueError(f"attention takes 1 or 3 inputs, got {len(inputs)}")
    assert hidden % heads == 0
    d = hidden // heads
    n, l, _ = q.shape

    def split(t):  # [N, L, H] -> [N, h, L, d]
        return t.reshape(n, l, heads, d).transpose(0, 2, 1, 3)

    q, k, v = split(q), split(k), split(v)
    scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(d)  # [N, h, L, L]
    if causal:
        mask = np.triu(np.ones((l, l), dtype=bool), k=1)  # j > i
        scores = np.where(mask, -np.inf, scores)
    probs = softmax(scores, axis=-1)
    out = probs @ v  # [N, h, L, d]
    return out.transpose(0, 2, 1, 3).reshape(n, l, hidden)


def select(x, dim, index):
    return np.take(x, index, axis=dim)


def flatten(x, start_dim):
    return x.reshape(x.shape[:start_dim] + (-1,))


# --------------------------------------------------------------------------
# the graph
# --------------------------------------------------------------------------

def run_layer(layer, xs, P):
    op = layer["op"]
    a = layer.get("attrs") or {}
    ps = [P[name] for name in layer["params"]]
    if op == "conv2d":
        bias = ps[1] if a["bias"] else None
        assert ps[0].shape == (a["out_channels"], a["in_channels"], *a["kernel"])
        return conv2d(xs[0], ps[0], bias, a["stride"], a["padding"])
    if op == "batch_norm":
        return batch_norm(xs[0], ps[0], ps[1], ps[2], ps[3], a["eps"])
    if op == "relu":
        return np.maximum(xs[0], 0.0)
    if op == "tanh":
        return np.tanh(xs[0])
    if op == "gelu":
        return gelu(xs[0], a["approximate"])
    if op == "max_pool2d":
        return max_pool2d(xs[0], a["kernel"], a["stride"], a["padding"], a["ceil_mode"])
    if op == "avg_pool2d":
        return avg_pool2d(xs[0], a["kernel"], a["stride"], a["padding"], a["ceil_mode"],
                          a["count_include_pad"])
    if op == "adaptive_avg_pool2d":
        return adaptive_avg_pool2d(xs[0], a["output_size"])
    if op == "add":
        assert len(xs) == 2 and xs[0].shape == xs[1].shape, "add: two inputs of one shape"
        return xs[0] + xs[1]
    if op == "concat":
        return np.concatenate(xs, axis=a["dim"])
    if op == "flatten":
        return flatten(xs[0], a["start_dim"])
    if op == "linear":
        bias = ps[1] if a["bias"] else None
        w = ps[0]
        want = (a["in_features"], a["out_features"]) if a["transposed"] else (a["out_features"], a["in_features"])
        assert w.shape == want, f"linear weight {w.shape} != {want}"
        return linear(xs[0], w, bias, a["transposed"])
    if op == "embedding":
        return embedding(xs[0], ps[0], a["ids"])
    if op == "layer_norm":
        return layer_norm(xs[0], ps[0], ps[1], a["eps"])
    if op == "attention":
        return attention(xs, a["hidden"], a["heads"], a["causal"])
    if op == "select":
        return select(xs[0], a["dim"], a["index"])
    raise ValueError(f"layer {layer['id']} ({layer['name']}): unknown op {op!r}")


def forward(manifest, weights, inputs, return_all=False):
    """Runs the layers; returns the list of manifest outputs (float32), or
    every layer's output (float64) with return_all."""
    P = {name: w.astype(np.float64) for name, w in weights.items()}
    model_in = []
    for spec, x in zip(manifest["inputs"], inputs):
        if list(x.shape) != list(spec["shape"]):
            raise ValueError(f"input {spec['name']}: shape {list(x.shape)} != {spec['shape']}")
        model_in.append(x.astype(np.int64) if spec["dtype"] == "I64" else x.astype(np.float64))
    outs = []
    for pos, layer in enumerate(manifest["layers"]):
        assert layer["id"] == pos, "layer ids are positions"
        xs = []
        for i in layer["inputs"]:
            if i < 0:
                xs.append(model_in[-i - 1])
            else:
                assert i < pos, "inputs come from earlier layers"
                xs.append(outs[i])
        outs.append(run_layer(layer, xs, P))
    if return_all:
        return outs
    result = []
    for o in manifest["outputs"]:
        y = outs[o["layer"]]
        if list(y.shape) != list(o["shape"]):
            raise ValueError(f"output {o['name']}: shape {list(y.shape)} != manifest {o['shape']}")
        result.append(y.astype(np.float32))
    return result


def main(argv):
    if len(argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    pkg, inp, outp = argv[1:]
    manifest, weights = load_package(pkg)
    x = np.load(inp, allow_pickle=False)
    outs = forward(manifest, weights, [x])
    np.save(outp, outs[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
