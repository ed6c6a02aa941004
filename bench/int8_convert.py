"""The CPU conversion of an FP8 weight to int8 (``quant/compute/int8.py`` ``to_int8``, what "auto" pays at a
layer's first int8 call): time and peak memory, for this checkout and optionally another one side by side.

Per tree and shape (Flux's 3072x12288 and 12288x3072 by default; per-tensor e4m3fn weights with random
values), one fresh subprocess: the FP8 weight is made, then converted ``--repeats`` times; reported are the
best wall and CPU time of a conversion (CPU time is less swayed by other processes on a shared machine)
and the peak RSS the first conversion added (ru_maxrss after it minus the RSS before it) as a multiple of
the FP8 weight's bytes (the int8 result alone is 1.0x). The subprocesses of the trees alternate, so a
``--before`` tree (e.g. ``git worktree``/``git archive`` of an older commit, with its own .host/pkg link)
is measured in the same run and load as this one; the ratios are after/before.

    .venv/bin/python bench/int8_convert.py [--before DIR] [--shapes 3072x12288,12288x3072] [--repeats 3]
        [--threads N]
    .venv/bin/python bench/int8_convert.py --rotations [--threads 1]

--rotations times, instead, only the block rotation of one conversion chunk (1 MiB of float32 rows) over a
3072x12288 weight's worth of elements, in three forms: the dense ``[rows*k/b, b] @ H_b`` matmul the
conversion uses, the Kronecker-factored one (``H_b = H_a kron H_c``: a GEMM with H_c along the last axis,
then H_a applied across it as a batched matmul: a + c multiply-adds an element instead of b), and the radix-2
butterfly (log2(b) passes of adds and subtracts), each with its relative error against float64. Sylvester
128 (what to_int8 uses) and the regular 256 of ComfyUI's ConvRot files (a Kronecker power of the 4x4, so
the same factored form applies with factors that are powers of 4).

Prints one line per tree and shape and, as the last line, one JSON object {"bench": "int8_convert", ...}.

Measured (2-core Sapphire Rapids, load average ~0.6, --before = the commit before the chunked conversion):
2 threads: 3072x12288 0.100 s vs 0.289 s (0.35x), 12288x3072 0.107 s vs 0.301 s (0.36x), peak RSS added
3.2x the FP8 weight vs 15.0x; 1 thread: 0.156 vs 0.456 s (0.34x), 0.173 vs 0.436 s (0.40x), 1.07x vs 15.0x.
--rotations (1 thread, 37.7 M elements): Sylvester 128 dense 0.076 s, factored 0.071 s, butterfly 0.296 s;
regular 256 dense 0.130 s, factored 0.050 s (relative errors 0.8-3e-7): the conversion factors from 256 up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def reset_peak() -> None:
    """Linux: VmHWM (the peak RSS) starts again from the current RSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(tree: str, n: int, k: int, repeats: int, threads: int) -> None:
    sys.path.insert(0, str(Path(tree) / ".host" / "pkg"))
    import torch

    from fp8_engram.quant import PerTensor, QuantizedTensor
    from fp8_engram.quant.compute.int8 import conversion_sqnr_db, to_int8

    if threads:
        torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    w = QuantizedTensor.from_float(torch.randn(n, k, generator=g) / k ** 0.5, PerTensor())
    to_int8(QuantizedTensor.from_float(torch.randn(8, k, generator=g), PerTensor()))  # tables, matrices, imports
    reset_peak()  # making the weight peaked higher than any conversion
    before = rss_bytes()
    wall, cpu, first_peak = [], [], None
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        w8 = to_int8(w)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        if first_peak is None:
            first_peak = rss_bytes("VmHWM") - before
        del w8
    w8 = to_int8(w)
    print(json.dumps({"tree": tree, "shape": [n, k], "wall_s": min(wall), "cpu_s": min(cpu),
                      "peak_added_x_fp8": first_peak / w.qdata.numel(), "sqnr_db": conversion_sqnr_db(w, w8),
                      "threads": torch.get_num_threads()}))


