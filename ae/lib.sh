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
# How long each run's workload lasts.
DUR="${DUR:-4s}"
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
