#!/usr/bin/env bash
# Test 3, sharing inference and training (the paper's figure 9): the
# controller moves GPUs between inference and training each second as
# `inference_workload_s` says; utilization over time is inference throughput
# over the GPUs' inference bound plus training iterations over their training
# bound, stacked. Training iterations on the sim executor take 3 forward
# passes at batch 96 (estimated, like every GPU time here).
# Real processes on an emulated 100 Gbit/s link: one GPU server with 2
# simulated GPUs (V100 profile, parameter memory for 2 models each), 8
# ResNet-152 variants and resnet152_train, 2 memory servers, 4 closed-loop
# clients, Zipf 0.9, batch 1, inference GPUs per second 2,2,1,1,0,0,1,1.
# Then the paper's scale in the simulator (fig9-sim): 4 GPU servers x 8 GPUs,
# 128 variants, 4 GiB host caches, 32 clients, inference GPUs stepping
# 32, 24, 16, 8, 16, 24 every 5 s, 60 s.
# SIM_ONLY=1 keeps the real run's timeline and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/3_sharing"
RES="$HERE/results"
CSV="$RES/timeline.csv"
SIM_CSV="$RES/timeline-sim.csv"
mkdir -p "$RES"
N=8
mib=$(stored_mib resnet152)
WORKLOAD="${WORKLOAD:-2,2,1,1,0,0,1,1}"
dur="${DURATION:-16s}"
if [ -z "${SIM_ONLY:-}${PLOT_ONLY:-}" ]; then
    echo "emulated links on loopback buckets of $EMU_LOOPBACK; K $(emu_k paper); $dur emulated"
    up_emu paper --family resnet152 --models "$N" --mode closed --concurrency 4 --zipf 0.9 --batch 1 \
        --slo-ms 10000 --period 1 --duration "$dur" --devices 2 --device-memory "$(( 2 * mib ))MiB" \
        --capacity "$(( (N + 1) * mib * 11 / 20 + 64 ))MiB" --cache "$(( (N + 1) * mib + 64 ))MiB" --warm-cache \
        --system distmind --use-train --inference-workload "$WORKLOAD" \
        --timeline "$CSV" --timeline-interval 0.5 --test sharing --label distmind >/dev/null
fi
if [ -f "$CSV" ]; then
    "$BIN" plot lines --csv "$CSV" --out "$RES/fig9-sharing.png" --x t_s --y inference_util --y training_util \
        --stacked --title "Test 3: utilization, 2 GPUs shared by inference and training ($N ResNet-152 variants)" \
        --x-label "time (s, emulated)" --y-label "share of the GPUs' bound (stacked)" \
        --caption "inference GPUs per second: $WORKLOAD; 1 GPU server, 2 memory servers, emulated 100gbit (loopback bucket $EMU_LOOPBACK)"
fi

SIM_WORKLOAD=""
for n in 32 24 16 8 16 24; do
    for _ in 1 2 3 4 5; do SIM_WORKLOAD="${SIM_WORKLOAD:+$SIM_WORKLOAD,}$n"; done
done
if [ -z "${PLOT_ONLY:-}" ]; then
    sim_paper --family resnet152 --models 128 --mode closed --concurrency 32 --zipf 0.9 --batch 1 \
        --slo-ms 10000 --period 1 --duration 60s --system distmind --cache "$PAPER_CACHE" \
        --use-train --inference-workload "$SIM_WORKLOAD" --timeline "$SIM_CSV" --timeline-interval 1 \
        --test sharing >/dev/null
fi
"$BIN" plot lines --csv "$SIM_CSV" --out "$RES/fig9-sim-sharing.png" --x t_s --y inference_util --y training_util \
    --stacked --title "Test 3 at the paper's scale (simulated): utilization, 32 GPUs shared by inference and training" \
    --x-label "time (s)" --y-label "share of the GPUs' bound (stacked)" \
    --caption "simulated: 128 ResNet-152, 4 GPU servers x 8 GPUs, 4 GiB host caches, 4 memory servers, 100gbit; inference GPUs 32/24/16/8/16/24, 5 s each"
# The mean stacked utilization, leaving out the first interval (caches fill).
mean_util() {
    awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
        NR > 2 { s += $c["inference_util"] + $c["training_util"]; n++ } END { if (n) printf "%.2f", s / n }' "$1"
}
# Column `name` of the last row of a CSV.
col_of() {
    awk -F, -v name="$2" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == name) k = i; next }
        { v = $k } END { print v }' "$1"
}

# The slo policy splits the GPUs itself (no schedule): Poisson inference at
# the paper's scale with a 100 ms SLO, shorter than a training iteration,
# 60 s per rate, with and without the training job. Per rate: the share of
# requests within the SLO, and the GPUs' training iterations over their
# training bound (the share of the 32 GPUs' time spent training).
SLO_TRAIN_CSV="$RES/slo-training-sim.csv"
if [ -z "${PLOT_ONLY:-}" ]; then
    tmp=$(mktemp -d)
    echo "rate_rps,slo_attainment,training_util,slo_attainment_without_training" > "$SLO_TRAIN_CSV"
    for rate in 500 1000 2000 4000; do
        for train in yes no; do
            flag=()
            [ "$train" = yes ] && flag=(--use-train)
            sim_paper --family resnet152 --models 128 --mode poisson --rate "$rate" --zipf 0.9 --batch 1 \
                --slo-ms 100 --period 1 --duration 60s --system distmind --cache "$PAPER_CACHE" --policy slo \
                "${flag[@]}" --csv "$tmp/$train.csv" --timeline "$tmp/$train-timeline.csv" \
                --timeline-interval 60 --test sharing >/dev/null
        done
        echo "$rate,$(col_of "$tmp/yes.csv" slo_attainment),$(col_of "$tmp/yes-timeline.csv" training_util),$(col_of "$tmp/no.csv" slo_attainment)" \
            >> "$SLO_TRAIN_CSV"
    done
    rm -rf "$tmp"
fi
slo_train_at() {
    awk -F, -v rate="$1" -v k="$2" 'NR > 1 && $1 == rate { printf "%.3f", $k }' "$SLO_TRAIN_CSV"
}
echo "wrote the timelines and figures in $RES"
echo "headline: utilization=$( [ -f "$CSV" ] && mean_util "$CSV" || echo -) sim_utilization=$(mean_util "$SIM_CSV") \
sim_slo_train_attainment_500=$(slo_train_at 500 2) sim_slo_train_training_500=$(slo_train_at 500 3)"
