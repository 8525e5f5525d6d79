#!/usr/bin/env bash
# Test 2, end to end (the paper's figures 7 and 8), as real processes on
# emulated links, at the two hardware balances DistMind is built for:
#   paper: V100 (estimated profile), PCIe 3 (~12 GB/s), 100 Gbit/s
#   today: H200 (estimated profile), PCIe 5 (~50 GB/s), 400 Gbit/s
# Each: N ResNet-152 variants on one simulated GPU with parameter memory for
# half of them, 2 memory servers, 4 closed-loop clients, Zipf 0.9, batch 1,
# period 1 s. DistMind with the whole set and with half of it in its host
# cache; mps and ray with the whole set in host memory (the paper's
# comparison); the one-model GPU bound. GPU time is simulated; processes,
# sockets and bytes are real; the clock is dilated by K = link / loopback.
# Then the paper's settings at its scale in the simulator (e2e-sim.csv):
# Zipf 0, 0.9, 0.99 at period 1 s, and periods 0.5 s and 0.1 s at 0.9, with
# both comparisons: the paper's (baselines hold the whole set) and equal
# memory (every system 4 GiB of host memory per GPU server; a baseline's
# miss reads the model from local NVMe at 3 GB/s). DistMind runs the
# paper's policy (`distmind`) and the slo policy (`distmind_slo`), which
# has no reassignment period.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/2_e2e"
RES="$HERE/results"
CSV="$RES/e2e.csv"
SIM_CSV="$RES/e2e-sim.csv"
mkdir -p "$RES"
# PLOT_ONLY=1 redraws the figures and the headline from the existing CSVs;
# SIM_ONLY=1 keeps the real runs' CSV and simulates again.
[ -n "${PLOT_ONLY:-}" ] || [ -n "${SIM_ONLY:-}" ] || rm -f "$CSV"
N="${N:-8}"
mib=$(stored_mib resnet152)
common=(--family resnet152 --mode closed --concurrency 4 --zipf 0.9 --period 1
    --batch 1 --slo-ms 100 --test e2e --csv "$CSV"
    --capacity "$(( N * mib * 11 / 20 + 64 ))MiB" --device-memory "$(( N * mib / 2 ))MiB")
set_=(--models "$N")
whole="$(( N * mib + 64 ))MiB"
half="$(( N * mib / 2 + 8 ))MiB"
echo "emulated links on loopback buckets of $EMU_LOOPBACK"
for b in paper today; do
    [ -z "${PLOT_ONLY:-}${SIM_ONLY:-}" ] || break
    # Emulated seconds per run: about WALL_PER_RUN (60) s of wall time at
    # this balance's K, so today's run (4x the link, 4x K) is 4x shorter.
    dur="$(emu_duration "$b")"
    echo "== $b balance: $(balance "$b"; echo "$PROFILE, $LINK"), K $(emu_k "$b"), $dur emulated per run"
    up_emu "$b" "${common[@]}" "${set_[@]}" --duration "$dur" --system distmind --warm-cache --cache "$whole" --label distmind_full >/dev/null
    up_emu "$b" "${common[@]}" "${set_[@]}" --duration "$dur" --system distmind --warm-cache --cache "$half" --label distmind_half >/dev/null
    for sys in mps ray; do
        up_emu "$b" "${common[@]}" "${set_[@]}" --duration "$dur" --system "$sys" --cache "$whole" >/dev/null
    done
    # The bound: one model (the first of the set), resident, never switched.
    up_emu "$b" "${common[@]}" --models 1 --duration "$dur" --system gpu --label gpu >/dev/null
done
cut -d, -f2,19,20,24,25,27,31,32 "$CSV"
# The x axis: the balance (link and profile).
awk -F, 'NR==1 {print $0 ",balance"; next} {print $0 "," ($31 == "100gbit" ? "paper: V100 / PCIe 3 / 100gbit" : "today: H200 / PCIe 5 / 400gbit")}' \
    "$CSV" > "$RES/e2e-plot.csv"
lo="$(csv_get "$CSV" loopback system=gpu)"
cap="1 simulated GPU (estimated profiles), 2 memory servers, emulated links (K = link / $lo loopback bucket); dashed: GPU bound"
"$BIN" plot bars --csv "$RES/e2e-plot.csv" --out "$RES/fig7-throughput.png" \
    --x balance --series system --series-order distmind_full,distmind_half,mps,ray --y throughput_rps --reference gpu \
    --title "Test 2: throughput, $N ResNet-152 variants, closed loop, 4 clients, Zipf 0.9" \
    --y-label "throughput (requests/s, batch 1, emulated time)" --x-label "hardware balance" --caption "$cap"
