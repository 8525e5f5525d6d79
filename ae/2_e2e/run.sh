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
source "$(dirname "$0")/../lib.sh"
HERE="$AE/2_e2e"
RES="$HERE/results"
CSV="$RES/e2e.csv"
mkdir -p "$RES"
# PLOT_ONLY=1 redraws the figures and the headline from the existing CSV.
[ -n "${PLOT_ONLY:-}" ] || rm -f "$CSV"
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
    [ -z "${PLOT_ONLY:-}" ] || break
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
tput() { csv_get "$CSV" throughput_rps "system=$1" "link=$2"; }
line=""
for b in today paper; do
    balance "$b"
    pre=$([ "$b" = paper ] && echo "paper_" || true)
    line="$line ${pre}distmind_vs_mps=$(ratio "$(tput distmind_half "$LINK")" "$(tput mps "$LINK")")"
    line="$line ${pre}distmind_vs_ray=$(ratio "$(tput distmind_half "$LINK")" "$(tput ray "$LINK")")"
    line="$line ${pre}half_vs_full=$(ratio "$(tput distmind_half "$LINK")" "$(tput distmind_full "$LINK")")"
done
echo "wrote $CSV and the figures in $RES"
echo "headline:$line"
