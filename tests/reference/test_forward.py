#!/usr/bin/env python3
"""Hand-checked cases for every op of forward.py, so the goldens can be trusted.

    python3 tests/reference/test_forward.py

Each case compares against a direct loop or against numbers worked out by
hand (or PyTorch's documented values); exits non-zero on the first failure.
"""

import json
import math
import os
import struct
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import forward as F  # noqa: E402

CASES = []


def case(fn):
    CASES.append(fn)
    return fn


def close(a, b, tol=1e-12):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, f"shape {a.shape} != {b.shape}"
    err = np.max(np.abs(a - b)) if a.size else 0.0
    assert err <= tol, f"max abs err {err} > {tol}\n{a}\n{b}"


@case
def conv2d_matches_direct_loop():
    rng = np.random.default_rng(0)
    for (n, c, h, w, oc, kh, kw, sh, sw, ph, pw, bias) in [
        (2, 3, 7, 6, 4, 3, 2, 2, 1, 1, 0, True),
        (1, 2, 5, 5, 3, 1, 1, 1, 1, 0, 0, False),
        (1, 1, 8, 9, 2, 7, 7, 2, 2, 3, 3, False),
        (1, 2, 6, 6, 2, 1, 7, 1, 1, 0, 3, True),   # Inception's 1x7
    ]:
        x = rng.standard_normal((n, c, h, w))
        wt = rng.standard_normal((oc, c, kh, kw))
        b = rng.standard_normal(oc) if bias else None
        y = F.conv2d(x, wt, b, (sh, sw), (ph, pw))
        ho = (h + 2 * ph - kh) // sh + 1
        wo = (w + 2 * pw - kw) // sw + 1
        ref = np.zeros((n, oc, ho, wo))
        for ni in range(n):
            for o in range(oc):
                for i in range(ho):
                    for j in range(wo):
                        s = b[o] if bias else 0.0
                        for ci in range(c):
                            for u in range(kh):
                                for v in range(kw):
                                    hh, ww = i * sh - ph + u, j * sw - pw + v
                                    if 0 <= hh < h and 0 <= ww < w:
                                        s += x[ni, ci, hh, ww] * wt[o, ci, u, v]
                        ref[ni, o, i, j] = s
        close(y, ref, 1e-10)


@case
def conv2d_is_cross_correlation():
    # A kernel [[1, 2], [3, 4]] over [[a, b], [c, d]] without flipping.
    x = np.array([[[[1.0, 10.0], [100.0, 1000.0]]]])
    wt = np.array([[[[1.0, 2.0], [3.0, 4.0]]]])
    close(F.conv2d(x, wt, None, (1, 1), (0, 0)), [[[[1 + 20 + 300 + 4000.0]]]])


@case
def batch_norm_formula():
    x = np.array([[[[1.0, 2.0]], [[3.0, 5.0]]]])  # [1, 2, 1, 2]
    y = F.batch_norm(x, np.array([2.0, 1.0]), np.array([0.5, -1.0]),
                     np.array([1.0, 4.0]), np.array([3.0, 0.0]), 1.0)
    # channel 0: (x - 1) / 2 * 2 + 0.5 ; channel 1: (x - 4) / 1 * 1 - 1
    close(y, [[[[0.5, 1.5]], [[-2.0, 0.0]]]])


@case
def pool_output_sizes_follow_pytorch():
    # (size, k, s, p, ceil) -> PyTorch's output size
    for args, want in [
        ((32, 3, 2, 1, False), 16), ((16, 3, 2, 1, False), 8),
        ((5, 2, 2, 0, False), 2), ((5, 2, 2, 0, True), 3),
        ((5, 2, 2, 1, True), 3),   # ceil gives 4, last window starts at 6 >= 5 + 1: dropped
        ((6, 3, 2, 1, True), 4), ((6, 3, 2, 1, False), 3),
        ((4, 2, 2, 0, True), 2), ((73, 3, 2, 0, False), 36),
    ]:
        got = F.pool_out_size(*args)
        assert got == want, f"pool_out_size{args} = {got}, want {want}"


