#!/usr/bin/env bash
# Issue 20's GPU checks in one command, for a GPU machine with no network, run from a copy of the tree
# and a folder of wheels (hivemind and what it needs; never torch: the machine's own torch and
# transformers stay). In this order, each under `timeout`, going on when one fails, none started after
# DEADLINE seconds (default 400; a cut inner_loop row keeps the repeats it finished in its JSON):
#   1. tests/test_devices.py: the CUDA tests, a bf16 region and an fp32 region of real peers among them
#   2. benchmarks/llama_folder.py /tmp/llama317: the 317 M-parameter Llama's folder (no weights)
#   3. benchmarks/inner_loop.py rows, bf16, 4 torch threads, 3 repeats each: cocodc 16×512 (96 steps),
#      streaming 16×512 (96), diloco 16×512 (96; H = 48), cocodc 8×128 (240 steps), then cocodc
#      16×512 with --compile inductor (96, 2 repeats; the compile is inside the timed steps). Only the
#      first row warms the device with an untimed plain run. ONLY="NAME NAME" runs only those rows;
#      SKIP_TESTS=1 skips stage 1.
#   4. with BASE_CODE=DIR set: the cocodc 16×512 row run with `--code DIR`, 2 repeats (before/after)
# then a summary: each row's median ratio (peer ÷ plain tokens/s) and MFU, and pytest's result line.
# Logs and JSON go to ${OUT:-gpu-check-out}.
# Time on an H200 (2026-11-26): the CUDA tests 40 s; a 317 M row's repeat about 110 s (start-up of both
# processes included; the timed steps are 10-17 s of it). A 15-minute lease holds one call of at most
# 10 minutes and, on the machine still warm, a shorter second one: DEADLINE=540 runs the tests, the
# cocodc 16×512 row and part of the next; the second call goes on with ONLY=… SKIP_TESTS=1.
#
#   bash benchmarks/gpu_check.sh .whl                       # on the GPU machine, from the tree's root
#   BASE_CODE=/path/to/old/tree ROWS=quick bash benchmarks/gpu_check.sh .whl   # quick: 1 repeat each
#   DEVICE=cpu SKIP_INSTALL=1 PYTHON=.venv/bin/python OUT=/tmp/out bash benchmarks/gpu_check.sh
#     (a CPU smoke test of the script: a tiny Llama, tiny rows, pytest only collects)
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
WHEELS=${1:-wheelhouse}
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
DEADLINE=${DEADLINE:-400}
export PYTHONUNBUFFERED=1
START=$SECONDS

stamp() { printf '== %s +%ss: %s\n' "$(date +%H:%M:%S)" $((SECONDS - START)) "$*"; }

# stage NAME CAP COMMAND...: COMMAND for at most CAP seconds (and not past the deadline), its output
# to $OUT/NAME.log
stage() {
    local name=$1 cap=$2 left=$((DEADLINE - (SECONDS - START)))
    shift 2
    ((left < cap)) && cap=$left
    if ((cap < 30)); then
        stamp "$name: skipped, $((SECONDS - START)) s of the $DEADLINE s gone" | tee "$OUT/$name.log"
        return
    fi
    stamp "$name (at most $cap s): $*"
    timeout -k 40 "$cap" "$@" 2>&1 | tee "$OUT/$name.log"
    stamp "$name: exit ${PIPESTATUS[0]}"
}

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    stamp "installing the wheels of $WHEELS into /tmp/site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 3
    SP=$("$PY" -c "import site; print(site.getsitepackages()[0])")
    # .pth files, not PYTHONPATH: the tests' subprocesses drop PYTHONPATH
    echo /tmp/site >"$SP/zz_site.pth"
    echo "$PWD" >"$SP/zz_p2p.pth"
fi

if [ "${DEVICE:-cuda}" = cpu ]; then
    DEV=(--device cpu --precision fp32 --threads 1)
    MODEL=$OUT/tiny-llama
    FOLDER=(--hidden 64 --layers 2 --heads 2 --intermediate 128)
    BIG=(--batch-size 2 --seq-len 32) SMALL=(--batch-size 2 --seq-len 16)
    STEPS=(--inner-steps 8 --steps 24) LONG=(--inner-steps 8 --steps 24)
    PYTEST=(--collect-only)
