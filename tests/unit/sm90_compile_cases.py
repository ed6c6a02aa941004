"""Compile every Triton kernel of quant/kernels and engram/gather_triton.py for sm_90 (H100/H200)
at the configurations the code can choose, without a GPU, and write one row per compile.

Not a test module (the name does not start with ``test_``): ``test_sm90_compile.py`` runs it as a
script in a fresh process without TRITON_INTERPRET, because the sm_90 tool replaces Triton's
active driver for the whole process.

    python tests/unit/sm90_compile_cases.py TOOL_PATH OUT_JSON
    python tests/unit/sm90_compile_cases.py TOOL_PATH OUT_JSON ARCH     # 75, 80 or 86: shared memory only

Each row: kernel, config, default (on a default path: must not spill), wgmma_expected (a tile
that Hopper's wgmma can serve: must not fall back to mma.sync), registers, spills, shared memory
and the PTX counts of triton_sm90.ptx_stats.

With ARCH, the tool's target is switched to that older GPU (Turing 75, A100 80, RTX 30 / A10 86: the
GPUs without FP8 units, which take the weight-only, int8 and NVFP4 kernels) and each of those kernels is
compiled at every table config with the raw-byte FP8 decoding those GPUs use; a row gives the shared
memory Triton asks for at launch (``compiled: false`` and the error where it does not compile). Registers
and spills come from ptxas for sm_90 only, so they are not reported there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("run without TRITON_INTERPRET: nothing is compiled under the interpreter")


def _load_tool(path: str):
    spec = importlib.util.spec_from_file_location("triton_sm90", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)  # makes Triton target sm_90 before anything compiles
    return tool


def _rows(tool):
    import torch

    from fp8_engram.engram import gather_triton
    from fp8_engram.quant.kernels import act_quant, dequant, weight_only_gemm as wo

    e = torch.empty
    bf16, fp8, f32 = torch.bfloat16, torch.float8_e4m3fn, torch.float32
    out = []

    def add(name, config, kernel_fn, default=True, wgmma=False):
        t0 = time.perf_counter()
        k = kernel_fn()
        res = tool.resources(k)
        stats = tool.ptx_stats(k)
        out.append({"kernel": name, "config": config, "default": default, "wgmma_expected": wgmma,
                    "regs": res["regs"], "spill_store_bytes": res["spill_store_bytes"] or 0,
                    "spill_load_bytes": res["spill_load_bytes"] or 0,
                    "smem_bytes": (res["static_smem"] or 0) + (res["dynamic_smem"] or 0),
                    "warps": res["warps"], "stages": res["stages"],
                    "wgmma": stats.get("wgmma", 0), "mma.sync": stats.get("mma.sync", 0),
                    "ld.global.v4": stats.get("ld.global.v4", 0),
                    "ld.global.v2": stats.get("ld.global.v2", 0),
                    "ld.global.scalar": stats.get("ld.global.scalar", 0),
                    "cp.async": stats.get("cp.async", 0),
                    "div/rem int": stats.get("div/rem int", 0),
                    "compile_s": round(time.perf_counter() - t0, 2)})

    # ----- activation quantization (Flux K = 3072; a long row; the per-tensor pieces) -----
    args = act_quant._kernel_args(fp8)
    for k_, mode, default in ((3072, 0, True), (20000, 0, False), (3072, 1, False), (3072, 2, False)):
        rows, block_k, one_pass, warps = act_quant._launch_shape(k_)
        x, q, s = e(64, k_, dtype=bf16), e(64, k_, dtype=fp8), e(64, dtype=f32)
        cfg = f"K={k_} MODE={mode} ROWS={rows} BLOCK_K={block_k} one_pass={one_pass} warps={warps}"
        add("act_quant._rows_kernel", cfg, lambda: act_quant._rows_kernel.warmup(
            x, q, s, 64, k_, k_, 1, k_, MODE=mode, ROWS=rows, BLOCK_K=block_k, ONE_PASS=one_pass,
            num_warps=warps, grid=(1,), **args), default)
    x, q, s = e(64, 3072, dtype=bf16), e(64, 3072, dtype=fp8), e(24, 64, dtype=f32).t()
    add("act_quant._groups_kernel", "K=3072 ROWS=32 GROUP=128 warps=4",
        lambda: act_quant._groups_kernel.warmup(x, q, s, 64, 3072, 3072, 1, 3072, 1, 64, ROWS=32,
                                                GROUP_=128, num_warps=4, grid=(1,), **args))

    # ----- dequantization into bf16, each tile class -----
    n_, k_ = 3072, 3072
    qw, o = e(n_, k_, dtype=fp8), e(n_, k_, dtype=bf16)
    for label, per_tensor, block in (("per-tensor", True, None), ("per-row", False, (1, k_)),
                                     ("block 128x128", False, (128, 128)),
                                     ("block 1x64", False, (1, 64)), ("block 48x80", False, (48, 80))):
        bn, bk, mode = dequant.tile_for(per_tensor, block, k_)
        r, c = (1, 1) if per_tensor else block
        sc = e(-(-n_ // r), -(-k_ // c), dtype=f32)
        add("dequant._dequant_kernel", f"{label}: BN={bn} BK={bk} SCALES={mode}",
            lambda: dequant._dequant_kernel.warmup(
                qw, sc, o, n_, k_, k_, 1, k_, sc.stride(0), sc.stride(1), r, c, BN=bn, BK=bk,
                SCALES=mode, NATIVE=True, E5M2=False, EXACT=False, num_warps=4, grid=(1,)),
            default=label != "block 48x80")

    # ----- weight-only GEMM: every table entry, per-row and 128x128 block scales -----
    flags = dict(NATIVE=True, E5M2=False, UPCAST=False)
    for bm, cfg in wo.SMALL_M_CONFIGS.items():
        for scales, c in ((1, 1 << 20), (2, 128)):
            x, p = e(bm, k_, dtype=bf16), e(4, bm, n_, dtype=f32)
            sc = e(n_, dtype=f32) if scales == 1 else e(n_ // 128, k_ // 128, dtype=f32)
            ssn, ssc = (1, 0) if scales == 1 else (k_ // 128, 1)
            add("weight_only_gemm._wo_gemm_small_m_kernel",
                f"M<={bm} BN={cfg['BN']} BM={bm} BK={cfg['BK']} warps={cfg['num_warps']} "
                f"stages={cfg['num_stages']} {'per-row' if scales == 1 else 'block 128x128'}",
                lambda: wo._wo_gemm_small_m_kernel.warmup(
                    x, qw, sc, p, bm, n_, k_, 768, k_, 1, k_, 1, ssn, ssc, 1 if scales == 1 else 128,
                    c, SCALES=scales, EVEN_K=True, BN=cfg["BN"], BM=bm, BK=cfg["BK"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(1,), **flags),
                wgmma=True)
    add("weight_only_gemm._split_k_sum_kernel", "BLOCK=1024 warps=4",
        lambda: wo._split_k_sum_kernel.warmup(e(4, 16, n_, dtype=f32), e(n_, dtype=bf16),
                                              e(16, n_, dtype=bf16), 16, n_, n_, SPLIT=4,
                                              HAS_BIAS=True, EXACT=False, BLOCK=1024, num_warps=4,
                                              grid=(1,)))
    m_ = 4096
    for cls, cfg in wo.TILE_CONFIGS.items():
        for scales in ((2,) if cls == "large_block" else (1, 2) if cls != "large" else (1,)):
            x, y = e(m_, k_, dtype=bf16), e(m_, n_, dtype=bf16)
            sc = e(n_, dtype=f32) if scales == 1 else e(n_ // 128, k_ // 128, dtype=f32)
            ssn, ssc = (1, 0) if scales == 1 else (k_ // 128, 1)
            add("weight_only_gemm._wo_gemm_kernel",
                f"class {cls}: BM={cfg['BM']} BN={cfg['BN']} BK={cfg['BK']} warps={cfg['num_warps']} "
                f"stages={cfg['num_stages']} {'per-row' if scales == 1 else 'block 128x128'}",
                lambda: wo._wo_gemm_kernel.warmup(
                    x, qw, sc, e(n_, dtype=bf16), y, m_, n_, k_, k_, 1, k_, 1, n_, ssn, ssc,
                    1 if scales == 1 else 128, 1 << 20 if scales == 1 else 128, HAS_BIAS=True,
                    SCALES=scales, EVEN_K=True, EXACT=False, **flags, **cfg, grid=(1,)),
                wgmma=cfg["BM"] >= 64)

    # ----- the int8 GEMM (BM by token count, as _int8_linear_triton picks) and the NVFP4 GEMM (its table) -----
    from fp8_engram.quant.kernels import int8_mm, nvfp4_gemm

    i8 = torch.int8
    for bm in (128, 64, 16):
        add("int8_mm._int8_gemm_kernel", f"BM={bm} BN=128 BK=128 warps={8 if bm == 128 else 4} stages=3",
            lambda: int8_mm._int8_gemm_kernel.warmup(
                e(m_, k_, dtype=i8), e(n_, k_, dtype=i8), e(m_, dtype=f32), e(n_, dtype=f32),
                e(n_, dtype=bf16), e(m_, n_, dtype=bf16), m_, n_, k_, k_, 1, k_, 1, n_, 1, BM=bm, BN=128,
                BK=128, GROUP_M=8, HAS_BIAS=True, num_warps=8 if bm == 128 else 4, num_stages=3, grid=(1,)),
            wgmma=bm >= 64)
    # the int8 path's activation quantizer at every rotation block and dtype int8_mm.kernel_quantizes
    # sends it (bf16/fp16; no rotation, or a block of 16..128; wider, narrower and float32 go to torch)
    for rb, x_dtype in ((128, bf16), (64, bf16), (16, torch.float16), (0, bf16)):
        assert int8_mm.kernel_quantizes(x_dtype, rb)
        add("int8_mm._quant_rows_kernel", f"BM=16 RB={rb or 128} {'rotated' if rb else 'plain'} {str(x_dtype).split('.')[-1]} warps=8 stages=1",
            lambda: int8_mm._quant_rows_kernel.warmup(
                e(m_, k_, dtype=x_dtype), e(rb or 128, rb or 128, dtype=x_dtype), e(m_, k_, dtype=i8), e(m_, 1, dtype=f32),
                m_, k_, k_, 1, float((rb or 128) ** -0.5), BM=16, RB=rb or 128, ROT=bool(rb), F32_DOT=False,
                num_warps=8, num_stages=1, grid=(1,)))
    for m_tokens in (16, 128, 4096):
        cfg = nvfp4_gemm.table_config(m_tokens)
        add("nvfp4_gemm._nvfp4_gemm_kernel",
            f"M<={m_tokens}: BM={cfg['BM']} BN={cfg['BN']} BK={cfg['BK']} warps={cfg['num_warps']}",
            lambda: nvfp4_gemm._nvfp4_gemm_kernel.warmup(
                e(m_, k_, dtype=bf16), e(n_, k_ // 2, dtype=torch.uint8), e(n_, k_ // 16, dtype=torch.uint8),
                e(n_, dtype=bf16), e(m_, n_, dtype=bf16), 1.0, m_, n_, k_, k_, k_, 1, k_ // 2, k_ // 16, n_,
                HAS_BIAS=True, OUT_BF16=True, UPCAST=False, EXACT=False, **cfg, grid=(1,)),
            wgmma=cfg["BM"] >= 64)

    # ----- the engram gather (FP8 rows with scale packs; bf16 rows), as fetch launches it -----
    fn = gather_triton._compiled()
    for hidden, packs in ((7168, 14), (1024, 0)):
        row_words = hidden // 4 if packs else hidden // 2
        block_r, block_c, block_p = gather_triton.block_sizes(row_words, packs)
        i32, i64 = torch.int32, torch.int64
        add("gather_triton.engram_gather_rows",
            f"row_words={row_words} sf_words={packs} BLOCK_R={block_r} BLOCK_C={block_c} warps=8",
            lambda: fn.warmup(e(1, 4096, dtype=i32), 4096, e(1024, dtype=i32), e(4, dtype=i64),
                              e(1, 3, dtype=i64), e(4096, row_words, dtype=i32), 4096 * row_words,
                              e(4096, 16, dtype=i32), 0, 16, 1, 4096, 4, 16, ROW_WORDS=row_words,
                              SF_WORDS=max(1, packs), BLOCK_R=block_r, BLOCK_C=block_c,
                              BLOCK_P=block_p, HAS_SF=packs > 0, EVEN_C=row_words % block_c == 0,
                              num_warps=8, grid=(1,)))
    return out


def _arch_rows(arch: int):
    import torch

    from fp8_engram.quant.kernels import int8_mm, nvfp4_gemm, weight_only_gemm as wo

    e = torch.empty
    f16, f32, u8, i8 = torch.float16, torch.float32, torch.uint8, torch.int8
    n_, k_, m_ = 3072, 3072, 4096
    qw = e(n_, k_, dtype=u8)  # no FP8 types before capability 8.9: the kernels decode bytes
    flags = dict(NATIVE=False, E5M2=False, UPCAST=False)
    out = []

    def add(name, config, kernel_fn):
        row = {"kernel": name, "config": config, "arch": arch}
        try:
            row.update(compiled=True, smem_bytes=kernel_fn().metadata.shared)
        except Exception as exc:  # noqa: BLE001 - a kernel that does not compile for this GPU is the finding
            row.update(compiled=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        out.append(row)

    for bm, cfg in wo.SMALL_M_CONFIGS.items():
        for scales in (1, 2):
            sc = e(n_, dtype=f32) if scales == 1 else e(n_ // 128, k_ // 128, dtype=f32)
            ssn, ssc = (1, 0) if scales == 1 else (k_ // 128, 1)
            add("weight_only_gemm._wo_gemm_small_m_kernel", f"M<={bm} scales={scales}",
                lambda: wo._wo_gemm_small_m_kernel.warmup(
                    e(bm, k_, dtype=f16), qw, sc, e(4, bm, n_, dtype=f32), bm, n_, k_, 768, k_, 1, k_, 1, ssn, ssc,
                    1 if scales == 1 else 128, 1 << 20 if scales == 1 else 128, SCALES=scales, EVEN_K=True, BN=cfg["BN"],
                    BM=bm, BK=cfg["BK"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], grid=(1,), **flags))
    for cls, cfg in wo.TILE_CONFIGS.items():
        scales = 2 if cls == "large_block" else 1
        sc = e(n_, dtype=f32) if scales == 1 else e(n_ // 128, k_ // 128, dtype=f32)
        ssn, ssc = (1, 0) if scales == 1 else (k_ // 128, 1)
        add("weight_only_gemm._wo_gemm_kernel", f"class {cls}",
            lambda: wo._wo_gemm_kernel.warmup(
                e(m_, k_, dtype=f16), qw, sc, e(n_, dtype=f16), e(m_, n_, dtype=f16), m_, n_, k_, k_, 1, k_, 1, n_, ssn,
                ssc, 1 if scales == 1 else 128, 1 << 20 if scales == 1 else 128, HAS_BIAS=True, SCALES=scales,
                EVEN_K=True, EXACT=False, **flags, **cfg, grid=(1,)))
    for bm in (128, 64, 16):
        add("int8_mm._int8_gemm_kernel", f"BM={bm}",
            lambda: int8_mm._int8_gemm_kernel.warmup(
                e(m_, k_, dtype=i8), e(n_, k_, dtype=i8), e(m_, dtype=f32), e(n_, dtype=f32), e(n_, dtype=f16),
                e(m_, n_, dtype=f16), m_, n_, k_, k_, 1, k_, 1, n_, 1, BM=bm, BN=128, BK=128, GROUP_M=8, HAS_BIAS=True,
                num_warps=8 if bm == 128 else 4, num_stages=3, grid=(1,)))
    for rb in (128, 64, 16, 0):
        add("int8_mm._quant_rows_kernel", f"RB={rb}",
            lambda: int8_mm._quant_rows_kernel.warmup(
                e(m_, k_, dtype=f16), e(rb or 128, rb or 128, dtype=f16), e(m_, k_, dtype=i8), e(m_, 1, dtype=f32), m_,
                k_, k_, 1, 0.1, BM=16, RB=rb or 128, ROT=bool(rb), F32_DOT=False, num_warps=8, num_stages=1,
                grid=(1,)))
    for m_tokens in (16, 128, 4096):
        cfg = nvfp4_gemm.table_config(m_tokens)
        add("nvfp4_gemm._nvfp4_gemm_kernel", f"M<={m_tokens}",
            lambda: nvfp4_gemm._nvfp4_gemm_kernel.warmup(
                e(m_, k_, dtype=f16), e(n_, k_ // 2, dtype=u8), e(n_, k_ // 16, dtype=u8), e(n_, dtype=f16),
                e(m_, n_, dtype=f16), 1.0, m_, n_, k_, k_, k_, 1, k_ // 2, k_ // 16, n_, HAS_BIAS=True, OUT_BF16=False,
                UPCAST=False, EXACT=False, **cfg, grid=(1,)))
    return out


def main(argv):
    tool_path, out_path = argv[:2]
    tool = _load_tool(tool_path)
    t0 = time.perf_counter()
    # the output folder may not exist yet: a test run alone in a fresh clone is the first to write there
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    if len(argv) > 2:
        from triton.backends.compiler import GPUTarget

        arch = int(argv[2])
        tool.TARGET = GPUTarget("cuda", arch, 32)  # what the tool's driver reports from now on
        rows = _arch_rows(arch)
        with open(out_path + ".tmp", "w") as f:
            json.dump({"target": f"sm_{arch}", "seconds": round(time.perf_counter() - t0, 1), "kernels": rows}, f, indent=1)
        os.replace(out_path + ".tmp", out_path)
        print(f"compiled {len(rows)} kernels for sm_{arch} in {time.perf_counter() - t0:.1f} s -> {out_path}")
        return
    rows = _rows(tool)
    tmp = out_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"target": "sm_90", "seconds": round(time.perf_counter() - t0, 1), "kernels": rows},
                  f, indent=1)
    os.replace(tmp, out_path)
    print(f"compiled {len(rows)} kernels for sm_90 in {time.perf_counter() - t0:.1f} s -> {out_path}")


if __name__ == "__main__":
    main(sys.argv[1:])