@case
def max_pool_basic_and_ceil_mode():
    x = np.arange(1.0, 6.0).reshape(1, 1, 1, 5)
    close(F.max_pool2d(x, (1, 2), (1, 2), (0, 0), False), [[[[2.0, 4.0]]]])
    close(F.max_pool2d(x, (1, 2), (1, 2), (0, 0), True), [[[[2.0, 4.0, 5.0]]]])
    # padding 1 (-inf) and ceil: windows [-1, 0], [1, 2], [3, 4]
    close(F.max_pool2d(x, (1, 2), (1, 2), (0, 1), True), [[[[1.0, 3.0, 5.0]]]])
    # padding is -inf, not zero: an all-negative input stays negative
    neg = -np.arange(1.0, 10.0).reshape(1, 1, 3, 3)
    y = F.max_pool2d(neg, (3, 3), (2, 2), (1, 1), False)
    close(y, [[[[-1.0, -2.0], [-4.0, -5.0]]]])


@case
def max_pool_matches_loop():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 9, 8))
    for k, s, p, ceil in [(3, 2, 1, False), (3, 2, 0, False), (3, 2, 1, True), (2, 3, 1, True)]:
        y = F.max_pool2d(x, (k, k), (s, s), (p, p), ceil)
        ho = F.pool_out_size(9, k, s, p, ceil)
        wo = F.pool_out_size(8, k, s, p, ceil)
        ref = np.full((2, 3, ho, wo), -np.inf)
        for i in range(ho):
            for j in range(wo):
                for u in range(k):
                    for v in range(k):
                        hh, ww = i * s - p + u, j * s - p + v
                        if 0 <= hh < 9 and 0 <= ww < 8:
                            ref[:, :, i, j] = np.maximum(ref[:, :, i, j], x[:, :, hh, ww])
        close(y, ref)


@case
def avg_pool_count_include_pad():
    x = np.arange(1.0, 6.0).reshape(1, 1, 1, 5)
    # padding 1, k 2, s 2, ceil: windows [pad, 1], [2, 3], [4, 5]
    close(F.avg_pool2d(x, (1, 2), (1, 2), (0, 1), True, True), [[[[0.5, 2.5, 4.5]]]])
    close(F.avg_pool2d(x, (1, 2), (1, 2), (0, 1), True, False), [[[[1.0, 2.5, 4.5]]]])
    # ceil window past the end (no padding): PyTorch divides by the clipped size
    close(F.avg_pool2d(x, (1, 2), (1, 2), (0, 0), True, True), [[[[1.5, 3.5, 5.0]]]])
    # Inception's branch_pool: 3x3 s1 p1 count_include_pad on a 3x3 of ones:
    # corners see 4 ones / 9, edges 6 / 9, centre 9 / 9.
    ones = np.ones((1, 1, 3, 3))
    close(F.avg_pool2d(ones, (3, 3), (1, 1), (1, 1), False, True),
          [[[[4 / 9, 6 / 9, 4 / 9], [6 / 9, 1.0, 6 / 9], [4 / 9, 6 / 9, 4 / 9]]]])
    close(F.avg_pool2d(ones, (3, 3), (1, 1), (1, 1), False, False), np.ones((1, 1, 3, 3)))
    # DenseNet transition: 2x2 s2
    x4 = np.arange(16.0).reshape(1, 1, 4, 4)
    close(F.avg_pool2d(x4, (2, 2), (2, 2), (0, 0), False, True),
          [[[[2.5, 4.5], [10.5, 12.5]]]])


@case
def adaptive_avg_pool_bins():
    x = np.arange(5.0).reshape(1, 1, 5, 1)
    # H 5 -> 3 bins: [0, 2), [1, 4), [3, 5)
    close(F.adaptive_avg_pool2d(x, (3, 1)), [[[[0.5], [2.0], [3.5]]]])
    rng = np.random.default_rng(2)
    y = rng.standard_normal((2, 3, 4, 5))
    close(F.adaptive_avg_pool2d(y, (1, 1)), y.mean(axis=(2, 3), keepdims=True))


@case
def relu_tanh_add_concat_flatten_select():
    x = np.array([-1.5, 0.0, 2.0])
    close(F.run_layer({"op": "relu", "params": []}, [x], {}), [0.0, 0.0, 2.0])
    close(F.run_layer({"op": "tanh", "params": []}, [x], {}), np.tanh(x))
    close(F.run_layer({"op": "add", "params": []}, [x, x], {}), 2 * x)
    a = np.zeros((1, 2, 2, 2))
    b = np.ones((1, 3, 2, 2))
    c = F.run_layer({"op": "concat", "attrs": {"dim": 1}, "params": []}, [a, b, a], {})
    assert c.shape == (1, 7, 2, 2) and c[0, :2].sum() == 0 and c[0, 2:5].sum() == 12 and c[0, 5:].sum() == 0
    close(F.flatten(np.arange(6.0).reshape(1, 6, 1, 1), 1), [np.arange(6.0)])
    s = np.arange(24.0).reshape(2, 3, 4)
    close(F.select(s, 1, 0), s[:, 0, :])


