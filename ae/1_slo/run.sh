#!/usr/bin/env bash
# Test 1, meeting latency SLOs (the paper's figure 6): mean latency of one
# closed-loop client per model family, for the GPU bound (one model), DistMind
# with every model in its host cache, DistMind pulling from the memory servers,
# and the MPS and Ray Serve baselines, at the paper's balance: the estimated
# V100 profile (GPU time simulated) and an emulated 100 Gbit/s link;
# processes, sockets and transfers are real. Batch 8, as in the paper.
# Then the same at the paper's scale in the simulator (fig6-sim).
# SIM_ONLY=1 keeps the real runs' CSV and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/1_slo"
CSV="$HERE/results/fig6.csv"
SIM_CSV="$HERE/results/fig6-sim.csv"
mkdir -p "$HERE/results"
rm -f "$SIM_CSV"
# The paper: 128 models per family (64 for BERT and GPT-2) on 16 GB V100s,
# so a GPU held about half the set (MPS: at most 12 processes per GPU). Here,
# to fit 10 minutes on 2 cores: N models and a simulated GPU with parameter
# memory for half of them (the same GPU for every system).
N="${N:-6}"
if [ -z "${SIM_ONLY:-}" ]; then
rm -f "$CSV"
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-20}" emu_duration paper)"
echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
for fam in resnet152 inception_v3 densenet201 bert_base gpt2; do
    mib=$(stored_mib "$fam")
    # Memory servers: half the set each, 10% + 64 MiB slack.
    cap="$(( N * mib * 11 / 20 + 64 ))MiB"
    gpu_mem="$(( N * mib / 2 ))MiB"
    all="$(( N * mib + 64 ))MiB"
    common=(--family "$fam" --mode closed --concurrency 1 --batch 8 --duration "$dur" --csv "$CSV" --test fig6
        --device-memory "$gpu_mem")
    echo "== $fam"
    # distmind_cache: the host cache holds the set; distmind_remote: it holds
    # 2 models, so most requests pull from the memory servers.
    up_emu paper "${common[@]}" --system distmind --models "$N" --capacity "$cap" --cache "$all" \
        --warm-cache --label distmind_cache >/dev/null
    up_emu paper "${common[@]}" --system distmind --models "$N" --capacity "$cap" \
        --cache "$(( 2 * mib + 8 ))MiB" --label distmind_remote >/dev/null
    for sys in mps ray; do
        up_emu paper "${common[@]}" --system "$sys" --models "$N" --capacity "$cap" --cache "$all" >/dev/null
    done
    up_emu paper "${common[@]}" --system gpu --models 1 >/dev/null
    tail -n 5 "$CSV" | cut -d, -f2,4,20,21,24
done
fi
"$BIN" plot bars --csv "$CSV" --out "$HERE/results/fig6.png" --x family --series system \
    --series-order gpu,distmind_cache,distmind_remote,mps,ray --y lat_mean_ms --log-y \
    --title "Test 1: mean inference latency per model family (closed loop, 1 client, batch 8)" \
    --y-label "mean latency (ms, log scale)" --x-label "model family" \
    --caption "$N models per family, a GPU with memory for half; 1 GPU server, 2 memory servers, emulated 100gbit link (loopback bucket $(csv_get "$CSV" loopback system=gpu))"
echo "wrote $CSV and $HERE/results/fig6.png"

# The paper's scale, simulated: 128 models per family (64 for BERT and
# GPT-2) on 4 GPU servers x 8 GPUs, 4 memory servers, 100 Gbit/s, 4 GiB host
# caches; one closed-loop client per GPU, batch 8, 60 simulated seconds.
# distmind_cache: as many models as the paper's cache held (15/40/50/8/6),
# warm; distmind_remote: the whole set, cold, pulled from the memory servers.
for fam in resnet152 inception_v3 densenet201 bert_base gpt2; do
    case "$fam" in
        resnet152) fit=15 ;; inception_v3) fit=40 ;; densenet201) fit=50 ;; bert_base) fit=8 ;; gpt2) fit=6 ;;
    esac
    n="$(paper_models "$fam")"
    for seed in $SIM_SEEDS; do
        common=(--family "$fam" --mode closed --concurrency 32 --batch 8 --duration 60s --csv "$SIM_CSV" --test fig6
            --seed "$seed")
        sim_paper "${common[@]}" --system distmind --models "$fit" --cache "$PAPER_CACHE" --warm-cache \
            --label distmind_cache >/dev/null
        sim_paper "${common[@]}" --system distmind --models "$n" --cache "$PAPER_CACHE" --label distmind_remote >/dev/null
        for sys in mps ray; do
            sim_paper "${common[@]}" --system "$sys" --models "$n" >/dev/null
        done
        sim_paper "${common[@]}" --system gpu --models 1 >/dev/null
    done
done
"$BIN" plot bars --csv "$SIM_CSV" --out "$HERE/results/fig6-sim.png" --x family --series system \
    --series-order gpu,distmind_cache,distmind_remote,mps,ray --y lat_mean_ms --log-y \
    --title "Test 1 at the paper's scale (simulated): mean latency per family, batch 8, 32 clients" \
    --y-label "mean latency (ms, log scale)" --x-label "model family" \
    --caption "simulated: 128 models per family (64 BERT, GPT-2), 4 GPU servers x 8 GPUs, 4 memory servers, 100gbit, 4 GiB host caches; mean of seeds $SIM_SEEDS"
echo "wrote $SIM_CSV and $HERE/results/fig6-sim.png"

lat() { csv_mean "$1" lat_mean_ms "system=$2" "family=$3"; }
line=""
for fam in resnet152 bert_base; do
    line="$line ${fam}_cache_vs_mps_latency=$(ratio "$(lat "$CSV" distmind_cache "$fam")" "$(lat "$CSV" mps "$fam")")"
    line="$line ${fam}_remote_vs_mps_latency=$(ratio "$(lat "$CSV" distmind_remote "$fam")" "$(lat "$CSV" mps "$fam")")"
done
for fam in resnet152 bert_base; do
    line="$line sim_${fam}_remote_vs_mps_latency=$(ratio "$(lat "$SIM_CSV" distmind_remote "$fam")" "$(lat "$SIM_CSV" mps "$fam")")"
done
echo "headline:$line"
