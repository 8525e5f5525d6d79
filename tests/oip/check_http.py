"""The Open Inference Protocol over HTTP, checked with tritonclient.http and
raw requests against a running cluster (see tests/oip.rs for the arguments).

Checks: live, ready, server metadata, model metadata and readiness, the
repository index; infer with JSON tensors and with the binary tensor data
extension for every model, outputs equal to `distmind infer`'s; a wrong
shape, an unknown model, an over-size body and a missing token each get the
protocol's error (status and a message naming the problem), and the server
keeps serving after each.
"""

import http.client
import json

import numpy as np
import tritonclient.http as httpclient

from oip_common import BODY_BYTES_MAX, MODELS, args, check, close, expect_raised, finish, load


def auth():
    """The token header, a fresh dict per call: tritonclient adds its own
    headers (Inference-Header-Content-Length) to the dict it is given."""
    return {"authorization": f"Bearer {args.token}"} if args.token else {}


def raw(method, path, body=None, headers=None):
    """(status, headers, body bytes) of one plain HTTP request."""
    host, port = args.url.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=120)
    h = auth()
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, {k.lower(): v for k, v in r.getheaders()}, data


def error_of(status, headers, data):
    """The `error` of a protocol error body, or None."""
    try:
        body = json.loads(data)
    except ValueError:
        return None
    return body.get("error") if isinstance(body, dict) else None


client = httpclient.InferenceServerClient(url=args.url, network_timeout=120.0)

# --- health and metadata -----------------------------------------------------
check(client.is_server_live(headers=auth()), "server live")
check(client.is_server_ready(headers=auth()), "server ready")
s, h, d = raw("GET", "/v2/health/live")
check(s == 200 and json.loads(d) == {"live": True}, f"GET /v2/health/live -> {s} {d!r}")
s, h, d = raw("GET", "/v2/health/ready")
check(s == 200 and json.loads(d) == {"ready": True}, f"GET /v2/health/ready -> {s} {d!r}")

meta = client.get_server_metadata(headers=auth())
check(
    isinstance(meta.get("name"), str)
    and isinstance(meta.get("version"), str)
    and "binary_tensor_data" in meta.get("extensions", []),
    f"server metadata {meta}",
)

index = client.get_model_repository_index(headers=auth())
names = sorted(m["name"] for m in MODELS)
check(
    isinstance(index, list)
    and sorted(e["name"] for e in index) == names
    and all(e["state"] == "READY" and isinstance(e.get("version"), str) for e in index),
    f"repository index {index}",
)
s, h, d = raw("POST", "/v2/repository/index", body=b'{"ready": true}')
check(s == 200 and sorted(e["name"] for e in json.loads(d)) == names, f"ready-only index -> {s}")

for m in MODELS:
    name = m["name"]
    md = client.get_model_metadata(name, headers=auth())
    # -1 marks every dimension a request chooses: the batch, and the tokens
    # of a transformer (up to its position table).
    want_inputs = [
        {"name": t["name"], "datatype": t["datatype"], "shape": t["protocol_shape"]}
        for t in m["inputs"]
    ]
    got_inputs = [{"name": t["name"], "datatype": t["datatype"], "shape": t["shape"]} for t in md["inputs"]]
    got_outputs = [(t["name"], t["datatype"], t["shape"]) for t in md["outputs"]]
    want_outputs = [(t["name"], t["datatype"], t["protocol_shape"]) for t in m["outputs"]]
    check(
        md["name"] == name
        and md["platform"]
        and len(md["versions"]) == 1
        and got_inputs == want_inputs
        and got_outputs == want_outputs
        and all(t["shape"][0] == -1 for t in md["outputs"]),
        f"{name}: model metadata {md}",
    )
    version = md["versions"][0]
    check(client.is_model_ready(name, headers=auth()), f"{name}: model ready")
    check(client.is_model_ready(name, model_version=version, headers=auth()), f"{name}: version {version} ready")
    s, h, d = raw("GET", f"/v2/models/{name}/versions/{version}")
    check(s == 200 and json.loads(d)["name"] == name, f"{name}: metadata of version {version} -> {s}")
    s, h, d = raw("GET", f"/v2/models/{name}/versions/no-such-version")
    err = error_of(s, h, d)
    check(s == 404 and err and "no-such-version" in err, f"{name}: unknown version -> {s} {err}")