@case
def linear_both_layouts():
    x = np.array([[1.0, 2.0]])  # [1, in=2]
    w = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])  # [out=3, in=2]
    b = np.array([0.5, 0.0, -1.0])
    close(F.linear(x, w, b, False), [[1.5, 2.0, 2.0]])
    close(F.linear(x, w.T, b, True), [[1.5, 2.0, 2.0]])
    x3 = np.arange(12.0).reshape(2, 3, 2)  # applies to the last dim
    close(F.linear(x3, w, b, False), np.einsum("nli,oi->nlo", x3, w) + b)


@case
def embedding_modes():
    w = np.arange(12.0).reshape(4, 3)
    ids = np.array([[3, 0, 2]])
    close(F.embedding(ids, w, "input"), [[w[3], w[0], w[2]]])
    close(F.embedding(ids, w, "positions"), [[w[0], w[1], w[2]]])
    close(F.embedding(ids, w, "zeros"), [[w[0], w[0], w[0]]])
    try:
        F.embedding(np.array([[4]]), w, "input")
        raise AssertionError("out-of-range id accepted")
    except ValueError:
        pass


@case
def layer_norm_biased_variance():
    x = np.array([[1.0, 2.0, 3.0]])
    y = F.layer_norm(x, np.ones(3), np.zeros(3), 0.0)
    r = math.sqrt(1.5)  # (x - 2) / sqrt(2/3)
    close(y, [[-r, 0.0, r]])
    y = F.layer_norm(x, np.array([2.0, 2.0, 2.0]), np.array([1.0, 1.0, 1.0]), 1e-5)
    close(y, [[1 - 2 / math.sqrt(2 / 3 + 1e-5), 1.0, 1 + 2 / math.sqrt(2 / 3 + 1e-5)]])


@case
def gelu_values():
    # 0.5 (1 + erf(1/sqrt 2)) = Phi(1)
    close(F.gelu(np.array([1.0, -1.0, 0.0]), "erf"),
          [0.8413447460685429, -0.15865525393145707, 0.0], 1e-15)
    t = math.tanh(math.sqrt(2 / math.pi) * (1 + 0.044715))
    close(F.gelu(np.array([1.0]), "tanh"), [0.5 * (1 + t)], 1e-15)
    close(F.gelu(np.array([1.0]), "tanh"), [0.8411919906082768], 1e-15)


def attention_loop(q, k, v, heads, causal):
    n, l, hid = q.shape
    d = hid // heads
    out = np.zeros_like(q)
    for b in range(n):
        for h in range(heads):
            sl = slice(h * d, (h + 1) * d)
            for i in range(l):
                js = range(i + 1) if causal else range(l)
                sc = np.array([q[b, i, sl] @ k[b, j, sl] / math.sqrt(d) for j in js])
                p = np.exp(sc - sc.max())
                p /= p.sum()
                out[b, i, sl] = sum(pj * v[b, j, sl] for pj, j in zip(p, js))
    return out


@case
def attention_three_inputs_and_fused():
    rng = np.random.default_rng(3)
    n, l, hid, heads = 2, 5, 8, 2
    q, k, v = (rng.standard_normal((n, l, hid)) for _ in range(3))
    for causal in (False, True):
        want = attention_loop(q, k, v, heads, causal)
        close(F.attention([q, k, v], hid, heads, causal), want, 1e-12)
        fused = np.concatenate([q, k, v], axis=-1)
        close(F.attention([fused], hid, heads, causal), want, 1e-12)


