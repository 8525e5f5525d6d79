#!/usr/bin/env bash
# How much cheaper a batch must be for DistMind's batching to double mps's
# capacity at SLO. Runs `distmind bench capacity` (sim executor, 8 ResNet-152
# variants, equal memory, 100 ms SLO) once per variant of a profile measured
# on a GPU:
#
#   measured    the profile as it is;
#   without-b2  its batch-2 points dropped (batch 2 is then interpolated
#               between the measured batches 1 and 4);
#   free-h2d    its host-to-device rate 100x (a bound on what hiding the
#               switches' uploads could gain);
#   R8, a number: batch 1 as measured, and batch b rescaled to
#               t(b) = t(1) * (1 + (R8 - 1) * (b - 1) / 7), so that
#               R8 = t(8) / t(1); each layer keeps its share of the
#               measured run at that batch.
#
# Every variant but `measured` is a hypothesis about faster kernels or
# links, labelled "estimated": it says what the cuda executor would need,
# nothing about what it has.
#
# Usage: bash ae/gpu/batching.sh [PROFILE] [VARIANT ...]
#   PROFILE  default ae/gpu/results/h200-capacity/h200-resnet152-measured.json
#   VARIANT  default: measured without-b2 free-h2d 2.5 2.0 1.5
# OUT=DIR puts the CSVs and tables elsewhere (default
# ae/gpu/results/h200-capacity/batching); RATES and DURATION override the
# sweep. About 3-4 minutes per variant on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${DISTMIND_BIN:-target/release/distmind}"
[ -x "$BIN" ] || cargo build --release
PROFILE="${1:-ae/gpu/results/h200-capacity/h200-resnet152-measured.json}"
shift || true
VARIANTS=("$@")
[ ${#VARIANTS[@]} -gt 0 ] || VARIANTS=(measured without-b2 free-h2d 2.5 2.0 1.5)
OUT="${OUT:-ae/gpu/results/h200-capacity/batching}"
RATES="${RATES:-100,125,150,200,250,300,400,500}"
DURATION="${DURATION:-10s}"
# The model packages, generated once and reused (as ae/lib.sh's).
WORK="${AE_WORK:-ae/.work}/capacity"
mkdir -p "$OUT" "$WORK"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

for v in "${VARIANTS[@]}"; do
    p="$TMP/profile-$v.json"
    python3 - "$PROFILE" "$v" "$p" <<'EOF'
import json, re, sys
src, r8, dst = sys.argv[1], sys.argv[2], sys.argv[3]
prof = json.load(open(src))
if r8 == "without-b2":
    # The measured profile without its batch-2 point: batch 2 is then
    # interpolated between the measured batches 1 and 4.
    for key in [k for k in prof["models"] if k.endswith("/b2")]:
        del prof["models"][key]
    prof["source"] = "estimated"  # no longer the measurement as a whole
    prof["method"] = f"{src} without its batch-2 points (interpolated between batches 1 and 4)."
elif r8 == "free-h2d":
    # The measured profile with host-to-device copies 100x faster: what
    # capacity would be if no switch's upload cost anything.
    prof["peaks"]["h2d_bytes_per_s"] *= 100
    prof["source"] = "estimated"  # no longer the measurement as a whole
    prof["method"] = f"{src} with h2d_bytes_per_s 100x the measured rate."
elif r8 != "measured":
    r8 = float(r8)
    models = prof["models"]
    for key, m in models.items():
        fam, scale, b = re.fullmatch(r"(.+)/(.+)/b(\d+)", key).groups()
        b = int(b)
        one = models.get(f"{fam}/{scale}/b1")
        if b == 1 or one is None:
            continue
        want = one["total_s"] * (1 + (r8 - 1) * (b - 1) / 7)
        k = want / m["total_s"]
        for layer in m["layers"]:
            layer["time_s"] *= k
        m["total_s"] = want
    prof["source"] = "estimated"  # a hypothesis, labelled as not measured
    prof["method"] = (f"Derived from {src}: batch 1 as measured; batch b rescaled to "
                      f"t(1) * (1 + ({r8} - 1) * (b - 1) / 7), each layer keeping its "
                      "share of the measured run. A hypothesis, not a measurement.")
json.dump(prof, open(dst, "w"))
EOF
    echo "=== $v ($(date +%T))"
    rm -f "$OUT/capacity_$v.csv"
    "$BIN" --log-level warn bench capacity --profile "$p" --rates "$RATES" \
        --duration "$DURATION" --work-dir "$WORK" --csv "$OUT/capacity_$v.csv" 2>&1 |
        tee "$TMP/full.log" | sed -n '/^system /,$p' | tee "$OUT/capacity_$v.log"
    grep -q '^capacity ratio' "$OUT/capacity_$v.log" || { tail -20 "$TMP/full.log"; exit 1; }
done
