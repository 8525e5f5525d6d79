#!/usr/bin/env bash
# Training input near the data, on real processes at this machine's scale.
#
# SOPHON: a dataset of real JPEGs generated here (a third are 900 x 700
# photos whose 224 x 224 crop is smaller than the file, the rest small
# images whose file is the smallest form) stored on one memory server
# whose NIC is held to 500 Mbit/s, with 1 to 4 preprocessing workers. One
# epoch through the runtime's data loader per mode: none (ship files),
# all (every step on the memory server), split:2 (decode and crop there),
# sophon (the per-sample plan from a profiling epoch). Time and bytes the
# trainer received.
#
# NDPipe: the same memory server runs a frozen backbone (a generated tiny
# ResNet without its head) over its samples in R chunks and ships f16
# features; the trainer fine-tunes the head on chunk i while chunk i+1 is
# extracted. R = 1, 2, 4 against shipping the images (backbone on the
# trainer). Extraction throughput, bytes on the wire (the memory server's
# metrics), total time, held-out accuracy.
#
# This machine has 2 cores: the memory server's workers and the trainer
# share them, so more than 2 workers add no CPU (stated in the CSV).
source "$(dirname "$0")/../lib.sh"
HERE="$AE/11_near_data"
RES="$HERE/results"
CSV="$RES/sophon.csv"
mkdir -p "$RES"
SAMPLES="${SAMPLES:-120}"
LINKS="${LINKS:-500mbit 100mbit}"

tmp="$(mktemp -d)"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
# `distmind <service>` in the background (in this shell, so that its pid is
# kept for cleanup); waits for its readiness line; its address in $ADDR.
service() {
    local name="$1"; shift
    "$BIN" --log-level warn "$@" >"$tmp/$name.out" 2>"$tmp/$name.err" &
    PID=$!
    pids+=("$PID")
    for _ in $(seq 300); do
        grep -q "listening on" "$tmp/$name.out" 2>/dev/null && break
        sleep 0.1
    done
    ADDR=$(awk '/listening on/ { print $NF; exit }' "$tmp/$name.out")
    if [ -z "$ADDR" ]; then
        echo "distmind $* did not start:" >&2; cat "$tmp/$name.err" >&2; exit 1
    fi
}
# A CSV as a table (column(1) where there is one).
table() { if command -v column >/dev/null; then column -s, -t "$1"; else cat "$1"; fi; }
dm() { "$BIN" --log-level warn "$@" --settings "$SETTINGS" --controller "$ctl"; }

"$BIN" --log-level warn dataset synth --out "$tmp/photos" --samples "$SAMPLES" --classes 4 \
    --sizes 64x64,96x128,900x700 --quality 95 >/dev/null

echo "test,prep_workers,link,mode,samples,offloaded,seconds,bytes,local_prep_s" >"$CSV"
for LINK in $LINKS; do
for w in 1 2 4; do
    # A fresh controller and memory server per link and worker count.
    service "ctl$w" controller --settings "$SETTINGS" --listen 127.0.0.1:0 --client-listen 127.0.0.1:0 --no-dispatcher
    ctl=$ADDR ctlpid=$PID
    service "ms$w" memserver --settings "$SETTINGS" --listen 127.0.0.1:0 --capacity 512MiB \
        --controller "$ctl" --prep-workers "$w" --emulate-link "$LINK" --emulate-loopback "$LINK"
    mspid=$PID
    for _ in $(seq 50); do dm dataset put --name photos "$tmp/photos" >/dev/null 2>&1 && break; sleep 0.2; done
    dm dataset plan photos --mode sophon --bandwidth "$LINK" --out "$tmp/plan.json" >/dev/null
    for mode in none all split:2 sophon; do
        if [ "$mode" = sophon ]; then how=(--plan "$tmp/plan.json"); else how=(--mode "$mode"); fi
        r=$(dm dataset epoch photos --json "${how[@]}")
        row=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(str(r[k]) for k in ("samples","offloaded","seconds","bytes","local_prep_s")))' "$r")
        echo "sophon,$w,$LINK,$mode,$row" | tee -a "$CSV"
    done
    dm dataset rm photos >/dev/null
    kill "$mspid" "$ctlpid"; wait "$mspid" "$ctlpid" 2>/dev/null || true
