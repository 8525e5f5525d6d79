#!/usr/bin/env bash
# DistMind on a real GPU, and the simulator checked against it on the same
# machine. Needs an NVIDIA GPU with its driver, and libnvrtc + libcublas
# (CUDA 13, e.g. /usr/local/cuda/lib64 or PyTorch's nvidia/cu13/lib) on the
# loader path; about 3 minutes on an H100 with 16 cores.
#
#   1. the cuda executor's GPU tests (every family against the cpu
#      executor, pipelined uploads, half precision, layer timing, switches);
#   2. `distmind profile measure`: every layer of the five families at
#      batches 1-16, CUDA events, into results/<gpu>-measured-<date>.json;
#      ResNet-152 again with a batch's convolutions one GEMM per image (the
#      way before), compared with it;
#   3. `bench coldstart` with the cuda executor, then the sim executor with
#      the profile just measured (same machine, same loopback);
#   4. `up`: DistMind (half of 8 ResNet-152 in host cache and GPU memory)
#      next to mps (all 8 in host memory), closed loop, 4 clients, Zipf
#      0.9, SLO 100 ms, on the GPU and then on the sim executor;
#   5. `bench capacity` (capacity at SLO, mps against DistMind with the slo
#      policy, Poisson, equal memory) on the GPU and then on the sim executor
#      with the profile just measured: how far the simulator's capacity is
#      from the GPU's. At most 40 fresh clusters of 5 s (not timed yet);
#      CAPACITY=0 skips it.
#
# Usage: bash ae/gpu/run.sh            (OUT=DIR puts the results elsewhere)
#
# It builds with cargo (`--features cuda`). On a GPU machine without a Rust
# toolchain, build here and carry the binaries: DISTMIND_BIN=<distmind built
# with --features cuda> and CUDA_GPU_TEST=<the cuda_gpu test binary, from
# `cargo test -p distmind-runtime --release --features cuda --test cuda_gpu
# --no-run`>; with both set, nothing is built.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-ae/gpu/results}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: >"$LOG"
log() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

if [ -n "${DISTMIND_BIN:-}" ] && [ -n "${CUDA_GPU_TEST:-}" ]; then
    BIN=$DISTMIND_BIN
    GPU_TESTS=("$CUDA_GPU_TEST")
elif command -v cargo >/dev/null; then
    cargo build --release --features cuda || exit 1
    cargo test -p distmind-runtime --release --features cuda --test cuda_gpu --no-run || exit 1
    BIN=target/release/distmind
    GPU_TESTS=(cargo test -p distmind-runtime --release --features cuda --test cuda_gpu --)
else
    echo "no cargo here: set DISTMIND_BIN and CUDA_GPU_TEST to binaries built with --features cuda" >&2
    exit 1
fi
if [ -z "${DISTMIND_SKIP_LIBPATH:-}" ]; then
    # cudarc loads libnvrtc and libcublas at run time: find them.
    LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
        2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
    export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
fi

log machine
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 | tee -a "$LOG"

log cuda executor on the GPU
"${GPU_TESTS[@]}" --ignored --nocapture --test-threads=1 2>&1 | tee -a "$LOG"

PROFILE=$OUT/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 |
    awk '{print tolower($2)}')-measured-$(date -u +%F).json
log profile measure
$BIN --log-level warn profile measure --batch 1,2,4,8,16 --runs 20 --out "$PROFILE" 2>&1 | tee -a "$LOG"
$BIN profile compare settings/profiles/h200-estimated.json "$PROFILE" 2>&1 | tee -a "$LOG"
# A batch's convolutions as one GEMM per image (how they ran before) against
# one GEMM over the batch (now): B/A under 1 is what stacking gained.
log profile measure: ResNet-152, convolutions one GEMM per image
$BIN --log-level warn profile measure --family resnet152 --no-tiny --batch 1,2,4,8,16 --runs 20 \
    --per-image-conv --out "$OUT/resnet152-per-image-conv.json" 2>&1 | tee -a "$LOG"
$BIN profile compare "$OUT/resnet152-per-image-conv.json" "$PROFILE" 2>&1 | tee -a "$LOG"

log coldstart: cuda executor
$BIN --log-level warn bench coldstart --executor cuda --repeat 3 \
    --json "$OUT/coldstart_cuda.json" 2>&1 | tee -a "$LOG"
log coldstart: sim executor with the measured profile
$BIN --log-level warn bench coldstart --executor sim --profile "$PROFILE" --repeat 3 \
    --json "$OUT/coldstart_sim.json" 2>&1 | tee -a "$LOG"

rm -f "$OUT/up.csv"
COMMON=(--family resnet152 --models 8 --mode closed --concurrency 4 --zipf 0.9 --slo-ms 100
    --device-memory 930MiB --duration 12s --csv "$OUT/up.csv" --child-log error)
for ex in cuda sim; do
    P=()
    [ "$ex" = sim ] && P=(--profile "$PROFILE")
    log "up: distmind on $ex"
    $BIN --log-level warn up --executor $ex "${P[@]}" "${COMMON[@]}" --system distmind \
        --cache 940MiB --warm-cache --label "distmind_$ex" 2>&1 | tee -a "$LOG"
    log "up: mps on $ex"
    $BIN --log-level warn up --executor $ex "${P[@]}" "${COMMON[@]}" --system mps \
        --label "mps_$ex" 2>&1 | tee -a "$LOG"
done

if [ "${CAPACITY:-1}" != 0 ]; then
    for ex in cuda sim; do
        P=()
        [ "$ex" = sim ] && P=(--profile "$PROFILE")
        log "capacity at SLO on $ex"
        rm -f "$OUT/capacity_$ex.csv"
        # A fresh cluster per rate; `up` runs one untimed inference per
        # device first on cuda (--warm-devices), so no point pays the
        # runtime's first run.
        $BIN --log-level warn bench capacity --executor $ex "${P[@]}" \
            --rates 25,50,75,100,125,150,200,250,300,400 --duration 5s \
            --csv "$OUT/capacity_$ex.csv" 2>&1 | grep -v '^up: ' | tee -a "$LOG"
    done
fi
log done
