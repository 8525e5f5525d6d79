#!/usr/bin/env bash
# Distributed training on the GPUs inference leaves: SD-Pipe's partial
# reduce against allreduce and AD-PSGD under stragglers, and DynPipe's
# re-partitioning under a slowed stage.
#
# Real processes at this machine's scale: a controller, a memory server and
# one GPU server with 6 devices (cpu executor: real candle math on this
# CPU, activations and gradients over tcp), 2 pipelines x 3 stages of a
# tiny GPT-2 (MSE to per-token targets) and a tiny ResNet-152 (10
# synthetic classes), loss and wall time read back from `train status`.
# DynPipe's comparison slows stage 1 3x from iteration 120 (static: no
# re-partitioning; dynamic: drain, checkpoint to the memory server, reload
# on the new partition). Stragglers are SD-Pipe's knob (`--hetero X`: each stage sleeps X s at
# the start of an iteration with probability 0.1, the same iterations in
# every run).
#
# Then `distmind train simulate` at 8 to 64 GPUs (P pipelines x 4 stages
# of full ResNet-152, batch 96 in 8 microbatches): the controller's own
# group schedulers, 1F1B simulator, monitor and re-partitioner on a
# virtual clock; layer times measured on an H100 (backward 2x forward,
# assumed); links 100 Gbit/s.
# SIM_ONLY=1 keeps the real rows and simulates again.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/10_training"
RES="$HERE/results"
CSV="$RES/sdpipe.csv"
SIM_CSV="$RES/sim.csv"
mkdir -p "$RES"
ITERS="${ITERS:-150}"
PROFILE_GPU="$SETTINGS/profiles/h100-measured-2026-11-26.json"

