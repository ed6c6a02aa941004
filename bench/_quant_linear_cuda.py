"""The CUDA half of bench/quant_linear.py (run that script with ``--device cuda``)."""

from __future__ import annotations

import copy
import importlib
import json
import statistics

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8_engram.quant import Block, ComputeConfig, PerRow, PerTensor, QuantizedTensor, kernels
from fp8_engram.quant.kernels import weight_only_gemm
from fp8_engram.quant.quantize_model import sqnr_db


sm = importlib.import_module("fp8_engram.quant.compute.scaled_mm")
fp8_path = importlib.import_module("fp8_engram.quant.compute.paths.fp8")

SHAPES = [  # (name, tokens, in, out)
    ("flux-qkv", 4608, 3072, 9216),
    ("flux-proj", 4608, 3072, 3072),
    ("flux-mlp-up", 4608, 3072, 12288),
    ("flux-mlp-down", 4608, 12288, 3072),
    ("flux-mlp-up", 1024, 3072, 12288),
    ("flux-mlp-up", 256, 3072, 12288),
    ("flux-modulation", 1, 3072, 18432),
    ("flux-modulation", 16, 3072, 18432),
    ("wan-ffn-up", 16384, 5120, 13824),
    ("wan-ffn-down", 16384, 13824, 5120),
]
QUICK_SHAPES = [("small", 256, 1024, 2048), ("small", 1024, 1024, 4096)]


def _sqnr(ref, y) -> float:
    return round(sqnr_db(ref, y), 2)


def time_cuda(fns: dict, rounds: int, inner: int) -> dict:
    """Median over interleaved rounds of the mean per-call time (ms), CUDA events."""
    for fn in fns.values():  # warm up (compiles, autotunes)
        fn()
        fn()
    torch.cuda.synchronize()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _comfy_kitchen():
    try:
        from comfy_kitchen.tensor import QuantizedTensor as CKQuantizedTensor, TensorCoreFP8Layout
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"[:120]
    return (CKQuantizedTensor, TensorCoreFP8Layout), None


def _torchao_linear(w, b):
    try:
        from torchao.quantization import (Float8DynamicActivationFloat8WeightConfig, PerRow,
                                          quantize_)
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"[:120]
    m = nn.Linear(w.shape[1], w.shape[0], bias=True, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    quantize_(m, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))
    return m, None


