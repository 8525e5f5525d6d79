#!/usr/bin/env bash
# Fourth device call: capacity at SLO on the real GPU (cuda) after the
# device's warm-up run (its first inference, 150 ms against about 5 ms after)
# is no longer learnt from; same rates as the second call.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
log capacity cuda
timeout 225 $D/distmind --log-level warn bench capacity --executor cuda --rates 25,50,75,100,125,150,200,250 \
  --duration 5s --work-dir /tmp/capwork --csv $OUT/capacity_cuda.csv > $OUT/capacity_cuda.log 2>&1
grep -E "^capacity|^slo rejects|^\(" $OUT/capacity_cuda.log
log done
