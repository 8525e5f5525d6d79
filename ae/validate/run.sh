#!/usr/bin/env bash
# Validation of `distmind simulate` against real processes: the same three
# configurations run as a cluster of real processes on an emulated link and
# in the simulator, and their throughput, p50 and p99 compared.
#   1 GPU server (one simulated GPU with parameter memory for 4 models),
#   2 memory servers, 8 ResNet-152 variants, emulated 100 Gbit/s, the V100
#   profile, 4 closed-loop clients, Zipf 0.9, batch 1, SLO 100 ms:
#   distmind with the whole set in its host cache, distmind with half, mps.
# The real runs' GPU time is simulated too (the sim executor); what the
# simulator does not run is everything else: processes, sockets, bytes.
# Both sides send the same requests: the simulator draws from the client's
# own per-client generators with the same seed, for the same emulated
# duration, and mirrors the dilated run's real-clock timers (the
# controller's tick and the heartbeats come K times as often in emulated
# time, `--mirror-dilation`). Real runs last WALL_PER_RUN (default here
# 120) s of wall time each.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/validate"
RES="$HERE/results"
CSV="$RES/validate.csv"
mkdir -p "$RES"
# PLOT_ONLY=1 reprints the table; SIM_ONLY=1 keeps the real rows and
# simulates again.
if [ -n "${SIM_ONLY:-}" ]; then
    grep -v ',simulator$' "$CSV" > "$CSV.tmp" && mv "$CSV.tmp" "$CSV"
elif [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$CSV"
fi
N=8
mib=$(stored_mib resnet152)
WALL_PER_RUN="${WALL_PER_RUN:-120}"
dur="$(emu_duration paper)"
k="$(emu_k paper)"
balance paper
whole="$(( N * mib + 64 ))MiB"
half="$(( N * mib / 2 + 8 ))MiB"
dev="$(( N * mib / 2 ))MiB"
common=(--family resnet152 --models "$N" --mode closed --concurrency 4 --zipf 0.9 --batch 1
    --slo-ms 100 --period 1 --test validate --csv "$CSV" --device-memory "$dev")
echo "emulated links on loopback buckets of $EMU_LOOPBACK (K $k); $dur emulated per run"
if [ -z "${PLOT_ONLY:-}" ]; then
    for src in real sim; do
        [ "$src" = real ] && [ -n "${SIM_ONLY:-}" ] && continue
        for cfg in full half mps; do
            case "$cfg" in
                full) sys=(--system distmind --warm-cache --cache "$whole") ;;
                half) sys=(--system distmind --warm-cache --cache "$half") ;;
                mps) sys=(--system mps --cache "$whole") ;;
            esac
            echo "== $src: $cfg"
            if [ "$src" = real ]; then
                up_emu paper "${common[@]}" --duration "$dur" "${sys[@]}" --capacity "$(( N * mib * 11 / 20 + 64 ))MiB" \
                    --label "$cfg" >/dev/null
            else
                "$BIN" --log-level warn simulate --settings "$SETTINGS" --profile "$PROFILE" --link "$LINK" \
                    --memservers 2 "${common[@]}" --duration "$dur" --mirror-dilation "$k" "${sys[@]}" \
                    --label "$cfg" >/dev/null
            fi
        done
    done
fi
# The table: per configuration and metric, real, simulated, relative
# error; and the share of requests that loaded their model onto the GPU
# (a device miss), which the latencies follow.
awk -F, '
    NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    { k = $c["system"] SUBSEP $c["source"]
      v[k, "throughput"] = $c["throughput_rps"]; v[k, "mean"] = $c["lat_mean_ms"]
      v[k, "p50"] = $c["lat_p50_ms"]; v[k, "p99"] = $c["lat_p99_ms"]
      n = $c["served_resident"] + $c["served_host_cached"] + $c["served_cold"]
      v[k, "device_misses"] = n > 0 ? ($c["served_host_cached"] + $c["served_cold"]) / n : "" }
    END {
        printf "%-6s %-14s %10s %10s %8s\n", "config", "metric", "real", "simulated", "error"
        max = 0
        n = split("full half mps", cfg, " "); m = split("throughput mean p50 p99 device_misses", met, " ")
        for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) {
            r = v[cfg[i] SUBSEP "processes", met[j]]; s = v[cfg[i] SUBSEP "simulator", met[j]]
            if (r == "" || s == "") { printf "%-6s %-14s %10s %10s %8s\n", cfg[i], met[j], r, s, "-"; continue }
            e = (s - r) / r; a = e < 0 ? -e : e
            # The headline covers throughput, p50 and p99; the rest explain them.
            if (met[j] == "throughput" || met[j] == "p50" || met[j] == "p99") { if (a > max) max = a }
            printf "%-6s %-14s %10.3f %10.3f %+7.1f%%\n", cfg[i], met[j], r, s, 100 * e
        }
        printf "headline: max_rel_error=%.3f\n", max
    }' "$CSV" | tee "$RES/table.txt"
