#!/usr/bin/env bash
# Test 8, cache size x reassignment period (the paper's figure 12b):
# DistMind's throughput as its host cache grows, for several periods of the
# original policy (one GPU reassigned to a Zipf-drawn model every period).
# Real processes on an emulated 100 Gbit/s link: 8 ResNet-152 variants, one
# simulated GPU with parameter memory for 4 (V100 profile, estimated), 2
# memory servers, 4 closed-loop clients, Zipf 0.9, batch 1, caches for 2, 4
# and 8 models, periods 0.5, 1 and 2 s.
# Then the paper's scale in the simulator (fig12b-sim): 128 variants, 4 GPU
# servers x 8 GPUs holding one model each (the original's GPU worker),
# caches of 1 to 16 GiB, periods 0.1 to 2 s.
# Requests carry a 10 s SLO (none to speak of): these tests measure
# throughput, and a request failed at its deadline would free its client early.
# SIM_ONLY=1 keeps the real runs' CSV and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/8_cache_period"
RES="$HERE/results"
CSV="$RES/cache-period.csv"
SIM_CSV="$RES/cache-period-sim.csv"
mkdir -p "$RES"
N=8
mib=$(stored_mib resnet152)
CACHES="${CACHES:-2 4 8}"
PERIODS="${PERIODS:-0.5 1 2}"
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-40}" emu_duration paper)"
if [ -z "${SIM_ONLY:-}${PLOT_ONLY:-}" ]; then
    rm -f "$CSV"
    echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
    for c in $CACHES; do
        for p in $PERIODS; do
            echo "== cache for $c models, period $p s"
            up_emu paper --family resnet152 --models "$N" --mode closed --concurrency 4 --zipf 0.9 --batch 1 \
                --slo-ms 10000 --period "$p" --duration "$dur" --test "cache-${c}-models" --csv "$CSV" \
                --device-memory "$(( N * mib / 2 ))MiB" --capacity "$(( N * mib * 11 / 20 + 64 ))MiB" \
                --system distmind --cache "$(( c * mib + 8 ))MiB" --label "period ${p}s" >/dev/null
        done
    done
fi
# The real runs' table and figure (when their CSV is there).
if [ -f "$CSV" ]; then
    cut -d, -f1,2,7,8,19,20,24 "$CSV"
    "$BIN" plot bars --csv "$CSV" --out "$RES/fig12b-cache-period.png" \
        --x test --series system --y throughput_rps \
        --title "Test 8: throughput by host cache size and reassignment period, $N ResNet-152 variants" \
        --y-label "throughput (requests/s, batch 1, emulated time)" --x-label "host cache" \
        --caption "1 simulated GPU holding 4, 2 memory servers, 4 clients, zipf 0.9, emulated 100gbit (loopback bucket $EMU_LOOPBACK)"
fi

SIM_CACHES="${SIM_CACHES:-2 4 8 16 32}"
SIM_PERIODS="${SIM_PERIODS:-0.1 0.5 1 2}"
if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for c in $SIM_CACHES; do
        for p in $SIM_PERIODS; do
            for seed in $SIM_SEEDS; do
                sim_paper --family resnet152 --models 128 --mode closed --concurrency 32 --zipf 0.9 --batch 1 \
                    --slo-ms 10000 --period "$p" --duration 60s --device-memory 256MiB --seed "$seed" \
                    --system distmind --cache "${c}GiB" --test "cache-${c}GiB" --label "period ${p}s" \
                    --csv "$SIM_CSV" >/dev/null
            done
        done
    done
fi
"$BIN" plot bars --csv "$SIM_CSV" --out "$RES/fig12b-sim-cache-period.png" \
    --x test --series system --y throughput_rps \
    --title "Test 8 at the paper's scale (simulated): throughput by host cache and period, 128 ResNet-152" \
    --y-label "throughput (requests/s, batch 1)" --x-label "host cache per GPU server" \
    --caption "simulated: 4 GPU servers x 8 GPUs (one model each), 4 memory servers, 100gbit, 32 clients, zipf 0.9; mean of seeds $SIM_SEEDS"
st() { csv_mean "$SIM_CSV" throughput_rps "test=cache-$1GiB"; }
first="${CACHES%% *}"; last="${CACHES##* }"
sfirst="${SIM_CACHES%% *}"; slast="${SIM_CACHES##* }"
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline: cache${last}_vs_cache${first}=$(ratio "$(csv_mean "$CSV" throughput_rps "test=cache-$last-models")" "$(csv_mean "$CSV" throughput_rps "test=cache-$first-models")") sim_cache${slast}GiB_vs_${sfirst}GiB=$(ratio "$(st "$slast")" "$(st "$sfirst")")"