@case
def attention_causal_mask():
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 4, 4)) for _ in range(3))
    y = F.attention([q, k, v], 4, 1, True)
    close(y[0, 0], v[0, 0])  # token 0 sees only itself
    # changing a later token does not change earlier outputs
    k2, v2 = k.copy(), v.copy()
    k2[0, 3] += 10.0
    v2[0, 3] -= 7.0
    y2 = F.attention([q, k2, v2], 4, 1, True)
    close(y2[0, :3], y[0, :3])
    assert np.abs(y2[0, 3] - y[0, 3]).max() > 1e-3
    # equal scores: uniform average over the visible tokens
    z = np.zeros((1, 3, 2))
    vv = np.array([[[3.0, 0.0], [0.0, 3.0], [6.0, 6.0]]])
    close(F.attention([z, z, vv], 2, 1, True)[0], [[3.0, 0.0], [1.5, 1.5], [3.0, 3.0]])
    close(F.attention([z, z, vv], 2, 1, False)[0], [[3.0, 3.0]] * 3)


@case
def attention_heads_split_in_order():
    # Two heads of d=1: head 0 uses column 0, head 1 column 1, results concatenated.
    q = np.array([[[1.0, 0.0], [0.0, 1.0]]])
    k = np.array([[[50.0, 0.0], [0.0, 50.0]]])
    v = np.array([[[1.0, 10.0], [2.0, 20.0]]])
    y = F.attention([q, k, v], 2, 2, False)
    # head 0: token 0 scores [50, 0] -> v0 ; token 1 scores [0, 0] -> mean
    # head 1: token 0 scores [0, 0] -> mean ; token 1 scores [0, 50] -> v1
    close(y, [[[1.0, 15.0], [1.5, 20.0]]], 1e-9)


@case
def safetensors_roundtrip_and_bounds():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([1.5], dtype=np.float32)
    header = {"__metadata__": {"x": "y"},
              "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "F32", "shape": [1], "data_offsets": [24, 28]}}
    h = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "w.safetensors")
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + a.tobytes() + b.tobytes())
        got = F.load_safetensors(p)
        assert set(got) == {"a", "b"}
        close(got["a"], a)
        close(got["b"], b)
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", 1 << 40) + h)
        try:
            F.load_safetensors(p)
            raise AssertionError("oversized header accepted")
        except ValueError:
            pass


@case
def safetensors_half_precision_widens_exactly():
    # f16: 1, -2, the smallest subnormal 2^-24, 65504; bf16: 1, -3, 2^-133 (an f32 subnormal), -inf.
    f16 = np.array([1.0, -2.0, 2.0 ** -24, 65504.0], dtype="<f2")
    bf16_bits = np.array([0x3F80, 0xC040, 0x0001, 0xFF80], dtype="<u2")
    header = {"h": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]},
              "b": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [8, 16]}}
    h = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "w.safetensors")
        with open(p, "wb") as f:
            f.write(struct.pack("<Q", len(h)) + h + f16.tobytes() + bf16_bits.tobytes())
        got = F.load_safetensors(p)
    assert got["h"].astype(np.float64).tolist() == [1.0, -2.0, 2.0 ** -24, 65504.0]
    assert got["b"].dtype == np.float32 and got["b"].shape == (2, 2)
    want = [1.0, -3.0, 2.0 ** -133, -np.inf]
    assert got["b"].astype(np.float64).ravel().tolist() == want, got["b"]


@case
def graph_runs_in_order_with_model_inputs():
    manifest = {
        "inputs": [{"name": "images", "shape": [1, 1, 2, 2], "dtype": "F32"}],
        "outputs": [{"name": "y", "layer": 2, "shape": [1, 1, 2, 2], "dtype": "F32"}],
        "layers": [
            {"id": 0, "name": "r", "op": "relu", "inputs": [-1], "params": []},
            {"id": 1, "name": "t", "op": "tanh", "inputs": [-1], "params": []},
            {"id": 2, "name": "a", "op": "add", "inputs": [0, 1], "params": []},
        ],
    }
    x = np.array([[[[-1.0, 2.0], [0.5, -0.25]]]], dtype=np.float32)
    (y,) = F.forward(manifest, {}, [x])
    assert y.dtype == np.float32
    close(y, np.maximum(x, 0) + np.tanh(x.astype(np.float64)), 1e-6)


def main():
    failed = 0
    for fn in CASES:
        try:
            fn()
            print(f"ok    {fn.__name__}")
        except Exception as e:  # noqa: BLE001
            failed += 1
            print(f"FAIL  {fn.__name__}: {type(e).__name__}: {e}")
    print(f"{len(CASES) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