def rotations(threads: int) -> None:
    sys.path.insert(0, str(ROOT / ".host" / "pkg"))
    import torch

    from fp8_engram.quant.layouts.int8 import hadamard

    torch.set_num_threads(threads or torch.get_num_threads())
    chunk, total = 1 << 18, 3072 * 12288
    x = torch.randn(chunk, generator=torch.Generator().manual_seed(0))
    out = {}
    for b, regular, (fa, fc) in ((128, False, (16, 8)), (256, True, (16, 16))):
        h, ha, hc = hadamard(b, regular), hadamard(fa, regular), hadamard(fc, regular)

        def dense(v):
            return torch.matmul(v.view(-1, b), h.T)

        def factored(v):
            y = torch.matmul(v.view(-1, fc), hc.T).view(-1, fa, fc)
            return torch.matmul(ha, y).view(-1, b)  # (H_a kron H_c) v = H_a . V . H_c^T per block

        def butterfly(v):  # Sylvester's recursion; for the regular matrix only as a flop-count reference
            y = v.view(-1, b).clone()
            half = b // 2
            while half >= 1:
                pair = y.view(y.shape[0], -1, 2, half)
                lo, hi = pair[:, :, 0], pair[:, :, 1]
                s_ = lo + hi
                hi.sub_(lo).neg_()
                lo.copy_(s_)
                half //= 2
            return y.mul_(b ** -0.5)

        ref = torch.matmul(x.double().view(-1, b), h.double().T)
        for name, fn in (("dense", dense), ("factored", factored)) + ((("butterfly", butterfly),) if not regular else ()):
            err = float((fn(x).double() - ref).norm() / ref.norm())
            best = 1e9
            for _ in range(3):
                c0 = time.process_time()
                for _ in range(total // chunk):
                    fn(x)
                best = min(best, time.process_time() - c0)
            out[f"{'regular' if regular else 'sylvester'}{b}_{name}"] = {"cpu_s": round(best, 4), "rel_err": err}
            print(f"{'regular' if regular else 'Sylvester'} {b:>3} {name:<10} cpu {best:.3f} s for {total} elements"
                  f"  relative error vs float64 {err:.1e}  ({torch.get_num_threads()} threads)")
    print(json.dumps({"bench": "int8_convert_rotations", "threads": torch.get_num_threads(), "results": out}))


def run_child(tree: str, n: int, k: int, repeats: int, threads: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", tree, str(n), str(k), str(repeats), str(threads)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"child for {tree} {n}x{k} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="another checkout of the pack to measure in the same run (its .host/pkg link)")
    p.add_argument("--shapes", default="3072x12288,12288x3072")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads in the children (0: torch's default)")
    p.add_argument("--rotations", action="store_true", help="time only the rotation's three forms (see above)")
    p.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rotations:
        rotations(args.threads)
        return 0
    if args.child:
        tree, n, k, repeats, threads = args.child
        child(tree, int(n), int(k), int(repeats), int(threads))
        return 0
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    trees = {"after": str(ROOT)} | ({"before": str(Path(args.before).resolve())} if args.before else {})
    results: dict = {}
    for n, k in shapes:
        for i, (name, tree) in enumerate(trees.items() if (n + k) % 2 == 0 else reversed(trees.items())):
            r = run_child(tree, n, k, args.repeats, args.threads)
            results.setdefault(f"{n}x{k}", {})[name] = r
            print(f"{name:<7}{n}x{k}: wall {r['wall_s']:.3f} s  cpu {r['cpu_s']:.3f} s  peak added "
                  f"{r['peak_added_x_fp8']:.2f}x the FP8 weight  SQNR {r['sqnr_db']:.2f} dB  ({r['threads']} threads)")
    out = {"bench": "int8_convert", "loadavg_1min": round(os.getloadavg()[0], 2), "results": results}
    if args.before:
        out["ratios_after_vs_before"] = {
            s: {m: round(v["after"][m] / v["before"][m], 3) for m in ("wall_s", "cpu_s", "peak_added_x_fp8")}
            for s, v in results.items()}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
