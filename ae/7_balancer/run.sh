#!/usr/bin/env bash
# Test 7, load balancer vs LFU (the paper's figure 12a): DistMind's
# cache-aware load balancer (`lor`: least outstanding, cache-out of the
# least-requested model) against LFU cache replacement (`lfu`), under Zipf
# popularity from uniform to skewed. 8 ResNet-152 variants, one simulated
# GPU with parameter memory for 4, a host cache for 4, 2 memory servers,
# 4 closed-loop clients, batch 1; the paper's balance (V100 profile,
# emulated 100 Gbit/s).
# Then the paper's scale in the simulator (fig12a-sim): 128 variants on 4 GPU
# servers x 8 GPUs with 4 GiB host caches, 4 memory servers, 100 Gbit/s.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/7_balancer"
RES="$HERE/results"
CSV="$RES/balancer.csv"
SIM_CSV="$RES/balancer-sim.csv"
mkdir -p "$RES"
[ -n "${PLOT_ONLY:-}${SIM_ONLY:-}" ] || rm -f "$CSV"
N="${N:-8}"
mib=$(stored_mib resnet152)
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-45}" emu_duration paper)"
echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
if [ -z "${PLOT_ONLY:-}${SIM_ONLY:-}" ]; then
    for z in 0 0.9 0.99; do
        for bal in lor lfu; do
            echo "== zipf $z, $bal"
            up_emu paper --family resnet152 --models "$N" --mode closed --concurrency 4 --zipf "$z" --batch 1 \
                --slo-ms 100 --period 1 --duration "$dur" --test balancer --csv "$CSV" \
                --device-memory "$(( N * mib / 2 ))MiB" --capacity "$(( N * mib * 11 / 20 + 64 ))MiB" \
                --system distmind --warm-cache --cache "$(( N * mib / 2 + 8 ))MiB" --balancer "$bal" --label "$bal" >/dev/null
        done
    done
fi
cut -d, -f2,6,19,20,24,25 "$CSV"
awk -F, 'NR==1 {print $0 ",workload"; next} {print $0 ",zipf " $6}' "$CSV" > "$RES/balancer-plot.csv"
"$BIN" plot bars --csv "$RES/balancer-plot.csv" --out "$RES/fig12a-balancer.png" \
    --x workload --series system --series-order lor,lfu --y throughput_rps \
    --title "Test 7: load balancer vs LFU, $N ResNet-152 variants, host cache for half" \
    --y-label "throughput (requests/s, batch 1, emulated time)" --x-label "model popularity" \
    --caption "1 simulated GPU, 2 memory servers, emulated 100gbit link (loopback bucket $(csv_get "$CSV" loopback system=lor))"

if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for z in 0 0.9 0.99; do
        for bal in lor lfu; do
            for seed in $SIM_SEEDS; do
                sim_paper --family resnet152 --models 128 --mode closed --concurrency 32 --zipf "$z" --batch 1 \
                    --slo-ms 100 --period 1 --duration 60s --test balancer --csv "$SIM_CSV" --seed "$seed" \
                    --system distmind --cache "$PAPER_CACHE" --balancer "$bal" --label "$bal" >/dev/null
            done
        done
    done
fi
awk -F, 'NR==1 {print $0 ",workload"; next} {print $0 ",zipf " $6}' "$SIM_CSV" > "$RES/balancer-sim-plot.csv"
"$BIN" plot bars --csv "$RES/balancer-sim-plot.csv" --out "$RES/fig12a-sim-balancer.png" \
    --x workload --series system --series-order lor,lfu --y throughput_rps \
    --title "Test 7 at the paper's scale (simulated): load balancer vs LFU, 128 ResNet-152 variants" \
    --y-label "throughput (requests/s, batch 1)" --x-label "model popularity" \
    --caption "simulated: 4 GPU servers x 8 GPUs, 4 GiB host caches, 4 memory servers, 100gbit, 32 closed-loop clients; mean of seeds $SIM_SEEDS"
t() { csv_get "$CSV" throughput_rps "system=$1" "zipf=$2"; }
st() { csv_mean "$SIM_CSV" throughput_rps "system=$1" "zipf=$2"; }
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline: lor_vs_lfu_zipf0=$(ratio "$(t lor 0)" "$(t lfu 0)") lor_vs_lfu_zipf0.9=$(ratio "$(t lor 0.9)" "$(t lfu 0.9)") lor_vs_lfu_zipf0.99=$(ratio "$(t lor 0.99)" "$(t lfu 0.99)") sim_lor_vs_lfu_zipf0=$(ratio "$(st lor 0)" "$(st lfu 0)") sim_lor_vs_lfu_zipf0.9=$(ratio "$(st lor 0.9)" "$(st lfu 0.9)") sim_lor_vs_lfu_zipf0.99=$(ratio "$(st lor 0.99)" "$(st lfu 0.99)")"
