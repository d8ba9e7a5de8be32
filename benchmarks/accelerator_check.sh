#!/usr/bin/env bash
# The accelerator checks of a short lease on one GPU, as one command (docs/accelerators.md):
#
#   1. the device, the driver and the versions;
#   2. the Pallas kernel's tests on the device (compiled by Triton, not interpreted), slow ones
#      included: tests/attention/test_pallas.py and test_window_forget.py;
#   3. benchmarks/accelerator.py at T 8k (no bias, ALiBi, FIRE; every implementation), then the
#      sliding-window (512 keys) and forget-gate variants at T 1k and 8k with ALiBi;
#   4. GPT-2 small training throughput with "auto" for RoPE, ALiBi, FoX and a local/global
#      hybrid (windowed RoPE layers with a global one).
#
# Each part has its own time limit and keeps what it measured when stopped; a failing part does
# not stop the next. Everything lands in $OUT (default runs/accelerator_check): device.txt,
# pytest.txt, attention_8k.json, attention_masks.json, training.json and log.txt. Run from the
# repository root with the project importable (`pip install -e .`, or PYTHONPATH=src):
#
#     bash benchmarks/accelerator_check.sh
#
# SECONDS_TESTS, SECONDS_8K, SECONDS_MASKS and SECONDS_TRAIN set the parts' limits (defaults
# 110, 110, 100, 120 seconds: the whole within about eight minutes with the start).
set -u
OUT=${OUT:-runs/accelerator_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
TMP=$(mktemp -d)

part() {  # part NAME SECONDS COMMAND...: runs COMMAND with a time limit, logging its status
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
    local start=$SECONDS  # SIGINT at the limit: pytest prints its summary, the benchmark has
    # already written every case it finished
    timeout --signal=INT --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$LOG"
}

{
    nvidia-smi
    $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
    git rev-parse HEAD 2>/dev/null || true
} >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt" >>"$LOG"

# Tests: one worker per 2 CPU cores, each with a share of the GPU's memory taken as needed.
XLA_PYTHON_CLIENT_PREALLOCATE=false POSATTN_TEST_XLA_DEFAULT=1 part tests "${SECONDS_TESTS:-110}" \
    $PY -m pytest -v --tb=short -o addopts="" -ra -m "slow or not slow" -n 8 --dist load \
    --durations=10 tests/attention/test_pallas.py tests/attention/test_window_forget.py
sed -n '/== tests (limit/,/== tests: exit/p' "$LOG" >"$OUT/pytest.txt"

part attention_8k "${SECONDS_8K:-110}" $PY benchmarks/accelerator.py --lengths 8192 \
    --families none alibi fire --variants causal --repeats 3 --skip-training --out "$TMP/8k"
cp "$TMP/8k/accelerator.json" "$OUT/attention_8k.json" 2>/dev/null

part attention_masks "${SECONDS_MASKS:-100}" $PY benchmarks/accelerator.py --lengths 1024 8192 \
    --families alibi --variants window forget --window 512 --repeats 3 --skip-training \
    --out "$TMP/masks"
cp "$TMP/masks/accelerator.json" "$OUT/attention_masks.json" 2>/dev/null

part training "${SECONDS_TRAIN:-120}" $PY benchmarks/accelerator.py --skip-attention \
    --train-families rope alibi fox "rope:window=256/rope:window=256/rope" --train-batch 16 \
    --train-steps 10 --out "$TMP/train"
cp "$TMP/train/accelerator.json" "$OUT/training.json" 2>/dev/null
rm -rf "$TMP"