done
done
table "$CSV"

# NDPipe: a controller and one memory server running a generated tiny
# ResNet-152 without its head (64 x 64 inputs), 1 extraction worker; a
# labelled set of small JPEGs; R = 1, 2, 4 near the data against shipping
# the images (the backbone on the trainer). The trainer's fine-tuning of
# the head (2000 epochs, one batch per chunk) costs about what extraction
# does, so the overlap of chunks matters.
ND_CSV="$RES/ndpipe.csv"
"$BIN" --log-level warn dataset synth --out "$tmp/small" --samples 240 --classes 4 --sizes 64x64,80x96 --quality 90 >/dev/null
"$BIN" --log-level warn model gen --family resnet152 --scale tiny --variants 1 --group-bytes 65536 --out "$tmp/pk" >/dev/null
bb="$tmp/pk/$(ls "$tmp/pk")"
service ndctl controller --settings "$SETTINGS" --listen 127.0.0.1:0 --client-listen 127.0.0.1:0 --no-dispatcher
ctl=$ADDR
service ndms memserver --settings "$SETTINGS" --listen 127.0.0.1:0 --capacity 256MiB \
    --controller "$ctl" --prep-workers 1 --backbone "$bb"
for _ in $(seq 50); do dm dataset put --name small "$tmp/small" >/dev/null 2>&1 && break; sleep 0.2; done
echo "test,mode,chunks,samples,extract_samples_per_s,bytes,train_s,wall_s,held_out_accuracy" >"$ND_CSV"
nd() {
    local mode="$1"; shift
    r=$(dm ndpipe --dataset small --epochs 2000 --batch 45 --lr 2 --held-out 0.25 --json "$@")
    row=$(python3 -c 'import json,sys; r=json.loads(sys.argv[1]); print(",".join(str(x) for x in (len(r["chunks"]), r["extracted"], round(r["extract_samples_per_s"], 1), r["bytes"], round(r["train_s"], 4), round(r["wall_s"], 4), round(r["held_out_accuracy"], 4))))' "$r")
    echo "ndpipe,$mode,$row" | tee -a "$ND_CSV"
}
for r in 1 2 4; do nd near_data --chunks "$r"; done
nd ship_images --chunks 4 --ship-images --backbone "$bb"
table "$ND_CSV"

get() { csv_get "$CSV" "$1" "link=$2" "prep_workers=$3" "mode=$4"; }
# sophon's speed-up over the faster of none and all (above 1: sophon is faster).
line=""
for LINK in $LINKS; do
    for w in 1 2 4; do
        best=$(python3 -c 'import sys; print(min(float(a) for a in sys.argv[1:]))' "$(get seconds "$LINK" "$w" none)" "$(get seconds "$LINK" "$w" all)")
        line="$line sophon_speedup_${LINK}_w$w=$(ratio "$best" "$(get seconds "$LINK" "$w" sophon)")"
    done
    line="$line sophon_traffic_cut_${LINK}_w1=$(ratio "$(get bytes "$LINK" 1 none)" "$(get bytes "$LINK" 1 sophon)")"
done
nget() { csv_get "$ND_CSV" "$1" "mode=$2" "chunks=$3"; }
line="$line ndpipe_r4_vs_r1_time=$(ratio "$(nget wall_s near_data 4)" "$(nget wall_s near_data 1)")"
line="$line ndpipe_bytes_cut_vs_images=$(ratio "$(nget bytes ship_images 4)" "$(nget bytes near_data 4)")"
line="$line ndpipe_accuracy_r1=$(nget held_out_accuracy near_data 1) ndpipe_accuracy_r4=$(nget held_out_accuracy near_data 4)"
echo "wrote $CSV and $ND_CSV"
echo "headline:$line"
