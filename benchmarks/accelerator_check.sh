#!/usr/bin/env bash
# The accelerator checks of a short lease on one GPU (docs/accelerators.md), by part:
#
#   tests      the Pallas kernel's tests on the device (compiled by Triton, not interpreted), slow
#              ones included: tests/attention/test_pallas.py and test_window_forget.py  (120 s)
#   attention  benchmarks/accelerator.py at T 8k: no bias, ALiBi and FIRE, every implementation
#              (200 s)
#   masks      the sliding-window (512 keys), forget-gate, soft-cap (50) and two-score (far from
#              512) variants with ALiBi at T 1k and 8k, every implementation  (200 s)
#   long       pallas at T 64k, no bias and ALiBi  (90 s)
#   training   GPT-2 small training throughput with "auto" for RoPE, ALiBi, FoX and a
#              local/global hybrid (windowed RoPE layers with a global one)  (240 s)
#   tiles      benchmarks/pallas_tiles.py: the kernel's tiles, warps and stages at T 8k, no bias
#              and ALiBi, against its defaults  (300 s)
#   experiment the length-extrapolation experiment end to end on the device, shortened: RoPE,
#              ALiBi and FoX, 300 steps, no eval-time RoPE rows or fine-tunes  (240 s)
#
# Limits in parentheses (SECONDS_<PART> overrides one, e.g. SECONDS_TRAINING=300), set from the
# first lease's timings (benchmarks/records/accelerator_h200_2026-12-04): a GPT-2 small training
# step compiles in about a minute, and Triton's FIRE kernels in more than thirty seconds (the
# tiles and experiment limits are estimates: neither part has run on a GPU yet). Each
# part keeps what it measured when stopped (SIGINT at the limit: pytest prints its summary, the
# benchmark has written every case it finished), and a failing part does not stop the next.
#
# The seven limits add up to 23 minutes, more than one 10-minute call or a 15-minute lease: run
#
#     bash benchmarks/accelerator_check.sh tests attention masks     # limits: 8.7 minutes
#     bash benchmarks/accelerator_check.sh long training             # limits: 5.5 minutes
#     bash benchmarks/accelerator_check.sh tiles experiment          # limits: 9 minutes
#
# as the lease allows (no argument runs all seven). From the repository root, with the project
# importable (`pip install -e .`, or PYTHONPATH=src). Everything lands in $OUT (default
# runs/accelerator_check): device.txt, log.txt, and per part pytest.txt, <part>.json or
# experiment.md (at most 8 files come back from a lease's call: split the parts as above).
set -u
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(tests attention masks long training tiles experiment)
for name in "${PARTS[@]}"; do
    case $name in
    tests | attention | masks | long | training | tiles | experiment) ;;
    *)
        echo "accelerator_check.sh: unknown part '$name'; parts: tests attention masks long training tiles experiment" >&2
        exit 2
        ;;
    esac
done
OUT=${OUT:-runs/accelerator_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
LOG="$OUT/log.txt"
TMP=$(mktemp -d)

limit() {  # limit PART DEFAULT: SECONDS_<PART> or DEFAULT
    local var="SECONDS_${1^^}"
    echo "${!var:-$2}"
}

run_part() {  # run_part NAME SECONDS COMMAND...: COMMAND with a time limit, its status logged
    local name=$1 seconds=$2
    shift 2
    echo "== $name (limit ${seconds} s): $*" | tee -a "$LOG"
    local start=$SECONDS
    timeout --signal=INT --kill-after=10 "$seconds" "$@" >>"$LOG" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s" | tee -a "$LOG"
}

bench() {  # bench PART SECONDS ARGS...: benchmarks/accelerator.py, its JSON copied to $OUT
    local name=$1 seconds=$2
    shift 2
    run_part "$name" "$seconds" $PY benchmarks/accelerator.py --repeats 3 --out "$TMP/$name" "$@"
    cp "$TMP/$name/accelerator.json" "$OUT/$name.json" 2>/dev/null
}

{
    nvidia-smi
    $PY -c "import jax, jaxlib, flax, optax; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print(jax.devices())"
} >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt" >>"$LOG"

for name in "${PARTS[@]}"; do
    case $name in
    tests)
        # One worker per 2 CPU cores, each taking the GPU's memory as it needs it.
        XLA_PYTHON_CLIENT_PREALLOCATE=false POSATTN_TEST_XLA_DEFAULT=1 run_part tests \
            "$(limit tests 120)" $PY -m pytest -v --tb=short -o addopts="" -ra \
            -m "slow or not slow" -n 8 --dist load --durations=10 \
            tests/attention/test_pallas.py tests/attention/test_window_forget.py
        sed -n '/== tests (limit/,/== tests: exit/p' "$LOG" >"$OUT/pytest.txt"
        ;;
    attention)
        bench attention "$(limit attention 200)" --lengths 8192 --families none alibi fire \
            --variants causal --skip-training
        ;;
    masks)
        bench masks "$(limit masks 200)" --lengths 1024 8192 --families alibi \
            --variants window forget softcap far --window 512 --skip-training
        ;;
    long)
        bench long "$(limit long 90)" --lengths 65536 --families none alibi --variants causal \
            --implementations pallas --skip-training
        ;;
    training)
        bench training "$(limit training 240)" --skip-attention --train-families rope alibi fox \
            "rope:window=256/rope:window=256/rope" --train-batch 16 --train-steps 10
        ;;
    tiles)
        run_part tiles "$(limit tiles 300)" $PY benchmarks/pallas_tiles.py --out "$TMP/tiles"
        cp "$TMP/tiles/pallas_tiles.json" "$OUT/tiles.json" 2>/dev/null
        ;;
    experiment)
        run_part experiment "$(limit experiment 240)" $PY experiments/length_extrapolation.py \
            --workdir "$TMP/experiment" --config.train.steps=300 --config.train.warmup_steps=30 \
            "--config.families=('rope','alibi','fox')" "--config.rope_scalings=()" \
            --config.finetune.enabled=False
        cp "$TMP/experiment/results.md" "$OUT/experiment.md" 2>/dev/null
        ;;
    esac
done
rm -rf "$TMP"
