#!/usr/bin/env bash
# Test 4, memory (the paper's figure 10): the measured RSS of the GPU server
# as the model set grows, for DistMind (a host cache of 2 models, whatever
# the set) and the mps and ray baselines (the whole set in host memory), next
# to the formula: base + cached models x model size, where base is the GPU
# server's RSS with nothing cached beyond one model (the `gpu` run, minus
# that model). ResNet-152 variants, the paper's balance (V100 profile,
# emulated 100 Gbit/s); short workloads, since memory, not speed, is measured.
# Then the paper's scale in the simulator (fig10-sim): the GPU servers'
# memory in all, as the cluster grows from 1 to 100 GPU servers of 8 GPUs,
# with the throughput each system gets from it.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/4_memory"
RES="$HERE/results"
CSV="$RES/memory.csv"
SIM_CSV="$RES/memory-sim.csv"
mkdir -p "$RES"
[ -n "${PLOT_ONLY:-}${SIM_ONLY:-}" ] || rm -f "$CSV"
SIZES="${SIZES:-2 4 8 12}"
mib=$(stored_mib resnet152)
dur="$(WALL_PER_RUN="${WALL_PER_RUN:-20}" emu_duration paper)"
echo "emulated links on loopback buckets of $EMU_LOOPBACK; $dur emulated per run"
if [ -z "${PLOT_ONLY:-}${SIM_ONLY:-}" ]; then
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

# The paper's scale, simulated: 128 ResNet-152 variants; DistMind with the
# original's 4 GiB host cache per GPU server, mps and ray with the whole set
# (29 GiB) on every one; one closed-loop client per GPU, 10 s each.
SERVERS="${SERVERS:-1 4 16 64 100}"
if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for n in $SERVERS; do
        sc=(--family resnet152 --models 128 --gpu-servers "$n" --mode closed --concurrency "$(( 8 * n ))"
            --batch 1 --duration 10s --test memory --csv "$SIM_CSV")
        sim_paper "${sc[@]}" --system distmind --cache "$PAPER_CACHE" >/dev/null
        for sys in mps ray; do
            sim_paper "${sc[@]}" --system "$sys" >/dev/null
        done
    done
fi
# GPU servers = GPUs / 8; their host memory in all, in GiB.
awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; print "system,gpu_servers,cluster_memory_gib,throughput_rps,executor,profile"; next }
    { n = $c["devices"] / 8; printf "%s,%d,%.1f,%s,%s,%s\n", $c["system"], n, n * $c["cache_mib"] / 1024, $c["throughput_rps"], $c["executor"], $c["profile"] }' \
    "$SIM_CSV" > "$RES/memory-sim-plot.csv"
"$BIN" plot lines --csv "$RES/memory-sim-plot.csv" --out "$RES/fig10-sim-memory.png" \
    --x gpu_servers --y cluster_memory_gib --series system --log-y \
    --title "Test 4 at the paper's scale (simulated): GPU servers' host memory, 128 ResNet-152 variants" \
    --x-label "GPU servers (8 GPUs each)" --y-label "host memory of all GPU servers (GiB, log)" \
    --caption "simulated: DistMind 4 GiB host cache per GPU server; mps, ray: the whole set on every server; 4 memory servers, 100gbit"
last="${SIZES##* }"
big="${SERVERS##* }"
sm() { csv_get "$RES/memory-sim-plot.csv" "$1" "system=$2" "gpu_servers=$big"; }
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline: models=$last distmind_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=distmind "models=$last") mps_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=mps "models=$last") ray_rss_mib=$(csv_get "$CSV" runtime_rss_mib system=ray "models=$last") distmind_vs_mps=$(ratio "$(csv_get "$CSV" runtime_rss_mib system=distmind "models=$last")" "$(csv_get "$CSV" runtime_rss_mib system=mps "models=$last")") sim_gpu_servers=$big sim_memory_distmind_vs_mps=$(ratio "$(sm cluster_memory_gib distmind)" "$(sm cluster_memory_gib mps)") sim_throughput_distmind_vs_mps=$(ratio "$(sm throughput_rps distmind)" "$(sm throughput_rps mps)")"
