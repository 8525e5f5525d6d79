"""The Open Inference Protocol over gRPC, checked with tritonclient.grpc (and
its generated stubs, for what tritonclient itself never sends) against a
running cluster (see tests/oip.rs for the arguments).

Checks: live, ready, server metadata, model metadata and readiness, the
repository index; infer for every model with raw inputs (tritonclient's
form), with typed `contents` inputs, and on a ModelStreamInfer stream, the
outputs equal to `distmind infer`'s; the slo_ms and priority parameters; a
wrong shape, a size that does not match the shape, an unknown model, an
over-size message and a missing or wrong token each get the protocol's
status code and a message naming the problem, and the server keeps serving
after each.
"""

import queue

import grpc
import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.grpc import service_pb2, service_pb2_grpc

from oip_common import BODY_BYTES_MAX, MODELS, args, check, close, expect_raised, finish, load


AUTH = {"authorization": f"Bearer {args.token}"} if args.token else {}
METADATA = list(AUTH.items())


NP_OF = {"FP32": np.float32, "INT64": np.int64}

client = grpcclient.InferenceServerClient(url=args.url)
# tritonclient's own channel options: messages up to 2 GiB each way.
channel = grpc.insecure_channel(
    args.url,
    options=[
        ("grpc.max_send_message_length", 2**31 - 1),
        ("grpc.max_receive_message_length", 2**31 - 1),
    ],
)
stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

# --- health and metadata -----------------------------------------------------
check(client.is_server_live(headers=AUTH), "server live")
check(client.is_server_ready(headers=AUTH), "server ready")

meta = client.get_server_metadata(headers=AUTH)
check(
    meta.name == "distmind" and meta.version != "" and "model_repository" in meta.extensions,
    f"server metadata {meta.name} {meta.version} {list(meta.extensions)}",
)

names = sorted(m["name"] for m in MODELS)
index = client.get_model_repository_index(headers=AUTH)
check(
    sorted(e.name for e in index.models) == names
    and all(e.state == "READY" and e.version != "" and e.reason == "" for e in index.models),
    f"repository index {[(e.name, e.version, e.state) for e in index.models]}",
)
ready_only = stub.RepositoryIndex(service_pb2.RepositoryIndexRequest(ready=True), metadata=METADATA)
check(sorted(e.name for e in ready_only.models) == names, "ready-only repository index")

for m in MODELS:
    name = m["name"]
    md = client.get_model_metadata(name, headers=AUTH)
    want_inputs = [(t["name"], t["datatype"], t["protocol_shape"]) for t in m["inputs"]]
    got_inputs = [(t.name, t.datatype, list(t.shape)) for t in md.inputs]
    want_outputs = [(t["name"], t["datatype"], t["protocol_shape"]) for t in m["outputs"]]
    got_outputs = [(t.name, t.datatype, list(t.shape)) for t in md.outputs]
    check(
        md.name == name
        and md.platform != ""
        and len(md.versions) == 1
        and got_inputs == want_inputs
        and got_outputs == want_outputs
        and all(t.shape[0] == -1 for t in md.outputs),
        f"{name}: model metadata inputs {got_inputs} outputs {got_outputs}",
    )
    version = md.versions[0]
    check(client.is_model_ready(name, headers=AUTH), f"{name}: model ready")
    check(
        client.is_model_ready(name, model_version=version, headers=AUTH),
        f"{name}: version {version} ready",
    )
    md_v = client.get_model_metadata(name, model_version=version, headers=AUTH)
    check(md_v.name == name, f"{name}: metadata of version {version}")

check(not client.is_model_ready("no_such_model", headers=AUTH), "unknown model not ready")


# --- infer -----------------------------------------------------------------------
def inputs_of(m, x=None):
    spec = m["inputs"][0]
    x = load(f"{m['name']}.input.npy") if x is None else x
    i = grpcclient.InferInput(spec["name"], list(x.shape), spec["datatype"])
    i.set_data_from_numpy(x)
    return [i]


def outputs_equal(m, as_numpy):
    good = True
    for o in m["outputs"]:
        got = as_numpy(o["name"])
        want = load(f"{m['name']}.{o['name']}.npy")
        if not close(got, want):
            desc = None if got is None else f"{got.dtype}{got.shape}"
            print(f"      {o['name']}: got {desc}, want {want.dtype}{want.shape}")
            good = False
    return good


