#!/usr/bin/env bash
# Test 1, meeting latency SLOs (the paper's figure 6): mean latency of one
# closed-loop client per model family, for the GPU bound (one model), DistMind
# with every model in its host cache, DistMind pulling from the memory servers,
# and the MPS and Ray Serve baselines. sim executor: GPU time from the
# estimated H200 profile; everything else (processes, sockets, transfers) is real.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/1_slo"
CSV="$HERE/results/fig6.csv"
mkdir -p "$HERE/results"
rm -f "$CSV"
# The paper: 128 models per family (64 for BERT and GPT-2) on 16 GB V100s,
# so a GPU held about half the set (MPS: at most 12 processes per GPU). Here,
# to fit 10 minutes on 2 cores: N models and a simulated GPU with parameter
# memory for half of them (the same GPU for every system).
N="${N:-6}"
for fam in resnet152 inception_v3 densenet201 bert_base gpt2; do
    mib=$(stored_mib "$fam")
    # Memory servers: half the set each, 10% + 64 MiB slack.
    cap="$(( N * mib * 11 / 20 + 64 ))MiB"
    gpu_mem="$(( N * mib / 2 ))MiB"
    all="$(( N * mib + 64 ))MiB"
    common=(--family "$fam" --mode closed --concurrency 1 --duration "$DUR" --csv "$CSV" --test fig6
        --device-memory "$gpu_mem")
    echo "== $fam"
    # distmind_cache: the host cache holds the set; distmind_remote: it holds
    # 2 models, so most requests pull from the memory servers.
    up "${common[@]}" --system distmind --models "$N" --capacity "$cap" --cache "$all" \
        --label distmind_cache >/dev/null
    up "${common[@]}" --system distmind --models "$N" --capacity "$cap" \
        --cache "$(( 2 * mib + 8 ))MiB" --label distmind_remote >/dev/null
    for sys in mps ray; do
        up "${common[@]}" --system "$sys" --models "$N" --capacity "$cap" --cache "$all" >/dev/null
    done
    up "${common[@]}" --system gpu --models 1 >/dev/null
    tail -n 5 "$CSV" | cut -d, -f2,4,20,21,24
done
"$BIN" plot bars --csv "$CSV" --out "$HERE/results/fig6.png" --x family --series system \
    --series-order gpu,distmind_cache,distmind_remote,mps,ray --y lat_mean_ms --log-y \
    --title "Test 1: mean inference latency per model family (closed loop, 1 client, batch 8)" \
    --y-label "mean latency (ms, log scale)" --x-label "model family" \
    --caption "$N models per family, a GPU with memory for half; 1 GPU server, 2 memory servers, loopback TCP"
echo "wrote $CSV and $HERE/results/fig6.png"
