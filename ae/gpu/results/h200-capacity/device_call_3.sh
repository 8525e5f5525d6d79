#!/usr/bin/env bash
# Third device call (diagnosis): one capacity point of DistMind (slo) at
# 25 req/s on cuda, every process logging at debug level: per-request
# pipeline timings (runtime) and the dispatcher's reasons for rejecting.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
UP=(--log-level warn up --executor cuda --family resnet152 --mode poisson --batch 1 --models 8
  --duration 5s --zipf 0.9 --slo-ms 100 --seed 0 --capacity 1084MiB --device-memory 928MiB
  --work-dir /tmp/w --child-log debug)
timeout 60 $D/distmind "${UP[@]}" --rate 25 --system distmind --policy slo --warm-cache --cache 1920MiB \
  > $OUT/diag_distmind.log 2>&1
grep -E "SLO attainment|rejected|p99" $OUT/diag_distmind.log | head
timeout 60 $D/distmind "${UP[@]}" --rate 25 --system mps --cache 1920MiB > $OUT/diag_mps.log 2>&1
grep -E "SLO attainment|p99" $OUT/diag_mps.log | head
ls -la $OUT