def infer_ok(m, **kw):
    outs = [grpcclient.InferRequestedOutput(o["name"]) for o in m["outputs"]]
    r = client.infer(m["name"], inputs_of(m), outputs=outs, request_id="req-1", headers=AUTH, **kw)
    resp = r.get_response()
    return (
        resp.model_name == m["name"]
        and resp.id == "req-1"
        and len(resp.raw_output_contents) == len(m["outputs"])
        and outputs_equal(m, r.as_numpy)
    )


for m in MODELS:
    check(infer_ok(m), f"{m['name']}: infer (raw inputs) equals distmind infer")

# The SLO and priority parameters: as tritonclient sends them (priority as
# uint64, an int parameter as int64, a float as double).
m = MODELS[0]
check(infer_ok(m, priority=1, parameters={"slo_ms": 60000}), f"{m['name']}: priority 1, slo_ms int64")
check(infer_ok(m, parameters={"slo_ms": 60000.5}), f"{m['name']}: slo_ms double")

# No `outputs`: every output, raw, in the model's order.
r = client.infer(m["name"], inputs_of(m), headers=AUTH)
resp = r.get_response()
check(
    [o.name for o in resp.outputs] == [o["name"] for o in m["outputs"]]
    and len(resp.raw_output_contents) == len(m["outputs"])
    and outputs_equal(m, r.as_numpy),
    f"{m['name']}: no outputs asked: all, raw, in order",
)


# Typed contents (what kserve's client sends for lists), straight through the stub.
def typed_request(m, x):
    spec = m["inputs"][0]
    t = service_pb2.ModelInferRequest.InferInputTensor(
        name=spec["name"], datatype=spec["datatype"], shape=list(x.shape)
    )
    if spec["datatype"] == "FP32":
        t.contents.fp32_contents.extend(x.flatten().tolist())
    else:
        t.contents.int64_contents.extend(x.flatten().tolist())
    return service_pb2.ModelInferRequest(model_name=m["name"], id="typed", inputs=[t])


for m in MODELS:
    resp = stub.ModelInfer(typed_request(m, load(f"{m['name']}.input.npy")), metadata=METADATA)
    by_name = {
        o.name: np.frombuffer(raw, dtype=NP_OF[o.datatype]).reshape(list(o.shape))
        for o, raw in zip(resp.outputs, resp.raw_output_contents)
    }
    check(
        resp.id == "typed" and len(resp.raw_output_contents) == len(resp.outputs) == len(m["outputs"])
        and outputs_equal(m, by_name.get),
        f"{m['name']}: infer (typed contents) equals distmind infer",
    )

# ModelStreamInfer: every model on one stream, answered in order; a bad
# request in the middle gets its error and the stream goes on.
answers = queue.Queue()
client.start_stream(callback=lambda result, error: answers.put((result, error)), headers=AUTH)
cnn = next(m for m in MODELS if m["inputs"][0]["datatype"] == "FP32")
x = load(f"{cnn['name']}.input.npy")
bad = np.zeros([1] + [d + 1 for d in x.shape[1:]], dtype=np.float32)
sent = [(m, f"stream-{i}") for i, m in enumerate(MODELS)]
for m, rid in sent[:2]:
    client.async_stream_infer(m["name"], inputs_of(m), request_id=rid)
client.async_stream_infer(cnn["name"], inputs_of(cnn, bad), request_id="stream-bad")
for m, rid in sent[2:]:
    client.async_stream_infer(m["name"], inputs_of(m), request_id=rid)
got = [answers.get(timeout=300) for _ in range(len(sent) + 1)]
client.stop_stream()
order = sent[:2] + [(None, "stream-bad")] + sent[2:]
for (m, rid), (result, error) in zip(order, got):
    if m is None:
        msg = error.message() if error else ""
        check(
            result is None and error is not None and "bad_request" in msg and "shape" in msg,
            f"stream: the wrong shape is answered with its error {msg!r}",
        )
    else:
        check(
            error is None
            and result.get_response().id == rid
            and outputs_equal(m, result.as_numpy),
            f"stream: {rid} ({m['name']}) in order and equal to distmind infer"
            + (f" (error {error})" if error else ""),
        )


