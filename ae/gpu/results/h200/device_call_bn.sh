#!/usr/bin/env bash
# Third call: batch norm computed from the layer's params in one kernel (no
# fold kernel, no folded copy per program) against the code before it.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind $D/distmind-prev $D/cuda_gpu
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
log cuda_gpu tests
timeout 90 $D/cuda_gpu --ignored --nocapture --test-threads=1 2>&1 | grep -v "^$"
for b in prev new; do
  bin=$D/distmind; [ $b = prev ] && bin=$D/distmind-prev
  log "coldstart cuda $b"
  timeout 40 $bin --log-level warn bench coldstart --executor cuda --repeat 3 --json $OUT/coldstart_cuda_$b.json
done
UP=(--log-level warn up --executor cuda --family resnet152 --mode closed --concurrency 4 --zipf 0.9
    --period 1 --batch 1 --slo-ms 100 --capacity 1084MiB --device-memory 928MiB --models 8
    --duration 12s --child-log error --csv $OUT/up3.csv --system distmind --warm-cache --cache 1920MiB)
for round in 1 2; do
  for b in prev new; do
    bin=$D/distmind; [ $b = prev ] && bin=$D/distmind-prev
    log "up cuda distmind $b round $round"
    timeout 45 $bin "${UP[@]}" --label distmind_$b 2>&1 | grep -E "serial path|throughput|answered|p99"
  done
done
log done