# --- infer ----------------------------------------------------------------------
def infer_ok(m, binary):
    name = m["name"]
    x = load(f"{name}.input.npy")
    spec = m["inputs"][0]
    inp = httpclient.InferInput(spec["name"], list(x.shape), spec["datatype"])
    inp.set_data_from_numpy(x, binary_data=binary)
    outs = [httpclient.InferRequestedOutput(o["name"], binary_data=binary) for o in m["outputs"]]
    # The binary requests also carry an SLO and a priority, as the README shows.
    extra = {"parameters": {"slo_ms": 60000}, "priority": 1} if binary else {}
    r = client.infer(name, [inp], outputs=outs, request_id="req-1", headers=auth(), **extra)
    resp = r.get_response()
    good = resp["model_name"] == name and resp.get("id") == "req-1"
    for o in m["outputs"]:
        got = r.as_numpy(o["name"])
        want = load(f"{name}.{o['name']}.npy")
        good = good and got is not None and close(got, want)
        if got is not None and not close(got, want):
            print(f"      {o['name']}: got {got.dtype}{got.shape}, want {want.dtype}{want.shape}")
    return good


for m in MODELS:
    for binary in (False, True):
        check(infer_ok(m, binary), f"{m['name']}: infer ({'binary' if binary else 'JSON'}) equals distmind infer")

