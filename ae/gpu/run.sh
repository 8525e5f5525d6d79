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
#   3. `bench coldstart` with the cuda executor, then the sim executor with
#      the profile just measured (same machine, same loopback);
#   4. `up`: DistMind (half of 8 ResNet-152 in host cache and GPU memory)
#      next to mps (all 8 in host memory), closed loop, 4 clients, Zipf
#      0.9, SLO 100 ms, on the GPU and then on the sim executor.
#
# Usage: bash ae/gpu/run.sh            (OUT=DIR puts the results elsewhere)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-ae/gpu/results}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
: >"$LOG"
log() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

cargo build --release --features cuda
cargo test -p distmind-runtime --release --features cuda --test cuda_gpu --no-run
BIN=target/release/distmind
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
cargo test -p distmind-runtime --release --features cuda --test cuda_gpu -- \
    --ignored --nocapture --test-threads=1 2>&1 | tee -a "$LOG"

PROFILE=$OUT/$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 |
    awk '{print tolower($2)}')-measured-$(date -u +%F).json
log profile measure
$BIN --log-level warn profile measure --batch 1,2,4,8,16 --runs 20 --out "$PROFILE" 2>&1 | tee -a "$LOG"
$BIN profile compare settings/profiles/h200-estimated.json "$PROFILE" 2>&1 | tee -a "$LOG"

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
log done
