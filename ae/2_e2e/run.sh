#!/usr/bin/env bash
# Test 2, end to end (the paper's figures 7 and 8): throughput and latency of
# ResNet-152 variants under a Zipf popularity, for DistMind (the original's
# policy, reassigning every period), the MPS and Ray Serve baselines, and the
# GPU bound. sim executor: GPU time from the estimated H200 profile;
# processes, sockets and transfers are real.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/2_e2e"
CSV="$HERE/results/e2e.csv"
mkdir -p "$HERE/results"
rm -f "$CSV"
# The paper: 128 variants on GPUs that held about half of them. Here 8, on a
# simulated GPU with parameter memory for 4 (the same GPU for every system).
N="${N:-8}"
mib=$(stored_mib resnet152)
cap="$(( N * mib * 11 / 20 + 64 ))MiB"
common=(--family resnet152 --mode closed --concurrency 4 --duration "$DUR" --csv "$CSV" --test e2e
    --device-memory "$(( N * mib / 2 ))MiB")
whole=(--models "$N" --capacity "$cap")
for z in 0 0.9 0.99; do
    echo "== zipf $z, period 1 s"
    up "${common[@]}" "${whole[@]}" --zipf "$z" --period 1 --system distmind \
        --cache "$(( N * mib / 2 + 8 ))MiB" --label "distmind" >/dev/null
    for sys in mps ray; do
        up "${common[@]}" "${whole[@]}" --zipf "$z" --period 1 --system "$sys" \
            --cache "$(( N * mib + 64 ))MiB" >/dev/null
    done
done
for p in 0.5 0.1; do
    echo "== zipf 0.9, period $p s (distmind only: the baselines do not reassign)"
    up "${common[@]}" "${whole[@]}" --zipf 0.9 --period "$p" --system distmind \
        --cache "$(( N * mib / 2 + 8 ))MiB" --label distmind >/dev/null
done
# Last: it reuses the first package of the set.
up "${common[@]}" --system gpu --models 1 --label gpu >/dev/null
cut -d, -f2,6,7,19,20,21,24 "$CSV"
# The x axis: one category per workload (zipf, period).
awk -F, 'NR==1 {print $0 ",workload"; next} {print $0 ",s=" $6 " p=" $7 "s"}' "$CSV" > "$HERE/results/e2e-plot.csv"
"$BIN" plot bars --csv "$HERE/results/e2e-plot.csv" --out "$HERE/results/fig7-throughput.png" \
    --x workload --series system --series-order distmind,mps,ray --y throughput_rps --reference gpu \
    --title "Test 2: throughput, $N ResNet-152 variants (closed loop, 4 clients)" \
    --y-label "throughput (requests/s, batch 8)" --x-label "workload (Zipf s, reassignment period)" \
    --caption "dashed: the GPU bound (one model, never switched); 1 GPU, 2 memory servers, loopback TCP"
"$BIN" plot bars --csv "$HERE/results/e2e-plot.csv" --out "$HERE/results/fig8-latency.png" \
    --x workload --series system --series-order distmind,mps,ray --y lat_mean_ms \
    --whisker-low lat_p50_ms --whisker-high lat_p99_ms --reference gpu --log-y \
    --title "Test 2: latency, $N ResNet-152 variants (closed loop, 4 clients)" \
    --y-label "latency (ms, log scale): bar mean, whisker p50..p99" --x-label "workload (Zipf s, reassignment period)" \
    --caption "dashed: the GPU bound's mean; 1 GPU, 2 memory servers, loopback TCP"
echo "wrote $CSV and the figures in $HERE/results"
