#!/usr/bin/env bash
# Second device call: capacity at SLO on the real GPU (cuda) with one
# stalled sample no longer able to shut a model out (prefetches report their
# load's own time; a sample counts for at most 4x the estimate), at rates
# this GPU can hold; then the sim executor with this GPU's measured profile,
# same machine, same rates, with a profile of ResNet-152 measured first.
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
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
log profile measure: resnet152, this machine
PROFILE=$OUT/$GPU-resnet152-measured.json
timeout 60 $D/distmind --log-level warn profile measure --family resnet152 --no-tiny --batch 1,2,4,8,16 \
  --out $PROFILE 2>&1 | grep -v "^$"
[ -s $PROFILE ] || PROFILE=$(ls settings/profiles/$GPU-measured-*.json | tail -1)
echo "gpu $GPU, profile $PROFILE"
RATES=25,50,75,100,125,150,200,250
W=/tmp/capwork
log capacity cuda
timeout 230 $D/distmind --log-level warn bench capacity --executor cuda --rates $RATES --duration 5s \
  --work-dir $W --csv $OUT/capacity_cuda.csv > $OUT/capacity_cuda.log 2>&1
grep -E "^capacity|^slo rejects|^\(" $OUT/capacity_cuda.log
log capacity sim with the measured profile
timeout 190 $D/distmind --log-level warn bench capacity --executor sim --profile $PROFILE --rates $RATES \
  --duration 5s --work-dir $W --csv $OUT/capacity_sim.csv > $OUT/capacity_sim.log 2>&1
grep -E "^capacity|^slo rejects|^\(" $OUT/capacity_sim.log
log done
