#!/usr/bin/env python3
"""Submits one training job and watches it to its end through
`distmind train status --json`; prints one CSV row:
wall_s,samples_per_s,first_loss,final_loss,tail_s_per_iteration,state,
generation,partition (losses: the last stage's mean over the first and the
last fifth of the iterations it reported, both pipelines together;
tail_s_per_iteration: wall seconds per iteration over the last fifth, from
when every worker was first seen past each iteration)."""
import json
import subprocess
import sys
import time

bin_, settings, controller, spec = sys.argv[1:5]
extra = sys.argv[5:]
common = ["--settings", settings, "--controller", controller]
t0 = time.monotonic()
out = subprocess.run([bin_, "--log-level", "warn", "train", "submit", "--spec", spec] + extra + common,
                     capture_output=True, text=True)
if out.returncode != 0:
    print(out.stderr.strip(), file=sys.stderr)
    print("-,-,-,-,-,refused,-,-")
    sys.exit(0)
job = out.stdout.split()[1]
losses = {}
seen = {}
while True:
    st = subprocess.run([bin_, "--log-level", "warn", "train", "status", "--json", "--job", job] + common,
                        capture_output=True, text=True, check=True)
    j = json.loads(st.stdout)[0]
    for s in j["stages"]:
        if s.get("loss") is not None and s.get("iteration"):
            losses.setdefault(s["pipeline"], {})[s["iteration"]] = s["loss"]
    done = min(s.get("iteration") or 0 for s in j["stages"])
    seen.setdefault(done, time.monotonic())
    state = j["state"] if isinstance(j["state"], str) else next(iter(j["state"]))
    if state in ("finished", "failed", "stopped"):
        break
    if time.monotonic() - t0 > 1800:
        subprocess.run([bin_, "train", "stop", "--job", job] + common, capture_output=True)
        state = "timeout"
        break
    time.sleep(0.05)
wall = time.monotonic() - t0
spec_j = j["spec"]
samples = spec_j["batch"] * spec_j["pipelines"] * min(s.get("iteration") or 0 for s in j["stages"])


def fifth(first):
    vals = []
    for per in losses.values():
        xs = [per[i] for i in sorted(per)]
        k = max(1, len(xs) // 5)
        vals.extend(xs[:k] if first else xs[-k:])
    return sum(vals) / len(vals) if vals else float("nan")


iters = spec_j["iterations"]
tail = sorted(i for i in seen if i >= iters - iters // 5)
tail_s = (seen[tail[-1]] - seen[tail[0]]) / (tail[-1] - tail[0]) if len(tail) > 1 and tail[-1] > tail[0] else float("nan")
print(f"{wall:.2f},{samples / wall:.1f},{fifth(True):.4f},{fifth(False):.4f},{tail_s:.4f},{state},"
      f"{j['generation']},{'/'.join(str(x) for x in j['partition'])}")
