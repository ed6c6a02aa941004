#!/usr/bin/env bash
# The one prepared check for a machine with a CUDA GPU (run from anywhere; it works in the repo root).
#
# Needs a Python with torch (CUDA build) and pytest; no .venv, no network. Steps, each time-limited so the
# whole run ends within GPU_CHECK_BUDGET_S (default 540 s: a 15-minute device budget keeps room for the
# machine's start and one targeted rerun):
#   wheels     pip-installs every wheel in $GPU_CHECK_WHEELS (default: .whl/ in the repo root) into a temp
#              folder put first on PYTHONPATH (ComfyUI's requirements the machine lacks: README, Development)
#   env        versions, GPU, and whether ComfyUI's tree imports in-process (comfy.sd, samplers, nodes)
#   tests      the unit tests that skip without a GPU (-m cuda: 129 here; an H200 ran 68 of the older, wider -k
#              selection in 180 s; the last run of this one reached about 118 of its 129 in 180 s, hence
#              260 s, slowest 15 listed), or those -k "$GPU_CHECK_TESTS_K" picks
#   selftest   python -m fp8_engram.quant.selftest --device cuda:0 --json: every fast path proven and timed
#              on the Flux/Wan/SD3 shapes (selftest.json)
#   benches    bench/quant_linear.py --device cuda, bench/engram_fetch.py --device cuda, bench/e2e.py
#              (ComfyUI in-process on a Flux-shaped model: its tree is COMFYUI_PATH, else .host/comfyui)
# Output, at most 8 files (the device tool returns no more), in $OUT if set, else ./gpu-check-out:
#   summary.json   every step's exit status and time, and each bench's last-line JSON
#   selftest.json  the selftest's report (the device stack and every verdict with its figures)
#   gpu_check.log  what this script said
#   logs.tar.gz    every log: env.txt, nvidia-smi.txt, wheels.log, pytest.log, pytest.xml, bench_*.log
# They are rewritten after every step, so a run cut short still returns what it did.
#
# Exit status: 0 all good; 1 tests or the selftest failed; 2 tests passed but a bench failed, timed out or was skipped;
# 3 the environment lacks something the check needs (printed).
#
#   bash bench/gpu_check.sh
#   GPU_CHECK_SKIP_BENCH=1 bash bench/gpu_check.sh      # no benches (how the plumbing is tried without a GPU)
#   GPU_CHECK_E2E_ARGS=--tiny GPU_CHECK_TESTS_K=... bash bench/gpu_check.sh   # e2e on the CPU, fewer tests
#   PYTHON=/path/to/python bash bench/gpu_check.sh
# Step limits (seconds): GPU_CHECK_LIMIT_TESTS (260), GPU_CHECK_LIMIT_SELFTEST (120), GPU_CHECK_LIMIT_QUANT_LINEAR (90),
# GPU_CHECK_LIMIT_ENGRAM_FETCH (90), GPU_CHECK_LIMIT_E2E (180); each is cut to what the budget has left.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="${OUT:-$ROOT/gpu-check-out}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
TESTS_K="${GPU_CHECK_TESTS_K:-}"
if [ -n "$TESTS_K" ]; then SELECT=(-k "$TESTS_K"); else SELECT=(-m cuda); fi
WHEELS="${GPU_CHECK_WHEELS:-$ROOT/.whl}"
BUDGET="${GPU_CHECK_BUDGET_S:-540}"
COMFY_TREE="${COMFYUI_PATH:-$ROOT/.host/comfyui}"
T_START=$(date +%s)
mkdir -p "$OUT_DIR"
cd "$ROOT" || exit 3

WORK="$(mktemp -d)"  # logs live here until packed into $OUT_DIR
STEPS="$WORK/steps.tsv"
: >"$STEPS"
trap 'pack; rm -rf "$WORK"' EXIT
rm -f "$OUT_DIR/summary.json" "$OUT_DIR/gpu_check.log" "$OUT_DIR/logs.tar.gz" "$OUT_DIR/selftest.json"

# `import fp8_engram` without this checkout's .host: a temp folder holding a symlink to the repo.
mkdir -p "$WORK/pkg"
ln -s "$ROOT" "$WORK/pkg/fp8_engram"
export PYTHONPATH="$WORK/pkg${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

