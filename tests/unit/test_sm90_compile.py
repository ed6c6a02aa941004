"""Every Triton kernel compiled for sm_90 (H100/H200) on this CPU machine, at the configurations the
code can choose: registers, spills, shared memory and the MMA instruction, written to
test-artifacts/sm90_kernels.json (and a markdown table beside it). Fails when a kernel on a default
path spills, or when a weight-only GEMM tile that Hopper's wgmma can serve uses mma.sync.

The compile tool (``../shared/tools/triton_sm90.py`` beside the checkout, or ``TRITON_SM90_TOOL``)
makes Triton target sm_90 for its whole process, so the compiles run in a fresh subprocess
(``sm90_compile_cases.py``), never under TRITON_INTERPRET. The same tool, pointed at sm_86 and sm_75
(one subprocess each), compiles the kernels that GPUs without FP8 units run and checks the shared
memory each asks for against what those GPUs give a block (test-artifacts/sm86_kernels.json, sm75_...). About 35 compiles; see the JSON's
``seconds`` for how long they took.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
TOOL = Path(os.environ.get("TRITON_SM90_TOOL", ROOT.parent / "shared" / "tools" / "triton_sm90.py"))
OUT = ROOT / "test-artifacts" / "sm90_kernels.json"
COLUMNS = ["kernel", "config", "regs", "spill_store_bytes", "spill_load_bytes", "smem_bytes", "wgmma",
           "mma.sync", "ld.global.v4", "ld.global.scalar", "cp.async", "div/rem int"]


def _markdown(rows) -> str:
    head = "| " + " | ".join(COLUMNS) + " |\n|" + "---|" * len(COLUMNS) + "\n"
    return head + "".join("| " + " | ".join(str(r[c]) for c in COLUMNS) + " |\n" for r in rows)


def _compile_cases(out: Path, *arch: str) -> list:
    pytest.importorskip("triton", reason="needs the triton package (ships with torch's Linux wheels)")
    if not TOOL.is_file():
        pytest.skip(f"needs the sm_90 compile tool at {TOOL} (../shared/tools beside the checkout, "
                    "or TRITON_SM90_TOOL)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("sm90_compile_cases.py")),
                           str(TOOL), str(out), *arch], cwd=str(ROOT), env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return json.loads(out.read_text())["kernels"]


@pytest.fixture(scope="module")
def compiled():
    rows = _compile_cases(OUT)
    OUT.with_suffix(".md").write_text(_markdown(rows))
    return rows


# Shared memory a block may ask for (opt-in maximum) on the GPUs without FP8 units
SMEM_LIMIT = {75: 64 << 10, 86: 99 << 10}


@pytest.fixture(scope="module", params=sorted(SMEM_LIMIT), ids=lambda a: f"sm_{a}")
def compiled_older(request):
    return request.param, _compile_cases(OUT.with_name(f"sm{request.param}_kernels.json"), str(request.param))


def test_kernels_fit_the_shared_memory_of_gpus_without_fp8_units(compiled_older):
    """RTX 30 / A10 (sm_86, 99 KiB a block; A100's 163 KiB is roomier) run the weight-only, int8 and NVFP4
    kernels; Turing (sm_75, 64 KiB) the weight-only and NVFP4 ones. A table config that asks for more
    would fail to launch on every such GPU (on sm_90 the weight-only tiles take up to 145 KiB)."""
    arch, rows = compiled_older
    turing_int8 = [r for r in rows if arch == 75 and r["kernel"].startswith("int8_mm.")]
    used = [r for r in rows if r not in turing_int8]
    assert {r["kernel"] for r in used} >= {"weight_only_gemm._wo_gemm_kernel", "weight_only_gemm._wo_gemm_small_m_kernel",
                                           "nvfp4_gemm._nvfp4_gemm_kernel"}
    broken = [f"{r['kernel']} [{r['config']}]: {r.get('error') or str(r['smem_bytes']) + ' B'}" for r in used
              if not r["compiled"] or r["smem_bytes"] > SMEM_LIMIT[arch]]
    assert not broken, f"over sm_{arch}'s {SMEM_LIMIT[arch]} B of shared memory or not compiling: " + "; ".join(broken)
    if turing_int8:
        # why int8.int8_fast leaves Turing out: the int8 GEMM does not compile for sm_75, and the rotating
        # quantizer does not fit its shared memory. If both ever work, Turing can take the int8 path.
        gemm = [r for r in turing_int8 if r["kernel"] == "int8_mm._int8_gemm_kernel"]
        quantizer = [r for r in turing_int8 if r["kernel"] == "int8_mm._quant_rows_kernel" and r["config"] == "RB=128"]
        assert not all(r["compiled"] for r in gemm) or any(r["smem_bytes"] > SMEM_LIMIT[75] for r in quantizer), \
            "the int8 kernels now compile and fit sm_75: quant/compute/int8.py int8_fast can admit Turing (7.5)"


def test_every_kernel_compiles_for_sm90(compiled):
    names = {r["kernel"] for r in compiled}
    assert names >= {"act_quant._rows_kernel", "act_quant._groups_kernel", "dequant._dequant_kernel",
                     "weight_only_gemm._wo_gemm_small_m_kernel", "weight_only_gemm._wo_gemm_kernel",
                     "weight_only_gemm._split_k_sum_kernel", "gather_triton.engram_gather_rows",
                     "int8_mm._quant_rows_kernel", "int8_mm._int8_gemm_kernel", "nvfp4_gemm._nvfp4_gemm_kernel"}
    assert all(r["regs"] for r in compiled), "a compile reported no register count"


def test_default_path_kernels_do_not_spill(compiled):
    spilling = [f"{r['kernel']} [{r['config']}]: {r['spill_store_bytes']}/{r['spill_load_bytes']} B"
                for r in compiled if r["default"] and (r["spill_store_bytes"] or r["spill_load_bytes"])]
    assert not spilling, "spills at sm_90: " + "; ".join(spilling)


def test_weight_only_tiles_use_wgmma(compiled):
    wrong = [f"{r['kernel']} [{r['config']}]: mma.sync {r['mma.sync']}, wgmma {r['wgmma']}"
             for r in compiled if r["wgmma_expected"] and (r["mma.sync"] or not r["wgmma"])]
    assert not wrong, "mma.sync where wgmma is expected: " + "; ".join(wrong)


def test_weight_and_row_loads_are_vectorized(compiled):
    """The FP8 weight streams through cp.async in every GEMM tile; the gather moves 128-bit words."""
    gemm = [r for r in compiled if r["kernel"].startswith("weight_only_gemm._wo_gemm")]
    assert gemm and all(r["cp.async"] for r in gemm)
    gather = [r for r in compiled if r["kernel"].startswith("gather_triton")]
    assert gather and all(r["ld.global.v4"] for r in gather)


def test_dequantize_reads_one_scale_per_tile_row(compiled):
    """Per-row and 128x128 / 1x64 block scales: a [BN] vector of scales per tile, not a gathered
    scale per element (that compiled to 68 scalar loads and 16 integer divisions per thread)."""
    rows = [r for r in compiled if r["kernel"] == "dequant._dequant_kernel" and r["default"]]
    assert len(rows) == 4
    heavy = [f"{r['config']}: {r['ld.global.scalar']} scalar loads, {r['div/rem int']} div/rem"
             for r in rows if r["ld.global.scalar"] > 16 or r["div/rem int"] > 8]
    assert not heavy, "; ".join(heavy)