def bench_shape(name, tokens, in_f, out_f, rounds, inner, notes):
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = (torch.randn(out_f, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    x = torch.randn(tokens, in_f, device="cuda", generator=g).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, PerTensor(), input_scale=(x.float().abs().amax() / 448).cpu())
    auto = qt.with_config(ComputeConfig())
    static = qt.with_config(ComputeConfig(activation_scaling="static"))
    dyn_t = qt.with_config(ComputeConfig(activation_scaling="dynamic_tensor"))
    wo = qt.with_config(ComputeConfig(path="weight_only"))
    api = sm.scaled_mm_api(x.device)
    xq, sa = kernels.quantize_rows(x)
    sb = fp8_path.row_weight_scale(qt)
    fns = {
        "bf16 F.linear": lambda: F.linear(x, w, b),
        "scaled_mm floor": lambda: sm.SCALED_MM_APIS[api](xq, qt.qdata.t(), sa, sb, b,
                                                            torch.bfloat16),
        "ours auto": lambda: F.linear(x, auto, b),
        "ours static": lambda: F.linear(x, static, b),
        "ours dyn tensor": lambda: F.linear(x, dyn_t, b),
        "ours weight-only": lambda: F.linear(x, wo, b),
        "wo fused": lambda: kernels.weight_only_linear(x, qt.qdata, qt.scale, None, True, b, "fused"),
        "wo dequant+cuBLAS": lambda: kernels.weight_only_linear(x, qt.qdata, qt.scale, None, True,
                                                                b, "dequant"),
    }
    if (name, tokens) == ("flux-mlp-up", 4608):
        # block-wise weights: fp8 with block scaling where torch has it, and forced weight-only
        for label, layout in (("block128", Block(128, 128)), ("block1x64", Block(1, 64))):
            qb = QuantizedTensor.from_float(w, layout)
            fns[f"ours {label} auto"] = (lambda q: lambda: F.linear(x, q, b))(qb)
            qwo = qb.with_config(ComputeConfig(path="weight_only"))
            fns[f"ours {label} w-only"] = (lambda q: lambda: F.linear(x, q, b))(qwo)
    ck, why = _comfy_kitchen()
    if ck is not None:
        try:
            ckw = ck[0].from_float(w, ck[1])
            F.linear(x, ckw, b)
            fns["comfy_kitchen"] = lambda: F.linear(x, ckw, b)
        except Exception as exc:  # noqa: BLE001
            notes.setdefault("comfy_kitchen", f"failed: {type(exc).__name__}: {exc}"[:160])
    else:
        notes.setdefault("comfy_kitchen", f"absent ({why})")
    tao, why = _torchao_linear(w, b)
    if tao is not None:
        fns["torchao float8 dyn"] = lambda: tao(x)
    else:
        notes.setdefault("torchao", f"absent ({why})")
    with torch.inference_mode():
        times = time_cuda(fns, rounds, inner)
        rows = min(tokens, 512)
        ref = F.linear(x[:rows].double(), w.double(), b.double())
        sq = {}
        for v, fn in fns.items():
            if v == "scaled_mm floor":
                continue
            out = fn()
            sq[v] = _sqnr(ref, out[:rows])
    base = times["bf16 F.linear"]
    print(f"\n{name} {tokens} x {in_f} -> {out_f}   (median ms per call; speedup = bf16 / variant)")
    print(f"  {'variant':20s} {'ms':>8s} {'time/bf16':>9s} {'speedup':>8s} {'SQNR dB':>8s}")
    for v, t in times.items():
        print(f"  {v:20s} {t:8.3f} {t / base:9.3f} {base / t:8.3f} {sq.get(v, float('nan')):8.2f}")
    row = {"shape": name, "tokens": tokens, "in": in_f, "out": out_f,
           "ms": {v: round(t, 4) for v, t in times.items()},
           "speedup": {v: round(base / t, 3) for v, t in times.items()},
           "sqnr_db": sq}
    row["auto_vs_floor_time"] = round(times["ours auto"] / times["scaled_mm floor"], 3)
    return row


def bench_weight_only_table(rounds, inner, quick):
    """The weight-only GEMM's fixed table against its candidates, and the crossover to
    dequantize + cuBLAS (kernels.FUSED_WEIGHT_ONLY_MAX_M) measured on both sides. Per-row
    weights (the fused kernel's common case), x bf16."""
    in_f, out_f = (1024, 4096) if quick else (3072, 12288)
    token_counts = [1, 16, 64, 256, 1024] if quick else [1, 16, 32, 64, 128, 256, 512, 1024, 2048]
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(out_f, in_f, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    qt = QuantizedTensor.from_float(w, PerRow())
    rows, crossover = [], None
    print(f"\nweight-only GEMM table, {in_f} -> {out_f}, per-row FP8 (ms; fused = the table's config)")
    for m in token_counts:
        x = torch.randn(m, in_f, device="cuda", generator=g).to(torch.bfloat16)
        block = (1, in_f)
        fns = {"bf16 F.linear": lambda: F.linear(x, w),
               "fused table": lambda: kernels.weight_only_linear(x, qt.qdata, qt.scale, block, False,
                                                                 None, "fused"),
               "dequant+cuBLAS": lambda: kernels.weight_only_linear(x, qt.qdata, qt.scale, block,
                                                                    False, None, "dequant")}
        table = weight_only_gemm.config_for(m)
        pool = [dict(c, small=True, BM=table["BM"]) if table.get("small") else c
                for c in weight_only_gemm.CANDIDATES]
        for i, cfg in enumerate(pool):
            fns[f"candidate {i}"] = (lambda c: lambda: weight_only_gemm.weight_only_linear_triton(
                x, qt.qdata, qt.scale, None, False, config=c))(cfg)
        with torch.inference_mode():
            times = time_cuda(fns, rounds, inner)
        best = min((t, name) for name, t in times.items() if name.startswith("candidate"))
        fused_wins = times["fused table"] <= times["dequant+cuBLAS"]
        if fused_wins:
            crossover = m
        rows.append({"tokens": m, "ms": {k: round(v, 4) for k, v in times.items()},
                     "table": {k: v for k, v in table.items()},
                     "best_candidate_vs_table": round(best[0] / times["fused table"], 3),
                     "fused_faster_than_dequant": fused_wins})
        print(f"  M={m:5d} bf16 {times['bf16 F.linear']:.4f}  fused {times['fused table']:.4f}  "
              f"dequant+cuBLAS {times['dequant+cuBLAS']:.4f}  best candidate/table "
              f"{best[0] / times['fused table']:.3f} ({best[1]})")
    print(f"  measured crossover: fused fastest up to M={crossover} "
          f"(FUSED_WEIGHT_ONLY_MAX_M = {kernels.FUSED_WEIGHT_ONLY_MAX_M})")
    return {"in": in_f, "out": out_f, "rows": rows, "measured_crossover_m": crossover,
            "fused_weight_only_max_m": kernels.FUSED_WEIGHT_ONLY_MAX_M}


class FluxDoubleBlock(nn.Module):
    """A Flux.1-sized double-stream block: per stream modulation, LayerNorm, qkv, RMSNorm on q/k,
    joint attention over text + image tokens, output projection, GELU MLP."""

    def __init__(self, hidden=3072, heads=24, mlp_ratio=4, device="cuda", dtype=torch.bfloat16):
        super().__init__()
        self.heads = heads
        kw = dict(device=device, dtype=dtype)
        for s in ("img", "txt"):
            setattr(self, f"{s}_mod", nn.Linear(hidden, 6 * hidden, **kw))
            setattr(self, f"{s}_qkv", nn.Linear(hidden, 3 * hidden, **kw))
            setattr(self, f"{s}_proj", nn.Linear(hidden, hidden, **kw))
            setattr(self, f"{s}_mlp0", nn.Linear(hidden, mlp_ratio * hidden, **kw))
            setattr(self, f"{s}_mlp2", nn.Linear(mlp_ratio * hidden, hidden, **kw))
            setattr(self, f"{s}_qn", nn.Parameter(torch.ones(hidden // heads, **kw)))
            setattr(self, f"{s}_kn", nn.Parameter(torch.ones(hidden // heads, **kw)))
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.02)

    def _pre(self, s, x, vec):
        mod = getattr(self, f"{s}_mod")(F.silu(vec))[:, None].chunk(6, dim=-1)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + mod[1]) + mod[0]
        qkv = getattr(self, f"{s}_qkv")(h)
        b, n, _ = qkv.shape
        q, k, v = qkv.view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        q = F.rms_norm(q, q.shape[-1:], getattr(self, f"{s}_qn"))
        k = F.rms_norm(k, k.shape[-1:], getattr(self, f"{s}_kn"))
        return q, k, v, mod

    def _post(self, s, x, attn, mod):
        x = x + mod[2] * getattr(self, f"{s}_proj")(attn)
        h = F.layer_norm(x, x.shape[-1:]) * (1 + mod[4]) + mod[3]
        return x + mod[5] * getattr(self, f"{s}_mlp2")(F.gelu(getattr(self, f"{s}_mlp0")(h),
                                                               approximate="tanh"))

    def forward(self, img, txt, vec):
        qi, ki, vi, mi = self._pre("img", img, vec)
        qt, kt, vt, mt = self._pre("txt", txt, vec)
        q, k, v = (torch.cat(p, dim=2) for p in ((qt, qi), (kt, ki), (vt, vi)))
        a = F.scaled_dot_product_attention(q, k, v)
        a = a.transpose(1, 2).reshape(img.shape[0], -1, img.shape[-1])
        nt = txt.shape[1]
        return self._post("img", img, a[:, nt:], mi), self._post("txt", txt, a[:, :nt], mt)


def _to_fp8(block: nn.Module, config: ComputeConfig) -> nn.Module:
    fp8 = copy.deepcopy(block)
    for mod in fp8.modules():
        if isinstance(mod, nn.Linear):
            qt = QuantizedTensor.from_float(mod.weight.detach(), PerTensor(), config=config)
            mod.weight = nn.Parameter(qt, requires_grad=False)
    return fp8


def bench_block(rounds, inner, quick):
    img_tokens, txt_tokens = (256, 64) if quick else (4096, 512)
    g = torch.Generator(device="cuda").manual_seed(1)
    block = FluxDoubleBlock(hidden=1024 if quick else 3072, heads=8 if quick else 24)
    hid = block.img_qkv.in_features
    img = torch.randn(1, img_tokens, hid, device="cuda", generator=g).to(torch.bfloat16)
    txt = torch.randn(1, txt_tokens, hid, device="cuda", generator=g).to(torch.bfloat16)
    vec = torch.randn(1, hid, device="cuda", generator=g).to(torch.bfloat16)
    fp8 = _to_fp8(block, ComputeConfig())
    wo = _to_fp8(block, ComputeConfig(path="weight_only"))
    fns = {"bf16 block": lambda: block(img, txt, vec), "ours fp8 auto block": lambda: fp8(img, txt, vec),
           "ours weight-only block": lambda: wo(img, txt, vec)}
    with torch.inference_mode():
        times = time_cuda(fns, rounds, inner)
        ref = block.double()(img.double(), txt.double(), vec.double())[0]
        block.to(torch.bfloat16)
        sq = {"bf16 block": _sqnr(ref, block(img, txt, vec)[0]),
              "ours fp8 auto block": _sqnr(ref, fp8(img, txt, vec)[0]),
              "ours weight-only block": _sqnr(ref, wo(img, txt, vec)[0])}
    base = times["bf16 block"]
    print(f"\nFlux double block ({img_tokens} image + {txt_tokens} text tokens, hidden {hid}); "
          f"ms per call, speedup = bf16 / variant; SQNR of the image stream vs float64")
    for v, t in times.items():
        print(f"  {v:24s} {t:8.3f} ms  speedup {base / t:6.3f}  SQNR {sq[v]:6.2f} dB")
    return {"img_tokens": img_tokens, "txt_tokens": txt_tokens, "hidden": hid,
            "ms": {v: round(t, 3) for v, t in times.items()},
            "speedup": {v: round(base / t, 3) for v, t in times.items()}, "sqnr_db": sq}


def main_cuda(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    rounds = args.repeats or 8
    inner = 4
    cap = torch.cuda.get_device_capability()
    print(f"device={torch.cuda.get_device_name()} capability={cap} torch={torch.__version__} "
          f"triton={'yes' if kernels.HAS_TRITON else 'no'} rounds={rounds} inner={inner} "
          f"scaled_mm_api={sm.scaled_mm_api(torch.device('cuda'))} "
          f"blockwise={sm.blockwise_supported(torch.device('cuda'))} "
          f"fused_weight_only_max_m={kernels.FUSED_WEIGHT_ONLY_MAX_M}")
    print("statistic: median over interleaved rounds of the mean time per call (CUDA events); "
          "speedup = bf16 time / variant time (above 1 is faster)")
    notes: dict = {}
    cases = []
    for shape in (QUICK_SHAPES if args.quick else SHAPES):
        if args.only and args.only not in shape[0]:
            continue
        cases.append(bench_shape(*shape, rounds, inner, notes))
        torch.cuda.empty_cache()
    block = bench_block(rounds, 3, args.quick)
    wo_table = bench_weight_only_table(max(3, rounds // 2), inner, args.quick)
    print("\nspeedups over bf16 (auto / static / weight-only / comfy_kitchen): " + "; ".join(
        f"{c['shape']}@{c['tokens']}: {c['speedup']['ours auto']}/{c['speedup']['ours static']}/"
        f"{c['speedup']['ours weight-only']}/{c['speedup'].get('comfy_kitchen', '-')}" for c in cases))
    for k, v in notes.items():
        print(f"note: {k}: {v}")
    print(json.dumps({"bench": "quant_linear", "device": "cuda", "gpu": torch.cuda.get_device_name(),
                      "capability": list(cap), "torch": torch.__version__,
                      "statistic": "median of per-call mean over interleaved rounds (CUDA events); "
                                   "speedup = bf16 / variant",
                      "rounds": rounds, "notes": notes, "cases": cases, "flux_double_block": block,
                      "weight_only_table": wo_table}))
