#!/usr/bin/env bash
# Second call: up on cuda, distmind and mps interleaved (this code; mps
# also with the code before), and two more cpu cold starts on 16 cores.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind $D/distmind-base
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
log() { echo "=== $* ($(date +%T))"; }
UP=(--log-level warn up --executor cuda --family resnet152 --mode closed --concurrency 4 --zipf 0.9
    --period 1 --batch 1 --slo-ms 100 --capacity 1084MiB --device-memory 928MiB --models 8
    --duration 12s --child-log error --csv $OUT/up2.csv)
for round in 3 4; do
  log "up cuda mps new round $round"
  timeout 60 $D/distmind "${UP[@]}" --system mps --label mps_new > $OUT/up_mps_$round.log 2>&1
  grep -E "serial path|throughput|answered" $OUT/up_mps_$round.log
  log "up cuda distmind new round $round"
  timeout 60 $D/distmind "${UP[@]}" --system distmind --warm-cache --cache 1920MiB --label distmind_new > $OUT/up_dm_$round.log 2>&1
  grep -E "serial path|throughput|answered" $OUT/up_dm_$round.log
done
log "up cuda mps base"
timeout 60 $D/distmind-base "${UP[@]}" --system mps --label mps_base 2>&1 | grep -E "serial path|throughput|answered"
for r in 2 3; do
  log "coldstart cpu 16 cores run $r"
  timeout 100 $D/distmind --log-level warn bench coldstart --executor cpu --json $OUT/coldstart_cpu16_$r.json
done
log done
