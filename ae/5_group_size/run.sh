#!/usr/bin/env bash
# Test 5, group size (the paper's figure 11a): the latency of a cold start
# (the first request of a model on no GPU and in no host cache: pulled from
# the memory servers, copied to the GPU and run, pipelined group by group)
# as the parameter group size goes from one layer per group to the whole
# model in one group, per model family. Real processes and transfers on an
# emulated 100 Gbit/s link, GPU time from the estimated V100 profile, batch
# 8 (`distmind bench coldstart`, 2 memory servers, medians of 3).
# Then the paper's scale in the simulator (fig11a-sim): 128 ResNet-152
# variants pulled from 4 memory servers by 4 GPU servers x 8 GPUs with 4 GiB
# host caches, the same group sizes, one model resident per GPU (the
# original's GPU worker; with room for several, the GPUs soon hold the
# whole set and nothing is loaded). The simulator has no per-group cost (a
# read's round trip, a gate's wake-up), so it shows only what pipelining
# gains; the real runs show both.
# Requests carry a 10 s SLO (none to speak of): these tests measure
# throughput, and a request failed at its deadline would free its client early.
# SIM_ONLY=1 keeps the real runs' CSV and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/5_group_size"
RES="$HERE/results"
CSV="$RES/group-size.csv"
SIM_CSV="$RES/group-size-sim.csv"
mkdir -p "$RES"
# One group per layer (1 byte), 1, 4, 16 MB, the default 32.8 MB, 128 MB,
# and the whole model (512 MiB).
SIZES="${SIZES:-1,1000000,4000000,16000000,32768000,128000000,536870912}"
if [ -z "${SIM_ONLY:-}${PLOT_ONLY:-}" ]; then
    rm -f "$CSV"
    echo "emulated links on loopback buckets of $EMU_LOOPBACK"
    "$BIN" --log-level warn bench coldstart --executor sim --profile "$SETTINGS/profiles/v100-estimated.json" \
        --emulate-link 100gbit --emulate-loopback "$EMU_LOOPBACK" --batch 8 --repeat 3 \
        --group-bytes "$SIZES" --csv "$CSV"
fi
# x: the group size, readable.
label() { awk -v b="$1" 'BEGIN { if (b == 1) print "per-layer"; else if (b >= 536870912) print "whole-model"; else printf "%gMB\n", b / 1e6 }'; }
awk -F, -v OFS=, 'NR == 1 { print $0, "group_size"; next }
    { b = $2; g = (b == 1) ? "per-layer" : (b >= 536870912 ? "whole-model" : sprintf("%gMB", b / 1e6)); print $0, g }' \
    "$CSV" > "$RES/group-size-plot.csv"
"$BIN" plot bars --csv "$RES/group-size-plot.csv" --out "$RES/fig11a-group-size.png" \
    --x group_size --series family --y pipelined_ms --log-y \
    --title "Test 5: cold-start latency by parameter group size (batch 8)" \
    --y-label "first-request latency (ms, emulated, log)" --x-label "parameter group size" \
    --caption "bench coldstart: 2 memory servers, emulated 100gbit link (loopback bucket $EMU_LOOPBACK), medians of 3"

if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for b in ${SIZES//,/ }; do
        for seed in $SIM_SEEDS; do
            sim_paper --family resnet152 --models 128 --mode closed --concurrency 32 --zipf 0.9 --batch 1 --slo-ms 10000 \
                --duration 60s --group-bytes "$b" --system distmind --cache "$PAPER_CACHE" --seed "$seed" \
                --device-memory 256MiB \
                --test "$(label "$b")" --csv "$SIM_CSV" >/dev/null
        done
    done
fi
"$BIN" plot bars --csv "$SIM_CSV" --out "$RES/fig11a-sim-group-size.png" \
    --x test --y lat_mean_ms --whisker-low lat_p50_ms --whisker-high lat_p99_ms --log-y \
    --title "Test 5 at the paper's scale (simulated): latency by group size, 128 ResNet-152 variants" \
    --y-label "latency (ms, log): bar mean, whisker p50..p99" --x-label "parameter group size" \
    --caption "simulated (no per-group cost): 4 GPU servers x 8 GPUs (one model each), 4 GiB host caches, 4 memory servers, 100gbit, 32 clients, zipf 0.9; mean of seeds $SIM_SEEDS"
p() { csv_get "$CSV" pipelined_ms family=resnet152 "group_bytes=$1"; }
s() { csv_mean "$SIM_CSV" lat_p50_ms "test=$1"; }
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline: resnet152_per_layer_vs_default=$(ratio "$(p 1)" "$(p 32768000)") resnet152_whole_vs_default=$(ratio "$(p 536870912)" "$(p 32768000)") sim_whole_vs_default_p50=$(ratio "$(s whole-model)" "$(s 32.768MB)")"