log() { echo "[gpu_check] $*" | tee -a "$OUT_DIR/gpu_check.log"; }
left() { echo $(( BUDGET - ($(date +%s) - T_START) )); }

# Runs a step under a time limit (capped by what is left of the budget); records "name rc seconds limit".
step() {  # name limit_s logfile command...
    local name=$1 limit=$2 logfile=$3
    shift 3
    local remain
    remain=$(left)
    [ "$limit" -gt $((remain - 5)) ] && limit=$((remain - 5))
    if [ "$limit" -lt 10 ]; then
        log "$name: SKIPPED, only ${remain} s of the ${BUDGET} s budget left"
        printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 0 >>"$STEPS"
        return 124
    fi
    log "$name (limit ${limit} s): $*"
    local t0 rc
    t0=$(date +%s)
    # SIGINT first: pytest then still writes its summary and junit file
    timeout -s INT -k 15 "$limit" "$@" >"$WORK/$logfile" 2>&1
    rc=$?
    log "$name: exit $rc in $(( $(date +%s) - t0 )) s$([ $rc -eq 124 ] && echo " (TIMED OUT at ${limit} s)")"
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" >>"$STEPS"
    pack
    return $rc
}

pack() {
    [ -d "$WORK" ] || return 0
    "$PY" - "$WORK" "$OUT_DIR" "$BUDGET" "$T_START" <<'EOF'
import json, os, sys, tarfile, time
work, out, budget, t_start = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps, benches = {}, {}
for line in open(os.path.join(work, "steps.tsv")):
    name, rc, secs, limit = line.rstrip("\n").split("\t")
    steps[name] = {"rc": rc if rc == "skipped" else int(rc), "seconds": int(secs), "limit_s": int(limit)}
for name in sorted(os.listdir(work)):
    if name.startswith("bench_") and name.endswith(".log"):
        with open(os.path.join(work, name), errors="replace") as f:
            lines = [l for l in f.read().splitlines() if l.strip()]
        try:
            benches[name[6:-4]] = json.loads(lines[-1]) if lines else None
        except json.JSONDecodeError:
            benches[name[6:-4]] = "no JSON last line (see its log in logs.tar.gz)"
tests = None
junit = os.path.join(work, "pytest.xml")
if os.path.exists(junit):
    import xml.etree.ElementTree as ET
    try:
        root = ET.parse(junit).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        tests = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        tests["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                           if c.find("failure") is not None or c.find("error") is not None][:50]
    except Exception as exc:
        tests = f"pytest.xml unreadable: {exc}"
summary = {"steps": steps, "tests": tests, "benches": benches, "elapsed_s": int(time.time()) - t_start,
           "budget_s": budget}
tmp = os.path.join(out, ".summary.json.tmp")
with open(tmp, "w") as f:
    json.dump(summary, f, indent=1)
os.replace(tmp, os.path.join(out, "summary.json"))
tmp = os.path.join(out, ".logs.tar.gz.tmp")
with tarfile.open(tmp, "w:gz") as tar:
    for name in sorted(os.listdir(work)):
        if name not in ("pkg", "site", "steps.tsv"):
            tar.add(os.path.join(work, name), arcname=name)
os.replace(tmp, os.path.join(out, "logs.tar.gz"))
EOF
}

# ----- wheels: ComfyUI requirements this machine lacks, installed into a temp folder -----
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    step wheels 120 wheels.log "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$WORK/site" "$WHEELS"/*.whl
    if [ $? -eq 0 ]; then
        export PYTHONPATH="$WORK/site:$PYTHONPATH"
        log "wheels: $(cd "$WHEELS" && ls *.whl | tr '\n' ' ')on PYTHONPATH"
    else
        log "wheels: install FAILED (see wheels.log); going on without them"
    fi
else
    log "wheels: none in $WHEELS (ComfyUI in-process needs torchsde, trampoline and av where they are missing)"
fi

# ----- environment -----
step env 60 env.txt "$PY" - "$COMFY_TREE" <<'EOF'
import importlib, os, platform, sys
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
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton MISSING", type(e).__name__)
for name in ("pytest", "safetensors", "numpy", "transformers", "torchsde", "trampoline", "av"):
    try:
        m = importlib.import_module(name)
        print(name, getattr(m, "__version__", "?"), os.path.dirname(getattr(m, "__file__", "") or ""))
    except Exception as e:
        print(name, "MISSING", type(e).__name__)
import fp8_engram.engram.buffer  # the package imports without ComfyUI
print("fp8_engram import ok")
tree = sys.argv[1]
if os.path.isfile(os.path.join(tree, "comfy", "model_management.py")):
    sys.path.insert(0, tree)
    try:
        import comfy.cli_args
        comfy.cli_args.args.cpu = not torch.cuda.is_available()  # the plumbing can be tried without a GPU
        import comfy.sd, comfy.samplers, nodes, comfy_api.latest  # what bench/e2e.py needs in-process
        import fp8_engram.nodes.fp8
        print("comfyui in-process import ok:", tree)
    except Exception as e:
        print("comfyui in-process import FAILED:", tree, type(e).__name__, e)
else:
    print("comfyui tree MISSING:", tree)
EOF
env_rc=$?
cat "$WORK/env.txt"
command -v nvidia-smi >/dev/null && nvidia-smi >"$WORK/nvidia-smi.txt" 2>&1
if [ $env_rc -ne 0 ]; then
    log "environment check failed (see env.txt): torch or the package does not import"
    exit 3
fi
if ! "$PY" -c "import pytest" 2>/dev/null; then
    log "pytest is missing from $PY; the tests cannot run"
    exit 3
fi
grep -q "available True" "$WORK/env.txt" || log "WARNING: no CUDA GPU visible: the CUDA tests will skip and the benches will fail"

# ----- tests -----
step tests "${GPU_CHECK_LIMIT_TESTS:-260}" pytest.log "$PY" -m pytest tests/unit -q -p no:cacheprovider "${SELECT[@]}" -rs --durations=15 \
    --junitxml="$WORK/pytest.xml"
tests_rc=$?
# The failures' own lines and the summary (the whole log is in logs.tar.gz).
grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed|error" "$WORK/pytest.log" | tail -40

# ----- the fast-path table (quant/selftest.py): what a user attaches to a bug report -----
step selftest "${GPU_CHECK_LIMIT_SELFTEST:-120}" selftest.log "$PY" -m fp8_engram.quant.selftest --device cuda:0 --json
selftest_rc=$?
if [ $selftest_rc -eq 0 ]; then
    sed -n '/^{/,$p' "$WORK/selftest.log" >"$OUT_DIR/selftest.json"  # the JSON (the log's warnings stay in the log)
fi

# ----- benches -----
bench_rc=0
run_bench() {  # name limit_s args...
    local name=$1 limit=$2
    shift 2
    step "bench_$name" "$limit" "bench_$name.log" "$PY" "bench/$name.py" "$@"
    local rc=$?
    tail -25 "$WORK/bench_$name.log"
    [ $rc -eq 0 ] || bench_rc=2
}
if [ -z "${GPU_CHECK_SKIP_BENCH:-}" ]; then
    run_bench quant_linear "${GPU_CHECK_LIMIT_QUANT_LINEAR:-90}" --device cuda
    run_bench engram_fetch "${GPU_CHECK_LIMIT_ENGRAM_FETCH:-90}" --device cuda
    if grep -q "comfyui in-process import ok" "$WORK/env.txt"; then
        COMFYUI_PATH="$COMFY_TREE" run_bench e2e "${GPU_CHECK_LIMIT_E2E:-180}" ${GPU_CHECK_E2E_ARGS:-}
    else
        log "bench e2e: SKIPPED: ComfyUI does not import in-process (see env.txt; README, Development: the tree and wheels)"
        bench_rc=2
    fi
else
    log "benches skipped (GPU_CHECK_SKIP_BENCH is set)"
fi

log "done in $(( $(date +%s) - T_START )) s: tests exit $tests_rc, selftest exit $selftest_rc, benches $bench_rc"
if [ $tests_rc -ne 0 ] || [ $selftest_rc -ne 0 ]; then
    exit 1
fi
exit $bench_rc
