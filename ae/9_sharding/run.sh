#!/usr/bin/env bash
# Test 9, sharding schemes (the paper's figure 13): how each model's
# parameter groups are spread over the memory servers (`deploy --strategy`):
# hybrid (every group split over up to 4 servers, DistMind's), per-app (the
# whole model on one server), horizontal (group i on server i mod 4),
# vertical (the model cut into 4 contiguous ranges).
# Real processes on an emulated 100 Gbit/s link: 8 ResNet-152 variants on 4
# memory servers (each with its own emulated NIC), one GPU server with one
# simulated GPU holding 4 (V100 profile, estimated) and a host cache for 2,
# 4 closed-loop clients, Zipf 0.9, batch 1. With one GPU server no memory
# server is shared by concurrent pulls, so the schemes differ little here.
# Then the paper's scale in the simulator (fig13-sim): 128 variants, 4 GPU
# servers x 8 GPUs holding one model each (the original's GPU worker),
# 4 GiB host caches, 4 memory servers, uniform and Zipf 0.9 popularity.
# Requests carry a 10 s SLO (none to speak of): these tests measure
# throughput, and a request failed at its deadline would free its client early.
# SIM_ONLY=1 keeps the real runs' CSV and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/9_sharding"
RES="$HERE/results"
CSV="$RES/sharding.csv"
SIM_CSV="$RES/sharding-sim.csv"
mkdir -p "$RES"
N=8
mib=$(stored_mib resnet152)
STRATEGIES="hybrid per-app horizontal vertical"
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-40}" emu_duration paper)"
if [ -z "${SIM_ONLY:-}${PLOT_ONLY:-}" ]; then
    rm -f "$CSV"
    echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
    for st in $STRATEGIES; do
        echo "== $st"
        up_emu paper --family resnet152 --models "$N" --mode closed --concurrency 4 --zipf 0.9 --batch 1 \
            --slo-ms 10000 --period 1 --duration "$dur" --test sharding --csv "$CSV" --memservers 4 \
            --strategy "$st" --device-memory "$(( N * mib / 2 ))MiB" --capacity "$(( N * mib * 6 / 10 + 64 ))MiB" \
            --system distmind --cache "$(( 2 * mib + 8 ))MiB" --label "$st" >/dev/null
    done
fi
# The real runs' table and figure (when their CSV is there).
if [ -f "$CSV" ]; then
    cut -d, -f2,19,20,24,38 "$CSV"
    "$BIN" plot bars --csv "$CSV" --out "$RES/fig13-sharding.png" \
        --x system --y throughput_rps --whisker-low lat_p50_ms --whisker-high lat_p99_ms \
        --title "Test 9: throughput by sharding scheme, $N ResNet-152 variants, 4 memory servers" \
        --y-label "throughput (requests/s, batch 1, emulated time)" --x-label "sharding scheme" \
        --caption "1 simulated GPU holding 4, host cache for 2, 4 clients, zipf 0.9, emulated 100gbit (loopback bucket $EMU_LOOPBACK)"
fi

if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for z in 0 0.9; do
        for st in $STRATEGIES; do
            for seed in $SIM_SEEDS; do
                sim_paper --family resnet152 --models 128 --mode closed --concurrency 32 --zipf "$z" --batch 1 \
                    --slo-ms 10000 --period 1 --duration 60s --device-memory 256MiB --seed "$seed" \
                    --system distmind --cache "$PAPER_CACHE" --strategy "$st" --label "$st" \
                    --test "zipf-$z" --csv "$SIM_CSV" >/dev/null
            done
        done
    done
fi
"$BIN" plot bars --csv "$SIM_CSV" --out "$RES/fig13-sim-sharding.png" \
    --x test --series system --series-order hybrid,per-app,horizontal,vertical --y throughput_rps \
    --title "Test 9 at the paper's scale (simulated): throughput by sharding scheme, 128 ResNet-152" \
    --y-label "throughput (requests/s, batch 1)" --x-label "model popularity" \
    --caption "simulated: 4 GPU servers x 8 GPUs (one model each), 4 GiB host caches, 4 memory servers, 100gbit, 32 clients; mean of seeds $SIM_SEEDS"
t() { csv_get "$CSV" throughput_rps "system=$1"; }
st() { csv_mean "$SIM_CSV" throughput_rps "system=$1" "test=zipf-0.9"; }
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline: hybrid_vs_per_app=$(ratio "$(t hybrid)" "$(t per-app)") hybrid_vs_horizontal=$(ratio "$(t hybrid)" "$(t horizontal)") hybrid_vs_vertical=$(ratio "$(t hybrid)" "$(t vertical)") sim_hybrid_vs_per_app=$(ratio "$(st hybrid)" "$(st per-app)") sim_hybrid_vs_horizontal=$(ratio "$(st hybrid)" "$(st horizontal)") sim_hybrid_vs_vertical=$(ratio "$(st hybrid)" "$(st vertical)")"
