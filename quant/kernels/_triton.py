"""Where Triton can run, and the small jit helpers the kernels share.

Triton is optional: every kernel has a plain-torch twin, and ``HAS_TRITON`` is False when the
package is missing or fails to import. ``INTERPRET`` is True under ``TRITON_INTERPRET=1`` (the CPU
interpreter the tests use); the kernels then take ``EXACT=True`` paths that round explicitly,
because the interpreter's own float downcasts do not round to nearest-even (it truncates to bf16
and does not carry into the exponent for fp8), while the GPU's conversion instructions do.
"""

from __future__ import annotations

import os

try:  # pragma: no cover - depends on the machine
    import triton
    import triton.language as tl

    HAS_TRITON = True
except Exception:  # noqa: BLE001 - a broken triton install must not break the package
    triton = None
    tl = None
    HAS_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

__all__ = ["triton", "tl", "HAS_TRITON", "INTERPRET", "jit"]


def jit(fn):
    """``triton.jit`` where Triton exists; the plain function otherwise (never called then)."""
    return triton.jit(fn) if HAS_TRITON else fn


def jit_unspecialized(*names):
    """``jit`` that does not specialize the named integer arguments (token counts): Triton would
    otherwise compile again for M == 1 and for M divisible by 16, on the first call of each."""
    def wrap(fn):
        return triton.jit(fn, do_not_specialize=list(names)) if HAS_TRITON else fn
    return wrap


@jit
def grouped_tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order: GROUP_M row tiles run side by side over
    each column tile, so programs that run together share the weight's tiles in L2."""
    grid_m = tl.cdiv(M, BM)
    grid_n = tl.cdiv(N, BN)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % width) % size_m, (pid % width) // size_m


@jit
def round_bf16(x):
    """float32 -> the nearest bfloat16 value (ties to even), still as float32 (exact to cast)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@jit
def round_fp8_grid(y, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """float32 (already clamped to the FP8 range) -> the nearest FP8 value (ties to even), as
    float32. Adding and subtracting 1.5 * 2**(23 + e) rounds at the grid step 2**e of the value's
    binade (subnormals share the smallest normal binade's step); the sign is put back by bits so
    that tiny negatives give -0 as a hardware cast does."""
    bits = y.to(tl.uint32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits ^ mag
    e = (mag >> 23).to(tl.int32) - 127
    step_e = tl.maximum(e, EMIN) - MBITS
    magic = ((step_e + 22 + 127).to(tl.uint32) << 23).to(tl.float32, bitcast=True) * 3.0
    a = mag.to(tl.float32, bitcast=True)
    r = (a + magic) - magic
    r = (r.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    return tl.where(y != y, y, r)  # NaN passes through


@jit
def fp8_bits_to_f32(b, E5M2: tl.constexpr):
    """Raw FP8 bytes (uint8) -> float32 without FP8 hardware (GPUs before compute capability 8.9,
    where Triton has no float8e4nv type). Exact for every finite code."""
    if E5M2:
        # e5m2 is the upper byte of a float16
        out = (b.to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        w = b.to(tl.uint32)
        em = w & 0x7F
        neg = (w & 0x80) != 0
        normal = (((em << 20) + (120 << 23)) | ((w & 0x80) << 24)).to(tl.float32, bitcast=True)
        sub = em.to(tl.float32) * 0.001953125  # subnormal: m * 2**-9
        sub = tl.where(neg, -sub, sub)
        out = tl.where(em < 8, sub, normal)
    return out