if [ -z "${SIM_ONLY:-}" ]; then
    tmp="$(mktemp -d)"
    pids=()
    cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
    trap cleanup EXIT
    # `distmind <service>` in the background, its pid kept for cleanup (so
    # never call it inside $(...), a subshell); waits for its readiness line
    # and writes the address it listens on to $tmp/<name>.addr.
    service() {
        local name="$1"; shift
        "$BIN" --log-level warn "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
        pids+=($!)
        for _ in $(seq 100); do
            grep -q "listening on" "$tmp/$name.out" 2>/dev/null && break
            sleep 0.1
        done
        awk '/listening on/ { print $NF; exit }' "$tmp/$name.out" >"$tmp/$name.addr"
        if [ ! -s "$tmp/$name.addr" ]; then
            echo "$name did not start within 10 s; its stderr:" >&2
            cat "$tmp/$name.err" >&2
            exit 1
        fi
    }
    service controller controller --settings "$SETTINGS" --listen 127.0.0.1:0 --client-listen 127.0.0.1:0 --no-dispatcher
    ctl=$(cat "$tmp/controller.addr")
    service memserver memserver --settings "$SETTINGS" --listen 127.0.0.1:0 --capacity 64MiB --controller "$ctl"
    models=()
    for f in gpt2 resnet152; do
        "$BIN" --log-level warn model gen --family "$f" --scale tiny --variants 1 --group-bytes 65536 --out "$tmp/pk-$f" >/dev/null
        "$BIN" --log-level warn deploy --quiet --settings "$SETTINGS" --controller "$ctl" "$tmp/pk-$f"/* >/dev/null
        models+=("$(ls "$tmp/pk-$f")")
    done
    service runtime runtime --settings "$SETTINGS" --listen 127.0.0.1:0 --controller "$ctl" \
        --executor cpu --devices 0,1,2,3,4,5 --cache 64MiB
    sleep 1
    spec() { # name model sync batch microbatches lr iterations
        cat >"$tmp/$1.json" <<JSON
{"name": "$1", "model": "$2", "optimizer": {"sgd": {"lr": $6, "momentum": 0.9}},
 "batch": $4, "microbatches": $5, "pipelines": 2, "stages": 3,
 "sync": {"$3": {}}, "iterations": $7}
JSON
        echo "$tmp/$1.json"
    }
    echo "test,model,sync,hetero,pipelines,stages,iterations,wall_s,samples_per_s,first_loss,final_loss,tail_s_per_iteration,state,generation,partition" >"$CSV"
    for h in 0 0.1 0.3; do
        for s in preduce allreduce adpsgd hetpipe; do
            row=$(python3 "$HERE/watch.py" "$BIN" "$SETTINGS" "$ctl" "$(spec "$s" "${models[0]}" "$s" 8 4 0.01 "$ITERS")" --hetero "$h")
            echo "sdpipe,gpt2-tiny,$s,$h,2,3,$ITERS,$row" | tee -a "$CSV"
        done
    done
    row=$(python3 "$HERE/watch.py" "$BIN" "$SETTINGS" "$ctl" "$(spec cnn "${models[1]}" allreduce 24 3 0.02 80)")
    echo "learn,resnet152-tiny,allreduce,0,2,3,80,$row" | tee -a "$CSV"
    # DynPipe: stage 1 of both pipelines slowed 3x from iteration 120, 400
    # iterations (the last fifth after any re-partition), re-partitioning off (static) or on (DynPipe's defaults:
    # windows of 50, baseline at 100, threshold 2, 60 iterations later).
    for mode in static dynamic; do
        enabled=$([ "$mode" = dynamic ] && echo true || echo false)
        f="$tmp/dyn-$mode.json"
        cat >"$f" <<JSON
{"name": "dyn-$mode", "model": "${models[1]}", "optimizer": {"sgd": {"lr": 0.01, "momentum": 0.9}},
 "batch": 8, "microbatches": 4, "pipelines": 2, "stages": 3, "sync": {"allreduce": {}},
 "dynamic": {"enabled": $enabled}, "iterations": 400,
 "interference": {"slowdowns": [{"stage": 1, "factor": 3.0, "at_iteration": 120}]}}
JSON
        row=$(python3 "$HERE/watch.py" "$BIN" "$SETTINGS" "$ctl" "$f")
        echo "dynpipe-$mode,resnet152-tiny,allreduce,0,2,3,400,$row" | tee -a "$CSV"
    done
fi

# The simulator: SD-Pipe's comparison at 8..64 GPUs, DynPipe's with a
# stage slowed 1.5x (light) or 3x (heavy) at iteration 120.
sim() { "$BIN" --log-level warn train simulate --spec "$SETTINGS/train_resnet152.json" --profile "$PROFILE_GPU" "$@"; }
echo "test,sync,mode,hetero,slowdown,pipelines,gpus,samples_per_s,iteration_median_s" >"$SIM_CSV"
for p in 2 4 8 16; do
    for h in 0 0.1 0.3; do
        for s in preduce allreduce adpsgd; do
            out=$(sim --pipelines "$p" --sync "$s" --hetero "$h" --mode static)
            echo "sdpipe,$s,static,$h,-,$p,$(( p * 4 )),$(echo "$out" | awk '/samples\/s/ { for (i = 1; i <= NF; i++) if ($i == "samples/s") print $(i-1) }' | head -1),$(echo "$out" | awk '/median/ { print $(NF-1) }' | head -1)" >>"$SIM_CSV"
        done
    done
done
for load in none:1 light:1.5 heavy:3; do
    for m in static restart dynamic; do
        f="${load#*:}"
        out=$(sim --pipelines 2 --sync allreduce --mode "$m" --restart-s 5 --slowdown "1:$f@120")
        echo "dynpipe,allreduce,$m,0,${load%%:*},2,8,$(echo "$out" | awk '/samples\/s/ { for (i = 1; i <= NF; i++) if ($i == "samples/s") print $(i-1) }' | head -1),$(echo "$out" | awk '/median/ { print $(NF-1) }' | head -1)" >>"$SIM_CSV"
    done
done
column -s, -t "$SIM_CSV"

get() { csv_get "$CSV" "$1" "test=sdpipe" "sync=$2" "hetero=$3"; }
sget() { csv_get "$SIM_CSV" samples_per_s "$@"; }
line=" preduce_vs_allreduce_h0.3=$(ratio "$(get samples_per_s preduce 0.3)" "$(get samples_per_s allreduce 0.3)")"
line="$line preduce_vs_allreduce_h0=$(ratio "$(get samples_per_s preduce 0)" "$(get samples_per_s allreduce 0)")"
line="$line loss_preduce_vs_allreduce_h0.3=$(ratio "$(get final_loss preduce 0.3)" "$(get final_loss allreduce 0.3)")"
line="$line dynamic_vs_static_3x_tail_time=$(ratio "$(csv_get "$CSV" tail_s_per_iteration test=dynpipe-dynamic)" "$(csv_get "$CSV" tail_s_per_iteration test=dynpipe-static)")"
line="$line sim64_preduce_vs_allreduce_h0.3=$(ratio "$(sget test=sdpipe sync=preduce hetero=0.3 pipelines=16)" "$(sget test=sdpipe sync=allreduce hetero=0.3 pipelines=16)")"
line="$line sim_dynamic_vs_static_heavy=$(ratio "$(sget test=dynpipe mode=dynamic slowdown=heavy)" "$(sget test=dynpipe mode=static slowdown=heavy)")"
line="$line sim_restart_vs_static_heavy=$(ratio "$(sget test=dynpipe mode=restart slowdown=heavy)" "$(sget test=dynpipe mode=static slowdown=heavy)")"
echo "wrote $CSV and $SIM_CSV"
echo "headline:$line"
