#!/usr/bin/env bash
# The one prepared check for a machine with a CUDA GPU (run from anywhere; it works in the repo root).
#
# Needs only a Python with torch (CUDA build) and pytest; no .venv, no ComfyUI, no network. It runs the
# GPU-relevant unit tests, then bench/quant_linear.py and bench/engram_fetch.py on CUDA, and writes every
# log plus summary.json to $OUT (if set, e.g. by the device tool) or ./gpu-check-out. Each step has a
# time limit, so the whole run stays under ~8 minutes.
#
# Exit status: 0 all good; 1 tests failed; 2 tests passed but a bench failed or timed out;
# 3 the environment lacks something the check needs (printed).
#
#   bash bench/gpu_check.sh
#   GPU_CHECK_SKIP_BENCH=1 bash bench/gpu_check.sh   # tests only (and how the plumbing is tried without a GPU)
#   PYTHON=/path/to/python bash bench/gpu_check.sh
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/gpu-check-out}"
PY="${PYTHON:-python}"
TESTS_K="cuda or fp8_path or tensor_ops or buffer or group"
mkdir -p "$OUT_DIR"
cd "$ROOT" || exit 3

# `import fp8_engram` without this checkout's .host: a temp folder holding a symlink to the repo.
PKG_DIR="$(mktemp -d)"
trap 'rm -rf "$PKG_DIR"' EXIT
ln -s "$ROOT" "$PKG_DIR/fp8_engram"
export PYTHONPATH="$PKG_DIR${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

log() { echo "[gpu_check] $*" | tee -a "$OUT_DIR/gpu_check.log"; }

# ----- environment -----
"$PY" - >"$OUT_DIR/env.txt" 2>&1 <<'EOF'
import importlib, platform, sys
print("python", sys.version.split()[0], platform.platform())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("devices", torch.cuda.device_count(), [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
    print("capability", torch.cuda.get_device_capability(0))
    try:
        print("nccl", torch.cuda.nccl.version())
    except Exception as e:
        print("nccl ?", e)
try:
    import torch.distributed._symmetric_memory as symm_mem
    print("symmetric memory: yes; backend", symm_mem.get_backend("cuda") if hasattr(symm_mem, "get_backend") and torch.cuda.is_available() else "?")
except Exception as e:
    print("symmetric memory: NO", e)
for name in ("pytest", "safetensors", "numpy", "requests", "transformers"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "MISSING", type(e).__name__)
import fp8_engram.engram.buffer  # the package imports without ComfyUI
print("fp8_engram import ok")
EOF
env_rc=$?
cat "$OUT_DIR/env.txt"
command -v nvidia-smi >/dev/null && nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1
if [ $env_rc -ne 0 ]; then
    log "environment check failed (see env.txt): torch or the package does not import"
    exit 3
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
    log "pytest is missing from $PY; the tests cannot run"
    exit 3
fi
grep -q "available True" "$OUT_DIR/env.txt" || log "WARNING: no CUDA GPU visible: the CUDA tests will skip and the benches will fail"

# ----- tests -----
log "tests: -k \"$TESTS_K\""
start=$(date +%s)
timeout -k 10 270 "$PY" -m pytest tests/unit -q -p no:cacheprovider -k "$TESTS_K" -rs \
    --junitxml="$OUT_DIR/pytest.xml" >"$OUT_DIR/pytest.log" 2>&1
tests_rc=$?
log "tests: exit $tests_rc in $(( $(date +%s) - start )) s"
# The failures' own lines and the summary (the whole log is in pytest.log).
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$OUT_DIR/pytest.log" | tail -40
[ $tests_rc -eq 124 ] && log "tests TIMED OUT (270 s)"

# ----- benches -----
bench_rc=0
run_bench() {  # name limit_s args...
    local name=$1 limit=$2
    shift 2
    log "bench $name: $*"
    local t0=$(date +%s)
    timeout -k 10 "$limit" "$PY" "bench/$name.py" "$@" >"$OUT_DIR/bench_$name.log" 2>&1
    local rc=$?
    log "bench $name: exit $rc in $(( $(date +%s) - t0 )) s"
    tail -25 "$OUT_DIR/bench_$name.log"
    [ $rc -eq 0 ] || bench_rc=2
    tail -1 "$OUT_DIR/bench_$name.log" >"$OUT_DIR/bench_$name.json"
}
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    run_bench quant_linear 90 --device cuda
    run_bench engram_fetch 150 --device cuda
else
    log "benches skipped (GPU_CHECK_SKIP_BENCH is set)"
fi

"$PY" - "$OUT_DIR" "$tests_rc" "$bench_rc" <<'EOF'
import json, os, sys
out, tests_rc, bench_rc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
summary = {"tests_rc": tests_rc, "bench_rc": bench_rc, "benches": {}}
for name in ("quant_linear", "engram_fetch"):
    path = os.path.join(out, f"bench_{name}.json")
    if os.path.exists(path):
        try:
            summary["benches"][name] = json.loads(open(path).read() or "null")
        except json.JSONDecodeError:
            summary["benches"][name] = "no JSON last line (see the log)"
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
print("[gpu_check] summary.json:", json.dumps({"tests_rc": tests_rc, "bench_rc": bench_rc}))
EOF

if [ $tests_rc -ne 0 ]; then
    exit 1
fi
exit $bench_rc
