#!/usr/bin/env bash
# One device call: the cuda executor's GPU tests with compiled-once
# programs, up on cuda A/B (this code vs the code before it), cold starts.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind $D/distmind-base $D/cuda_gpu
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
nproc
log cuda_gpu tests
timeout 120 $D/cuda_gpu --ignored --nocapture --test-threads=1
UP=(--log-level warn up --executor cuda --family resnet152 --mode closed --concurrency 4 --zipf 0.9
    --period 1 --batch 1 --slo-ms 100 --capacity 1084MiB --device-memory 928MiB --models 8
    --duration 12s --child-log error --csv $OUT/up.csv)
for round in 1 2; do
  for b in base new; do
    bin=$D/distmind; [ $b = base ] && bin=$D/distmind-base
    log "up cuda distmind $b round $round"
    timeout 60 $bin "${UP[@]}" --system distmind --warm-cache --cache 1920MiB --label distmind_$b 2>&1 |
      grep -E "serial path|throughput|p99|answered|error|Error" 
  done
done
log "up cuda mps new"
timeout 60 $D/distmind "${UP[@]}" --system mps --label mps_new 2>&1 | grep -E "serial path|throughput|p99|answered|error|Error"
log coldstart cuda
timeout 60 $D/distmind --log-level warn bench coldstart --executor cuda --repeat 3 --json $OUT/coldstart_cuda.json
log coldstart cpu 16 cores
timeout 120 $D/distmind --log-level warn bench coldstart --executor cpu --trace --json $OUT/coldstart_cpu16.json
log done
