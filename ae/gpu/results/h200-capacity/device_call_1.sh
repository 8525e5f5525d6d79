#!/usr/bin/env bash
# One device call: the cuda executor's GPU tests on this code; capacity at
# SLO on the real GPU (cuda) and on the sim executor with this GPU's
# measured profile, same machine, same rates; cpu cold starts on 16 cores.
set -uo pipefail
D=.dev
for f in $D/*.gz; do gunzip -f "$f"; done
chmod +x $D/distmind $D/cuda_gpu $D/runtime_lib
LIBS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libnvrtc.so.1*' -o -name 'libcublas.so.1*' \) \
    2>/dev/null | xargs -r -n1 dirname | sort -u | tr '\n' ':')
export LD_LIBRARY_PATH="${LIBS}${LD_LIBRARY_PATH:-}"
log() { echo "=== $* ($(date +%T))"; }
log env
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
nproc
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
PROFILE=$(ls settings/profiles/$GPU-measured-*.json | tail -1)
echo "gpu $GPU, profile $PROFILE"
log cuda_gpu tests
timeout 90 $D/cuda_gpu --ignored --nocapture --test-threads=1 2>&1 | grep -v "^$"
log cuda unit tests
timeout 30 $D/runtime_lib cuda --test-threads=4 2>&1 | grep -E "test result|FAIL|panick"
RATES=100,150,200,300,400,600,800,1000
W=/tmp/capwork
log capacity cuda
timeout 200 $D/distmind --log-level warn bench capacity --executor cuda --rates $RATES --duration 5s \
  --work-dir $W --csv $OUT/capacity_cuda.csv > $OUT/capacity_cuda.log 2>&1
grep -E "^capacity|^slo rejects|^\(" $OUT/capacity_cuda.log
log capacity sim with the measured profile
timeout 150 $D/distmind --log-level warn bench capacity --executor sim --profile $PROFILE --rates $RATES \
  --duration 5s --work-dir $W --csv $OUT/capacity_sim.csv > $OUT/capacity_sim.log 2>&1
grep -E "^capacity|^slo rejects|^\(" $OUT/capacity_sim.log
log coldstart cpu 16 cores
timeout 70 $D/distmind --log-level warn bench coldstart --executor cpu --json $OUT/coldstart_cpu16.json
log done