"$BIN" plot bars --csv "$RES/e2e-plot.csv" --out "$RES/fig8-latency.png" \
    --x balance --series system --series-order distmind_full,distmind_half,mps,ray --y lat_mean_ms \
    --whisker-low lat_p50_ms --whisker-high lat_p99_ms --reference gpu --log-y \
    --title "Test 2: latency, $N ResNet-152 variants, closed loop, 4 clients, Zipf 0.9" \
    --y-label "latency (ms, emulated, log): bar mean, whisker p50..p99" --x-label "hardware balance" --caption "$cap"

# The paper's scale, simulated: 128 ResNet-152 variants, 4 GPU servers x 8
# GPUs, 4 memory servers, 100 Gbit/s, one closed-loop client per GPU,
# batch 1, 60 simulated seconds per setting.
if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$SIM_CSV"
    for setting in "0 1" "0.9 1" "0.99 1" "0.9 0.5" "0.9 0.1"; do
        set -- $setting
        z="$1"; p="$2"; label="zipf${z}/period${p}s"
        for seed in $SIM_SEEDS; do
            sc=(--family resnet152 --models 128 --mode closed --concurrency 32 --batch 1 --slo-ms 100
                --duration 60s --zipf "$z" --period "$p" --csv "$SIM_CSV" --test "$label" --seed "$seed")
            sim_paper "${sc[@]}" --system distmind --cache "$PAPER_CACHE" >/dev/null
            sim_paper "${sc[@]}" --system distmind --policy slo --cache "$PAPER_CACHE" \
                --label distmind_slo >/dev/null
            for sys in mps ray; do
                sim_paper "${sc[@]}" --system "$sys" >/dev/null
                sim_paper "${sc[@]}" --system "$sys" --cache "$PAPER_CACHE" --local-disk 3GB/s \
                    --label "${sys}_equal_memory" >/dev/null
            done
            sim_paper "${sc[@]}" --system gpu >/dev/null
        done
    done
fi
simcap="simulated: 128 ResNet-152 variants, 4 GPU servers x 8 GPUs (16 GiB each), 4 memory servers, 100gbit; DistMind and *_equal_memory: 4 GiB host memory per GPU server (baselines' misses from NVMe at 3 GB/s); mps, ray: the whole set; mean of seeds $SIM_SEEDS"
"$BIN" plot bars --csv "$SIM_CSV" --out "$RES/fig7-sim-throughput.png" \
    --x test --series system --series-order distmind,distmind_slo,mps,ray,mps_equal_memory,ray_equal_memory --y throughput_rps \
    --reference gpu --title "Test 2 at the paper's scale (simulated): throughput, closed loop, 32 clients, batch 1" \
    --y-label "throughput (requests/s)" --x-label "popularity and reassignment period" --caption "$simcap"
"$BIN" plot bars --csv "$SIM_CSV" --out "$RES/fig8-sim-latency.png" \
    --x test --series system --series-order distmind,distmind_slo,mps,ray,mps_equal_memory,ray_equal_memory --y lat_mean_ms \
    --whisker-low lat_p50_ms --whisker-high lat_p99_ms --reference gpu --log-y \
    --title "Test 2 at the paper's scale (simulated): latency, closed loop, 32 clients, batch 1" \
    --y-label "latency (ms, log): bar mean, whisker p50..p99" --x-label "popularity and reassignment period" \
    --caption "$simcap"
stput() { csv_mean "$SIM_CSV" throughput_rps "system=$1" "test=zipf0.9/period1s"; }

tput() { csv_get "$CSV" throughput_rps "system=$1" "link=$2"; }
line=""
for b in today paper; do
    balance "$b"
    pre=$([ "$b" = paper ] && echo "paper_" || true)
    line="$line ${pre}distmind_vs_mps=$(ratio "$(tput distmind_half "$LINK")" "$(tput mps "$LINK")")"
    line="$line ${pre}distmind_vs_ray=$(ratio "$(tput distmind_half "$LINK")" "$(tput ray "$LINK")")"
    line="$line ${pre}half_vs_full=$(ratio "$(tput distmind_half "$LINK")" "$(tput distmind_full "$LINK")")"
done
line="$line sim_distmind_vs_mps=$(ratio "$(stput distmind)" "$(stput mps)")"
line="$line sim_distmind_vs_ray=$(ratio "$(stput distmind)" "$(stput ray)")"
line="$line sim_distmind_vs_mps_equal_memory=$(ratio "$(stput distmind)" "$(stput mps_equal_memory)")"
line="$line sim_slo_vs_mps=$(ratio "$(stput distmind_slo)" "$(stput mps)")"
line="$line sim_slo_vs_mps_equal_memory=$(ratio "$(stput distmind_slo)" "$(stput mps_equal_memory)")"
echo "wrote $CSV, $SIM_CSV and the figures in $RES"
echo "headline:$line"
