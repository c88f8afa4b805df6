#!/usr/bin/env bash
# Issue 25 item 7: the real-architecture table and the zoo's training steps on a lent GPU, in
# one call of the device tool (its machine starts bare: python3 there holds torch and CUDA).
#
#   carry: .whl (transformers, timm, peft and opacus wheels of the versions this checkout was
#   measured with, `pip download --no-deps ... -d .whl`); run from the repository root:
#   bash tools/gpu_tables.sh            (DEVICE=cpu QUICK=1 for a dry run of the script)
#
# Every part has its own time limit and writes as it goes, so a part that fails or runs out
# of time leaves the others' results. What it writes lands in $OUT (the tool's folder).
set -u
OUT=${OUT:-bench-results/gpu}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PYTHONPATH=$PWD
if compgen -G ".whl/*.whl" >/dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=$PWD:/tmp/site
fi
LOG=$OUT/log.txt
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm \
        --format=csv 2>&1 || true
    $PY -c "from workbench.realzoo.imports import import_timm, import_transformers; \
import torch, opacus; transformers = import_transformers(); timm = import_timm(); import peft; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', \
transformers.__version__, 'timm', timm.__version__, 'peft', peft.__version__, 'opacus', \
opacus.__version__)"
} 2>&1 | tee "$LOG"

if [ -n "${QUICK:-}" ]; then
    ZOO=(--models mnist_cnn --batch-sizes 64 --repeats 2); GPT=(--repeats 2)
    REAL=(--models gpt2 bit --sizes tiny --repeats 2)
else
    ZOO=(--models mnist_cnn cifar10_cnn imdb_embedding imdb_lstm --batch-sizes 64 256 --repeats 5)
    GPT=(--repeats 5); REAL=(--repeats 5 ${REAL_ARGS:-})
fi
part() {  # part SECONDS NAME ARGS...: one benchmark, its own limit, its output in the log
    local limit=$1 name=$2; shift 2
    echo "== $name ($(date -u +%T))" | tee -a "$LOG"
    timeout "$limit" "$PY" -m workbench.bench "$@" 2>&1 | tee -a "$LOG"
    echo "== $name: rc ${PIPESTATUS[0]} ($(date -u +%T))" | tee -a "$LOG"
}
if [ -z "${SKIP_ZOO:-}" ]; then  # SKIP_ZOO=1: the real table alone
    part 150 zoo training --device "$DEVICE" "${ZOO[@]}" --modes auto bookkeeping \
        --opacus hooks ghost --memory --out "$OUT/training_$DEVICE.csv"
    part 60 tiny_gpt training --device "$DEVICE" --models tiny_gpt --batch-sizes 32 \
        "${GPT[@]}" --modes auto bookkeeping --opacus hooks ghost --memory \
        --out "$OUT/training_gpt_$DEVICE.csv"
fi
# The real table in two processes over the two halves of its models (the verdicts' float64
# loops are one process's Python; each half times its DP and plain steps interleaved), then
# one CSV and its summary.
if [ -z "${QUICK:-}" ]; then
    mapfile -t NAMES < <($PY -c "from workbench.realzoo import PROBLEMS; print(*PROBLEMS, sep='\n')")
    [ -n "${REAL_MODELS:-}" ] && read -r -a NAMES <<< "$REAL_MODELS"  # a dry run's few
    # REAL_ALONE: models run last, each in a process of its own (a CUDA device-side assert
    # ends its process's CUDA: on an H200, 2026-11-30, OPT's took the rest of its half along)
    read -r -a ALONE <<< "${REAL_ALONE:-}"
    for a in "${ALONE[@]}"; do NAMES=("${NAMES[@]/$a}"); done
    read -r -a NAMES <<< "${NAMES[*]}"
    HALF=$(( (${#NAMES[@]} + 1) / 2 ))
    part "${REAL_LIMIT:-300}" real_a real --device "$DEVICE" "${REAL[@]}" \
        --models "${NAMES[@]:0:$HALF}" --out "$OUT/real_a.csv" > /dev/null &
    part "${REAL_LIMIT:-300}" real_b real --device "$DEVICE" "${REAL[@]}" \
        --models "${NAMES[@]:$HALF}" --out "$OUT/real_b.csv" > /dev/null
    wait
    PARTS=("$OUT/real_a.csv" "$OUT/real_b.csv")
    for a in "${ALONE[@]}"; do
        part 60 "real_$a" real --device "$DEVICE" "${REAL[@]}" --models "$a" \
            --out "$OUT/real_$a.csv" > /dev/null
        PARTS+=("$OUT/real_$a.csv")
    done
    $PY -c "
import sys, pandas as pd
from workbench.bench import real
parts = [pd.read_csv(f) for f in sys.argv[2:] if __import__('os').path.exists(f)]
table = pd.concat(parts, ignore_index=True)
table.to_csv(sys.argv[1], index=False)
print(real.printable(table).to_string(index=False)); print(real.summary(table))
" "$OUT/real_$DEVICE.csv" "${PARTS[@]}" 2>&1 | tee -a "$LOG"
    rm -f "${PARTS[@]}"
else
    part 60 real real --device "$DEVICE" "${REAL[@]}" --out "$OUT/real_$DEVICE.csv"
fi
# DIAG: a script of further checks to run last (its output in $OUT)
if [ -n "${DIAG:-}" ]; then bash "$DIAG"; fi
