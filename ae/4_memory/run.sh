#!/usr/bin/env bash
# Test 4, memory (the paper's figure 10): the measured RSS of the GPU server
# as the model set grows, for DistMind (a host cache of 2 models, whatever
# the set) and the mps and ray baselines (the whole set in host memory), next
# to the formula: base + cached models x model size, where base is the GPU
# server's RSS with nothing cached beyond one model (the `gpu` run, minus
# that model). ResNet-152 variants, the paper's balance (V100 profile,
# emulated 100 Gbit/s); short workloads, since memory, not speed, is measured.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/4_memory"
RES="$HERE/results"
CSV="$RES/memory.csv"
mkdir -p "$RES"
[ -n "${PLOT_ONLY:-}" ] || rm -f "$CSV"
SIZES="${SIZES:-2 4 8 12}"
mib=$(stored_mib resnet152)
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-20}" emu_duration paper)"
echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
if [ -z "${PLOT_ONLY:-}" ]; then
    for n in $SIZES; do
        echo "== $n models"
        common=(--family resnet152 --models "$n" --mode closed --concurrency 2 --zipf 0.9 --batch 1
            --duration "$dur" --test memory --csv "$CSV" --device-memory "$(( 2 * mib ))MiB"
            --capacity "$(( n * mib * 11 / 20 + 64 ))MiB")
        up_emu paper "${common[@]}" --system distmind --cache "$(( 2 * mib + 8 ))MiB" --label distmind >/dev/null
        for sys in mps ray; do
            up_emu paper "${common[@]}" --system "$sys" --cache "$(( n * mib + 64 ))MiB" >/dev/null
        done
    done
    up_emu paper --family resnet152 --models 1 --mode closed --concurrency 1 --batch 1 --duration "$dur" \
        --test memory --csv "$CSV" --system gpu --label gpu >/dev/null
fi
cut -d, -f2,4,8,27 "$CSV"
# The formula, from the measured base.
gpu_rss="$(csv_get "$CSV" runtime_rss_mib system=gpu)"
base=$(( gpu_rss - mib ))
{
    echo "system,models,runtime_rss_mib,executor,profile"
    awk -F, 'NR > 1 && $2 != "gpu" {print $2 "," $4 "," $27 "," $28 "," $29}' "$CSV"
    for n in $SIZES; do
        echo "formula: distmind,$n,$(( base + 2 * mib )),sim,$(csv_get "$CSV" profile system=gpu)"
        echo "formula: baselines,$n,$(( base + n * mib )),sim,$(csv_get "$CSV" profile system=gpu)"
    done
} > "$RES/memory-plot.csv"
"$BIN" plot lines --csv "$RES/memory-plot.csv" --out "$RES/fig10-memory.png" \
    --x models --y runtime_rss_mib --series system \
    --title "Test 4: GPU-server memory as the model set grows (ResNet-152 variants)" \
    --x-label "models in the set" --y-label "GPU-server RSS (MiB)" \
    --caption "measured RSS at the end of each run; formula: base $base MiB + cached models x $mib MiB; DistMind caches 2"
last="${SIZES##* }"
echo "wrote $CSV and $RES/fig10-memory.png"
echo "headline: models=$last distmind_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=distmind "models=$last") mps_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=mps "models=$last") ray_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=ray "models=$last") distmind_vs_mps=$(ratio "$(csv_get "$CSV" runtime_rss_mib system=distmind "models=$last")" "$(csv_get "$CSV" runtime_rss_mib system=mps "models=$last")")"
