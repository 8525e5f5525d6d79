# Sourced by every ae/<test>/run.sh: the binary, the settings, the model
# packages (generated once, reused by later runs), and `stored_mib`.
set -euo pipefail
AE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$AE/.." && pwd)"
BIN="${DISTMIND_BIN:-$ROOT/target/release/distmind}"
cd "$ROOT"
# Relative, so that figure captions name settings/profiles/..., not this machine's path.
SETTINGS="${SETTINGS:-settings}"
# Generated packages (full scale: hundreds of MB each); delete to reclaim disk.
WORK="${AE_WORK:-$AE/.work}"
if [ ! -x "$BIN" ]; then
    (cd "$ROOT" && cargo build --release)
fi
mkdir -p "$WORK"

# MiB a model of family $1 takes in whole 4 MiB cache blocks (its stored size rounded up).
stored_mib() {
    case "$1" in
        resnet152) echo 232 ;;
        inception_v3) echo 92 ;;
        densenet201) echo 80 ;;
        bert_base) echo 420 ;;
        gpt2) echo 476 ;;
        *) echo "unknown family $1" >&2; return 1 ;;
    esac
}

# up with the settings, the shared packages, the sim executor and quiet services.
up() {
    "$BIN" --log-level warn up --settings "$SETTINGS" --work-dir "$WORK" \
        --executor sim --child-log error "$@"
}

# The loopback rate every host's bucket holds under an emulated link, the same
# for every run of a script: EMU_LOOPBACK, else measured once here
# (`distmind bench loopback`: a quarter of one TCP stream's rate).
EMU_LOOPBACK="${EMU_LOOPBACK:-$("$BIN" --log-level warn bench loopback --bucket)}"

# The two hardware balances: the paper's testbed (V100, PCIe 3 at ~12 GB/s,
# 100 Gbit/s EFA) and today's (H200, PCIe 5 at ~50 GB/s, 400 Gbit/s).
# Sets PROFILE and LINK for balance $1.
balance() {
    case "$1" in
        paper) PROFILE="$SETTINGS/profiles/v100-estimated.json"; LINK=100gbit ;;
        today) PROFILE="$SETTINGS/profiles/h200-estimated.json"; LINK=400gbit ;;
        *) echo "unknown balance $1 (paper or today)" >&2; return 1 ;;
    esac
}

# Emulated seconds a run of balance $1 lasts so that it takes about
# $WALL_PER_RUN seconds of wall time (default 60) at this machine's K, at
# least 0.5 s: a faster link means a larger K and a shorter emulated run.
emu_duration() {
    balance "$1"
    awk -v link="${LINK%gbit}" -v lo="${EMU_LOOPBACK%MB/s}" -v wall="${WALL_PER_RUN:-60}" \
        'BEGIN { k = link * 125 / lo; d = wall / k; if (d < 0.5) d = 0.5; printf "%.2fs\n", d }'
}

# K of balance $1: the link rate over the loopback bucket.
emu_k() {
    balance "$1"
    awk -v link="${LINK%gbit}" -v lo="${EMU_LOOPBACK%MB/s}" 'BEGIN { printf "%.2f\n", link * 125 / lo }'
}

# up on an emulated link of balance $1 (the rest of the arguments are up's).
up_emu() {
    balance "$1"; shift
    up --profile "$PROFILE" --emulate-link "$LINK" --emulate-loopback "$EMU_LOOPBACK" "$@"
}

# Prints the value of column $2 in the rows of CSV $1 whose columns match
# the name=value pairs that follow (the first match).
csv_get() {
    local csv="$1" col="$2"; shift 2
    awk -F, -v col="$col" -v conds="$*" '
        NR == 1 { for (i = 1; i <= NF; i++) idx[$i] = i; n = split(conds, c, " "); next }
        { ok = 1; for (j = 1; j <= n; j++) { split(c[j], kv, "="); if ($(idx[kv[1]]) != kv[2]) ok = 0 }
          if (ok) { print $(idx[col]); exit } }' "$csv"
}

# The mean of column $2 over the rows of CSV $1 whose columns match the
# name=value pairs that follow (empty when none match): the simulator's
# figures average several seeds.
csv_mean() {
    local csv="$1" col="$2"; shift 2
    awk -F, -v col="$col" -v conds="$*" '
        NR == 1 { for (i = 1; i <= NF; i++) idx[$i] = i; n = split(conds, c, " "); next }
        { ok = 1; for (j = 1; j <= n; j++) { split(c[j], kv, "="); if ($(idx[kv[1]]) != kv[2]) ok = 0 }
          if (ok && $(idx[col]) != "") { s += $(idx[col]); k++ } }
        END { if (k > 0) printf "%.3f\n", s / k }' "$csv"
}

# $1 / $2 with 2 decimals ("-" when either is missing or $2 is 0).
ratio() {
    awk -v a="$1" -v b="$2" 'BEGIN { if (a == "" || b == "" || b + 0 == 0) print "-"; else printf "%.2f", a / b }'
}

# The simulator at the paper's scale (`distmind simulate`): 4 GPU servers x
# 8 GPUs (16 GiB of parameter memory each, the V100), 4 memory servers,
# every NIC 100 Gbit/s, the estimated V100 profile; the rest of the
# arguments are simulate's. DistMind's host cache is the original's 4 GB
# (PAPER_CACHE); the baselines hold the whole set unless told otherwise.
PAPER_CACHE=4GiB
# Seeds each simulated setting runs with (the figures show their mean): with
# the original policy, which GPUs hold the popular models early on moves
# a run's throughput by up to 15%.
SIM_SEEDS="${SIM_SEEDS:-0 1 2 3 4}"
sim_paper() {
    "$BIN" --log-level warn simulate --settings "$SETTINGS" \
        --profile "$SETTINGS/profiles/v100-estimated.json" --link 100gbit \
        --gpu-servers 4 --gpus 8 --memservers 4 --device-memory 16GiB "$@"
}

# Models per family in the paper's evaluation (128; 64 for BERT and GPT-2).
paper_models() {
    case "$1" in
        bert_base|gpt2) echo 64 ;;
        *) echo 128 ;;
    esac
}
