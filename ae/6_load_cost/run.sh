#!/usr/bin/env bash
# Test 6, load cost (the paper's figure 11b): the time to make a model
# runnable once its bytes are in host memory. DistMind: an arena, one copy
# per parameter group and a plan over the layer list (nothing is parsed or
# converted); measured as the first request's latency minus a warm one's on
# the cpu executor (real math on this CPU). PyTorch, where it is installed
# (DISTMIND_TORCH_PYTHON, or the venv ae/.work/torchenv made from
# tests/reference/requirements-torch.txt): torch.load of the whole pickled
# model (how the paper's MPS baseline keeps models) and of the state dict
# with load_state_dict, from bytes in memory, on the same CPU.
# Real measurements only: the simulator has no CPU costs to show here.
source "$(dirname "$0")/../lib.sh"
HERE="$AE/6_load_cost"
RES="$HERE/results"
CSV="$RES/load-cost.csv"
mkdir -p "$RES"
if [ -z "${DISTMIND_TORCH_PYTHON:-}" ] && [ -x "$WORK/torchenv/bin/python" ]; then
    export DISTMIND_TORCH_PYTHON="$WORK/torchenv/bin/python"
fi
if [ -z "${PLOT_ONLY:-}" ]; then
    rm -f "$CSV"
    "$BIN" --log-level warn bench load --repeat "${REPEAT:-3}" --csv "$CSV"
fi
"$BIN" plot bars --csv "$CSV" --out "$RES/fig11b-load-cost.png" \
    --x family --series system --y load_ms --log-y \
    --title "Test 6: time to make a model runnable from bytes in host memory (CPU)" \
    --y-label "ms (log scale)" --x-label "model family" \
    --caption "this machine's CPU: DistMind's cpu executor (first request minus a warm one) vs PyTorch torch.load, medians of ${REPEAT:-3}"
l() { csv_get "$CSV" load_ms family=resnet152 "system=$1"; }
echo "wrote $CSV and $RES/fig11b-load-cost.png"
if [ -n "$(l pytorch_whole_model)" ]; then
    echo "headline: resnet152_distmind_ms=$(l distmind) resnet152_torch_whole_vs_distmind=$(ratio "$(l pytorch_whole_model)" "$(l distmind)") resnet152_torch_state_dict_vs_distmind=$(ratio "$(l pytorch_state_dict)" "$(l distmind)")"
else
    echo "headline: resnet152_distmind_ms=$(l distmind) torch=not_installed"
fi