else
    DEV=(--device cuda --precision bf16 --threads 4)
    MODEL=/tmp/llama317
    FOLDER=()
    BIG=(--batch-size 16 --seq-len 512) SMALL=(--batch-size 8 --seq-len 128)
    STEPS=(--inner-steps 48 --steps 96) LONG=(--inner-steps 48 --steps 240)
    PYTEST=()
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.log"
fi
"$PY" -c "import sys, torch, transformers, hivemind; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'hivemind', \
hivemind.__version__)" | tee -a "$OUT/gpu.log" || exit 4

repeats() { if [ "${ROWS:-}" = quick ]; then echo 1; else echo "$1"; fi; }

WARM=()  # the first row warms the device with one untimed plain run; the rows after it find it warm
ROWS_RUN=()
# row NAME CAP REPEATS ARGS...: one inner_loop row, its JSON to $OUT/NAME.json; with ONLY set (names
# separated by spaces), only the rows it names run
row() {
    local name=$1 cap=$2 n
    n=$(repeats "$3")
    shift 3
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    ROWS_RUN+=("$name")
    stage "$name" "$cap" "$PY" benchmarks/inner_loop.py "${DEV[@]}" --model "hf:$MODEL" --no-write \
        --json "$OUT/$name.json" --repeats "$n" "${WARM[@]}" "$@"
    WARM=(--no-warm-up)
}

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    stage pytest 180 "$PY" -m pytest -q -p no:cacheprovider tests/test_devices.py -rs "${PYTEST[@]}"
fi
stage llama-folder 90 "$PY" benchmarks/llama_folder.py "$MODEL" "${FOLDER[@]}"
row cocodc-big 400 3 --algo cocodc "${BIG[@]}" "${STEPS[@]}"
row streaming-big 360 3 --algo streaming "${BIG[@]}" "${STEPS[@]}"
row diloco-big 360 3 --algo diloco "${BIG[@]}" "${STEPS[@]}"
row cocodc-small 400 3 --algo cocodc "${SMALL[@]}" "${LONG[@]}"
row cocodc-big-inductor 300 2 --algo cocodc "${BIG[@]}" "${STEPS[@]}" --compile inductor
if [ -n "${BASE_CODE:-}" ]; then
    row base-cocodc-big 160 2 --algo cocodc "${BIG[@]}" "${STEPS[@]}" --code "$BASE_CODE"
fi

stamp "summary (big: ${BIG[*]}, small: ${SMALL[*]})"
for name in "${ROWS_RUN[@]}"; do
    "$PY" - "$OUT/$name.json" "$name" <<'EOF'
import json, sys
from pathlib import Path

path, name = Path(sys.argv[1]), sys.argv[2]
if not path.exists():
    sys.exit(print(f"{name:16} no result (see {path.with_suffix('.log')})"))
s = json.loads(path.read_text())


def pct(value):
    return "n/a" if value is None else f"{100 * value:.1f} %"


wait = s["sync_boundary_ms_per_sync"]
print(
    f"{name:16} {s['repeats_done']} repeats, median ratio {s['median_ratio']:.3f} "
    f"({s['min_ratio']:.3f}-{s['max_ratio']:.3f}), peer {s['peer_tokens_per_s']:.0f} tok/s MFU "
    f"{pct(s['peer_mfu'])}, plain {s['plain_tokens_per_s']:.0f} tok/s MFU {pct(s['plain_mfu'])}, "
    f"sync wait {'n/a' if wait is None else f'{wait:.1f} ms'}/sync, DHT + daemon "
    f"{s['helpers_uss_bytes'] / 1e6:.0f} MB USS, {s['optimizer']}, code {s['code']}"
)
EOF
done
[ -f "$OUT/pytest.log" ] && echo "pytest: $(grep -E '(passed|failed|error|skipped|tests? collected|no tests ran)' "$OUT/pytest.log" | tail -1)"
stamp "done"