# A transformer takes any number of tokens up to its position table: a
# shorter request is served at its own length. GPT-2 is causal, so the rows
# of a prefix equal the first rows of the longer request's output.
for m in MODELS:
    spec = m["inputs"][0]
    if spec["protocol_shape"][1:] != [-1]:
        continue
    x = load(f"{m['name']}.input.npy")
    short = x[:, : max(1, x.shape[1] // 2)].copy()
    inp = httpclient.InferInput(spec["name"], list(short.shape), spec["datatype"])
    inp.set_data_from_numpy(short)
    r = client.infer(m["name"], [inp], headers=auth())
    first = m["outputs"][0]["name"]
    got = r.as_numpy(first)
    good = got is not None and got.shape[:2] == short.shape
    if m["family"] == "gpt2":
        # Another length is another matmul shape: summation order may
        # differ, hence 1e-5 rather than close()'s 1e-6.
        want = load(f"{m['name']}.{first}.npy")[:, : short.shape[1]]
        good = good and bool(np.all(np.abs(got - want) <= 1e-5 * np.maximum(np.abs(want), 1.0)))
    check(good, f"{m['name']}: {short.shape[1]} tokens instead of {x.shape[1]} -> {None if got is None else got.shape}")

# No `outputs`: every output, binary as asked request-wide.
m = MODELS[0]
x = load(f"{m['name']}.input.npy")
body = json.dumps(
    {
        "inputs": [
            {
                "name": m["inputs"][0]["name"],
                "datatype": m["inputs"][0]["datatype"],
                "shape": list(x.shape),
                "data": x.flatten().tolist(),
            }
        ],
        "parameters": {"slo_ms": 60000, "priority": 1},
    }
).encode()
s, h, d = raw("POST", f"/v2/models/{m['name']}/infer", body=body)
resp = json.loads(d) if s == 200 else {}
got = {o["name"]: np.array(o["data"], dtype=np.float32).reshape(o["shape"]) for o in resp.get("outputs", [])}
check(
    s == 200
    and h.get("content-type") == "application/json"
    and all(close(got.get(o["name"]), load(f"{m['name']}.{o['name']}.npy")) for o in m["outputs"]),
    f"{m['name']}: raw JSON infer with slo_ms and priority -> {s}",
)

# --- errors, each followed by a good request ----------------------------------
cnn = next(m for m in MODELS if m["inputs"][0]["datatype"] == "FP32")


def still_serving(after):
    check(infer_ok(cnn, True), f"still serving after {after}")


def expect_error(what, call, status, words):
    expect_raised(what, call, str(status), words)


x = load(f"{cnn['name']}.input.npy")
spec = cnn["inputs"][0]
bad = np.zeros([1] + [d + 1 for d in x.shape[1:]], dtype=np.float32)


def infer_bad_shape():
    i = httpclient.InferInput(spec["name"], list(bad.shape), "FP32")
    i.set_data_from_numpy(bad)
    client.infer(cnn["name"], [i], headers=auth())


expect_error("wrong shape", infer_bad_shape, 400, ["bad_request", "shape", str(list(bad.shape))])
i = {"name": spec["name"], "datatype": "FP32", "shape": list(bad.shape), "data": bad.flatten().tolist()}
s, h, d = raw("POST", f"/v2/models/{cnn['name']}/infer", body=json.dumps({"inputs": [i]}).encode())
err = error_of(s, h, d)
check(s == 400 and err and "shape" in err and "bad_request" in err, f"wrong shape -> {s} {err}")
still_serving("a wrong shape")


def infer_unknown():
    i = httpclient.InferInput(spec["name"], list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    client.infer("no_such_model", [i], headers=auth())


expect_error("unknown model", infer_unknown, 404, ["unknown_model", "no_such_model"])
s, h, d = raw("GET", "/v2/models/no_such_model")
err = error_of(s, h, d)
check(s == 404 and err and "no_such_model" in err, f"metadata of an unknown model -> {s} {err}")
s, h, d = raw("GET", "/v2/models/no_such_model/ready")
check(s == 404, f"readiness of an unknown model -> {s}")
check(not client.is_model_ready("no_such_model", headers=auth()), "unknown model not ready")
still_serving("an unknown model")

big = np.zeros([BODY_BYTES_MAX // (4 * int(np.prod(x.shape[1:]))) + 1] + list(x.shape[1:]), dtype=np.float32)


def infer_big():
    i = httpclient.InferInput(spec["name"], list(big.shape), "FP32")
    i.set_data_from_numpy(big)
    client.infer(cnn["name"], [i], headers=auth())


expect_error("over-size body", infer_big, 413, ["too_large", str(BODY_BYTES_MAX)])
s, h, d = raw("POST", f"/v2/models/{cnn['name']}/infer", body=b"0" * (BODY_BYTES_MAX + 1))
err = error_of(s, h, d)
check(s == 413 and err and str(BODY_BYTES_MAX) in err, f"over-size body -> {s} {err}")
still_serving("an over-size body")

# Within the body bound, over the GPU servers' 16 MiB input frame.
wide = np.zeros([(16 << 20) // (4 * int(np.prod(x.shape[1:]))) + 1] + list(x.shape[1:]), dtype=np.float32)


def infer_wide():
    i = httpclient.InferInput(spec["name"], list(wide.shape), "FP32")
    i.set_data_from_numpy(wide)
    client.infer(cnn["name"], [i], headers=auth())


expect_error("over-size batch", infer_wide, 413, ["too_large", "smaller batch"])
still_serving("an over-size batch")

if args.token:
    s, h, d = raw("POST", f"/v2/models/{cnn['name']}/infer", body=b"{}", headers={"authorization": ""})
    err = error_of(s, h, d)
    check(s == 401 and err and "unauthenticated" in err, f"empty token -> {s} {err}")
    host, port = args.url.rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=60)
    c.request("GET", "/v2/models/" + cnn["name"])
    r = c.getresponse()
    err = error_of(r.status, {}, r.read())
    check(r.status == 401 and err and "api key" in err, f"no token -> {r.status} {err}")
    s, h, d = raw("GET", "/v2", headers={"authorization": "Bearer wrong-key"})
    err = error_of(s, h, d)
    check(s == 401 and err and "not this server's api key" in err, f"wrong token -> {s} {err}")
    def infer_no_token():
        i = httpclient.InferInput(spec["name"], list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        client.infer(cnn["name"], [i])

    expect_error("missing token", infer_no_token, 401, ["unauthenticated"])
    check(not client.is_server_live(), "live without the token is refused")
    still_serving("a missing token")

s, h, d = raw("GET", "/v2/nowhere")
err = error_of(s, h, d)
check(s == 404 and err and "/v2/nowhere" in err, f"unknown path -> {s} {err}")
s, h, d = raw("POST", f"/v2/models/{cnn['name']}/infer", body=b"{not json")
err = error_of(s, h, d)
check(s == 400 and err and "not JSON" in err, f"malformed JSON -> {s} {err}")
still_serving("malformed requests")

finish("HTTP")