# --- errors, each followed by a good request ----------------------------------
def still_serving(after):
    check(infer_ok(cnn), f"still serving after {after}")


def expect_error(what, call, code, words):
    expect_raised(what, call, f"StatusCode.{code}", words)


def expect_stub_error(what, call, code, words):
    try:
        call()
        check(False, f"{what}: no error raised")
    except grpc.RpcError as e:
        msg = e.details() or ""
        check(e.code() == code and all(w in msg for w in words), f"{what}: {e.code()} {msg!r}")


expect_error(
    "wrong shape",
    lambda: client.infer(cnn["name"], inputs_of(cnn, bad), headers=AUTH),
    "INVALID_ARGUMENT",
    ["bad_request", "shape", str(list(bad.shape))],
)
still_serving("a wrong shape")

# A raw entry that does not hold what the shape says (tritonclient never sends one).
spec = cnn["inputs"][0]
short = service_pb2.ModelInferRequest(
    model_name=cnn["name"],
    inputs=[service_pb2.ModelInferRequest.InferInputTensor(name=spec["name"], datatype="FP32", shape=list(x.shape))],
    raw_input_contents=[x.tobytes()[:-4]],
)
expect_stub_error(
    "raw contents shorter than the shape",
    lambda: stub.ModelInfer(short, metadata=METADATA),
    grpc.StatusCode.INVALID_ARGUMENT,
    ["bad_request", spec["name"], str(x.nbytes - 4)],
)
typed_short = typed_request(cnn, x)
del typed_short.inputs[0].contents.fp32_contents[-1]
expect_stub_error(
    "typed contents shorter than the shape",
    lambda: stub.ModelInfer(typed_short, metadata=METADATA),
    grpc.StatusCode.INVALID_ARGUMENT,
    ["bad_request", "fp32_contents", f"holds {x.size - 1} elements"],
)
slo_string = typed_request(cnn, x)
slo_string.parameters["slo_ms"].string_param = "fast"
expect_stub_error(
    "slo_ms as a string",
    lambda: stub.ModelInfer(slo_string, metadata=METADATA),
    grpc.StatusCode.INVALID_ARGUMENT,
    ["bad_request", "slo_ms", "fast"],
)
still_serving("malformed contents")

expect_error(
    "unknown model",
    lambda: client.infer("no_such_model", inputs_of(cnn), headers=AUTH),
    "NOT_FOUND",
    ["unknown_model", "no_such_model"],
)
expect_error(
    "metadata of an unknown model",
    lambda: client.get_model_metadata("no_such_model", headers=AUTH),
    "NOT_FOUND",
    ["unknown_model", "no_such_model"],
)
still_serving("an unknown model")

big = np.zeros([BODY_BYTES_MAX // (4 * int(np.prod(x.shape[1:]))) + 1] + list(x.shape[1:]), dtype=np.float32)
expect_error(
    "over-size message",
    lambda: client.infer(cnn["name"], inputs_of(cnn, big), headers=AUTH),
    "RESOURCE_EXHAUSTED",
    ["too_large", str(BODY_BYTES_MAX)],
)
still_serving("an over-size message")

# An rpc this server does not declare.
expect_error(
    "ModelConfig (not served)",
    lambda: client.get_model_config(cnn["name"], headers=AUTH),
    "UNIMPLEMENTED",
    ["unsupported", "/inference.GRPCInferenceService/ModelConfig", "ModelInfer"],
)
still_serving("an unimplemented rpc")

if args.token:
    expect_error(
        "missing token",
        lambda: client.infer(cnn["name"], inputs_of(cnn)),
        "UNAUTHENTICATED",
        ["unauthenticated", "api key"],
    )
    expect_error(
        "wrong token",
        lambda: client.infer(cnn["name"], inputs_of(cnn), headers={"authorization": "Bearer wrong-key"}),
        "UNAUTHENTICATED",
        ["unauthenticated", "not this server's api key"],
    )
    expect_error("live without the token", lambda: client.is_server_live(), "UNAUTHENTICATED", ["unauthenticated"])
    expect_stub_error(
        "index without the token",
        lambda: stub.RepositoryIndex(service_pb2.RepositoryIndexRequest()),
        grpc.StatusCode.UNAUTHENTICATED,
        ["unauthenticated"],
    )
    still_serving("a missing token")

client.close()
channel.close()
finish("gRPC")
