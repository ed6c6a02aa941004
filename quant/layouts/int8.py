"""INT8 weights: the layout rule (scales, rounding, block Hadamard rotation) that every INT8 user shares.

``Int8(per_row, rotation, regular)`` is the layout of a ``QuantizedTensor`` whose ``qdata`` is int8
``[out, in]``:

- ``per_row``: one float32 scale per output channel (``[out, 1]``), else one per tensor (``[]``);
- ``rotation``: 0, or the block size ``b`` of a Hadamard rotation along K: the stored weight is
  ``W_rot = W @ blockdiag(H_b)^T``. ``H_b`` is orthonormal and symmetric, so ``x @ W.T ==
  (x @ blockdiag(H_b)) @ W_rot.T``: the linear rotates the activation once per call and the
  rotation spreads outlier channels over the block before the per-token int8 rounding;
- ``regular``: ``H_b`` is ComfyUI ConvRot's "regular" Hadamard (Kronecker powers of a symmetric
  4x4 matrix, ``b`` a power of 4), else Sylvester's (``b`` a power of 2; the pack's own default 128);
- ``cast_first``: dequantization casts to the target dtype before rotating back, and rotates in it
  (how ComfyUI decodes ``asym_w4a8_int8``; the int8 product is the same either way).

Dequantization is ComfyUI 0.33's rule for ``int8_tensorwise`` (with ``convrot``), operation for
operation so that the bits agree: ``w = q.float() * scale``, then, when rotated,
``matmul(w.reshape(out, groups, b), H.T)``, then the cast to the requested dtype.
Quantization: ``scale = absmax / 127`` (zero rows get 1), ``q = clamp(round_half_even(w / scale),
-128, 127)``, or stochastic rounding (floor of ``w / scale + U[0, 1)``). Pure torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import QuantizationError
from ..runtime import tracing, workspace
from .base import LayoutBase

__all__ = ["Int8", "hadamard", "check_block", "hadamard_bytes", "rotate", "unrotate", "INT8_MAX", "int8_scale",
           "rotate_factored", "kron_factors"]

INT8_MAX = 127.0
_H4 = ((1, 1, 1, -1), (1, 1, -1, 1), (1, -1, 1, 1), (-1, 1, 1, 1))
_hadamards: dict = {}


def _power_of(n: int, base: int) -> bool:
    while n > 1 and n % base == 0:
        n //= base
    return n == 1


def check_block(size: int, regular: bool = False) -> None:
    """QuantizationError unless ``size`` is a block size the rotation can have (a power of 4 for the
    regular Hadamard, of 2 for Sylvester's); builds nothing, so a size read from a file is checked
    before the ``4 * size**2`` bytes of its matrix are spent."""
    base = 4 if regular else 2
    if isinstance(size, bool) or not isinstance(size, int) or size < base or not _power_of(size, base):
        raise QuantizationError(f"a {'regular' if regular else 'Sylvester'} Hadamard rotation needs a block "
                                f"size that is a power of {base}, got {size!r}")


def hadamard_bytes(size: int) -> int:
    """Bytes of the float32 ``[size, size]`` matrix :func:`hadamard` builds (and caches per device)."""
    return 4 * size * size


def hadamard(size: int, regular: bool = False, device=None) -> torch.Tensor:
    """Normalized symmetric Hadamard matrix ``[size, size]`` (float32), cached per device."""
    device = torch.device("cpu" if device is None else device)
    key = (size, regular, device)
    h = None if tracing() else _hadamards.get(key)  # a cached real tensor cannot enter a compile's fake trace
    if h is None:
        check_block(size, regular)
        # Built outside inference_mode: a cached matrix made under it (a loader's first call) would be
        # an inference tensor, which autograd refuses to save for a later training call's backward.
        with torch.inference_mode(False), torch.no_grad():
            seed = torch.tensor(_H4 if regular else ((1, 1), (1, -1)), dtype=torch.float32)
            h = seed
            while h.shape[0] < size:
                h = torch.kron(h, seed)
            h = (h / (size ** 0.5)).to(device)
        if not tracing():
            _hadamards[key] = h
    return h


FACTORED_MIN_BLOCK = 256  # from here the factored rotation is faster (bench/int8_convert.py --rotations)


def kron_factors(size: int, regular: bool = False) -> tuple[int, int]:
    """``(a, c)``, ``a * c == size``, both powers of the seed's order (2, or 4 for the regular Hadamard) and as
    even as can be: ``hadamard(size) == kron(hadamard(a), hadamard(c))`` (both are Kronecker powers of the
    seed, normalized by the square roots of their sizes)."""
    check_block(size, regular)
    base = 4 if regular else 2
    n = round(math.log(size, base))
    c = base ** (n // 2)
    return size // c, c


def rotate_factored(x: torch.Tensor, block: int, regular: bool = False, out: torch.Tensor | None = None,
                    scratch: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ blockdiag(H).T`` (= :func:`unrotate`'s product) for float32 ``x`` ``[rows, k]``, as the Kronecker
    factors ``H = H_a kron H_c`` give it: each block ``V`` (``[a, c]``) becomes ``H_a @ V @ H_c.T``, ``a + c``
    multiply-adds an element instead of ``block`` (a 256-block: 32 instead of 256; 4x faster on AVX-512).
    Equal to the dense product up to float32 rounding, not bit for bit: for conversions, never for ComfyUI's
    dequantization rule. ``scratch`` (x's size) holds the middle product; ``out`` may be ``x`` itself."""
    a, c = kron_factors(block, regular)
    rows, k = x.shape
    blocks = rows * k // block
    ha, hc = hadamard(a, regular, x.device), hadamard(c, regular, x.device)
    # V @ H_c.T for every block at once: one tall, c-wide GEMM over the rows of all blocks; H_a @ V: a batched
    # product with one expanded matrix. The batched form of the first factor gives the same bits, and took less
    # time on the 8 Mi-element chunks conversions once used; at today's chunk sizes (quantize_chunk_elems) the tall
    # GEMM takes less. On a quiet 2-core AMD EPYC Zen 5, medians of interleaved runs: the first factor alone
    # 0.26-0.32 ns an element against 0.41-0.45 (1 Mi elements, 2 threads), 0.54-0.58 against 0.76 (256 Ki, 1
    # thread); a whole per-row conversion 0.87-1.03x the time it took, an activation's rotation and rounding for
    # the int8 path (quantize_rows_int8, 20 to 4096 tokens) 0.78-0.97x.
    mid = torch.matmul(x.reshape(-1, c), hc.T, out=None if scratch is None else scratch.view(-1, c))
    res = torch.bmm(ha.expand(blocks, a, a), mid.view(blocks, a, c),
                    out=None if out is None else out.view(blocks, a, c))
    return res.view(rows, k)


def rotate(x: torch.Tensor, block: int, regular: bool = False) -> torch.Tensor:
    """``x @ blockdiag(H)`` along the last dim, in float32 (activations; ``H`` is symmetric). On the CPU a block of
    ``FACTORED_MIN_BLOCK`` or more goes by its Kronecker factors (equal up to float32 rounding, fewer flops)."""
    k = x.shape[-1]
    xf = x.to(torch.float32)
    if block >= FACTORED_MIN_BLOCK and x.is_cpu:
        return rotate_factored(xf.reshape(-1, k), block, regular).reshape(x.shape)
    h = hadamard(block, regular, x.device)
    return torch.matmul(xf.reshape(-1, k // block, block), h).reshape(x.shape)


def unrotate(w: torch.Tensor, block: int, regular: bool = False) -> torch.Tensor:
    """Weights: float32 ``[out, in]`` times ``blockdiag(H).T`` per block, exactly as ComfyUI writes it
    (a matmul with the transposed view; the same product serves both directions since H is an
    involution)."""
    out, k = w.shape
    h = hadamard(block, regular, w.device)
    return torch.matmul(w.reshape(out, k // block, block), h.T).reshape(out, k)


def int8_scale(amax: torch.Tensor) -> torch.Tensor:
    """absmax -> a positive float32 scale (all-zero groups get 1)."""
    s = amax.to(torch.float32) / INT8_MAX
    return torch.where(s > 0, s.clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(s))


def _round(v: torch.Tensor, generator) -> torch.Tensor:
    if generator is None:
        v = v.round_()
    else:
        noise = torch.rand(v.shape, generator=generator, device=v.device, dtype=torch.float32)
        v = v.add_(noise).floor_()
    return v.clamp_(-128.0, 127.0).to(torch.int8)


_CHUNK_ELEMS = 1 << 16  # float32 elements per chunk of the CPU dequantization (256 KiB)
# float32 elements per chunk of a per-row quantization on the CPU. On one torch thread a chunk is 1 MiB, so
# its two float32 temporaries (the rows, then the rotated rows) stay in the core's L2 cache while it is
# decoded, rotated, reduced and rounded. On more threads a chunk is 4 MiB: its two temporaries (8 MiB) stay in
# the shared L3 cache. Every operation of a chunk is then a parallel region, whose start costs microseconds on
# an idle CPU but milliseconds where the cores are shared. Measured on a quiet 2-core AMD EPYC Zen 5 (32 MiB L3),
# what a first step converts in bench/load.py (2.03 G parameters, FP8 codes fresh from the file, in place),
# median of 4 interleaved runs: 4.58 s in 4 MiB chunks, 5.57 s in 8 MiB, 5.47 s in 32 MiB (whose temporaries
# leave the cache between the operations); the first step 6.93 s against 8.07. Beside four
# busy processes a weight of a few Mi elements can take several times longer than in one chunk (1536x1536,
# median of 5: 51 against 9 ns a parameter; 6144x1536: 25 both), as each parallel region waits for a thread
# the scheduler set aside. Either way the memory a conversion adds to its int8 result is bounded by
# quantize_temp_bytes().
QUANTIZE_CHUNK_ELEMS = 1 << 18
QUANTIZE_PARALLEL_CHUNK_ELEMS = 1 << 20


def quantize_chunk_elems() -> int:
    return QUANTIZE_CHUNK_ELEMS if torch.get_num_threads() <= 1 else QUANTIZE_PARALLEL_CHUNK_ELEMS


def quantize_temp_bytes() -> int:
    """Bytes of float32 temporaries a chunked per-row quantization allocates at most (two chunks)."""
    return 2 * 4 * quantize_chunk_elems()


@dataclass(frozen=True)
class Int8(LayoutBase):
    """int8 data, a per-tensor or per-output-channel float32 scale, optional block rotation of K."""

    per_row: bool = True
    rotation: int = 0
    regular: bool = False
    cast_first: bool = False  # dequantize casts before rotating back, in the target dtype (asym_w4a8)

    name = "int8"
    family = "int8"
    data_dtypes = (torch.int8,)

    def __post_init__(self):
        if isinstance(self.rotation, bool) or not isinstance(self.rotation, int) or self.rotation < 0:
            raise QuantizationError(f"Int8 rotation must be 0 or a block size, got {self.rotation!r}")
        if self.rotation:
            check_block(self.rotation, self.regular)  # the matrix itself is built at first use

    def _check(self, shape) -> None:
        if len(shape) != 2:
            raise QuantizationError(f"layout {self} needs a 2-D weight [out, in], got shape {list(shape)}")
        if self.rotation and shape[1] % self.rotation:
            raise QuantizationError(f"layout {self}: in_features {shape[1]} is not a multiple of the "
                                    f"rotation block {self.rotation}")

    def scale_shape(self, shape) -> tuple:
        self._check(shape)
        return (shape[0], 1) if self.per_row else ()

    def first_rows(self, qdata, scale, n: int):
        return qdata[:n], (scale.reshape(qdata.shape[0], 1)[:n] if self.per_row else scale)

    def normalize_scale(self, scale: torch.Tensor, shape) -> torch.Tensor:
        want = self.scale_shape(shape)
        if self.per_row:
            if tuple(scale.shape) not in ((shape[0],), (shape[0], 1)):
                raise QuantizationError(f"per-row int8 scale for a weight of shape {list(shape)} must have shape "
                                        f"[{shape[0]}, 1], got {list(scale.shape)}")
        elif scale.numel() != 1:
            raise QuantizationError(f"per-tensor int8 scale must hold one value, got shape {list(scale.shape)}")
        return scale.reshape(want)

    def quantize(self, w: torch.Tensor, dtype=torch.int8, generator=None):
        if dtype != torch.int8:
            raise QuantizationError(f"layout Int8 stores torch.int8 data, got {dtype}")
        self._check(w.shape)
        if self.per_row and generator is None and w.device.type == "cpu" and not tracing():
            return self.quantize_rows(tuple(w.shape), lambda i, j, out: out.copy_(w[i:j]))
        wf = w.to(torch.float32)
        if self.rotation:
            wf = unrotate(wf, self.rotation, self.regular)  # W @ H.T
        amax = wf.abs().amax(dim=1, keepdim=True) if self.per_row else wf.abs().amax()
        scale = int8_scale(amax)
        return _round(wf / scale, generator), scale

    def quantize_rows(self, shape, fill, align: int = 1, chunk_elems: int | None = None,
                      out: torch.Tensor | None = None):
        """Per-row round-to-nearest quantization of a CPU weight of ``shape`` that ``fill(i, j, out)`` writes
        as float32, rows ``i:j`` at a time (``i`` a multiple of ``align``), into ``out``: :meth:`quantize` on the
        whole float32 weight, operation for operation per row, in chunks of about ``chunk_elems`` elements (default
        :func:`quantize_chunk_elems`). The same chunk size gives the same bits; another may differ in the last bit of
        a rotated row (the BLAS may take another kernel for the rotation's matmul on fewer rows). Only the int8 result, its scales and
        two chunk-sized float32 buffers are allocated (:func:`quantize_temp_bytes` at the default size), and
        each chunk is rotated, reduced and rounded while it is in cache.

        ``out``: a contiguous CPU int8 ``[n, k]`` tensor the codes are written into instead of a new one. Rows
        ``i:j`` are written only after ``fill`` has read them, so ``out`` may share memory with what ``fill``
        reads row for row (an FP8 weight converted in its own storage)."""
        chunk_elems = quantize_chunk_elems() if chunk_elems is None else chunk_elems
        if not self.per_row:
            raise QuantizationError("Int8.quantize_rows quantizes per row; a per-tensor scale needs the whole weight")
        self._check(shape)
        n, k = shape
        if out is not None and (out.dtype != torch.int8 or tuple(out.shape) != (n, k) or not out.is_contiguous()
                                or out.device.type != "cpu"):
            raise QuantizationError(f"Int8.quantize_rows: out must be a contiguous CPU int8 tensor of shape {[n, k]}, "
                                    f"got {out.dtype} {list(out.shape)} on {out.device}")
        q = torch.empty((n, k), dtype=torch.int8) if out is None else out
        scale = torch.empty((n, 1), dtype=torch.float32)
        step = max(align, chunk_elems // max(k, 1) // align * align)
        rows = workspace("int8_quantize_rows", min(n, step) * k, torch.float32)
        turned = workspace("int8_quantize_rotated", min(n, step) * k, torch.float32) if self.rotation else None
        h = hadamard(self.rotation, self.regular) if self.rotation else None
        for i in range(0, n, step):
            j = min(n, i + step)
            w = rows[: (j - i) * k].view(j - i, k)
            fill(i, j, w)
            if self.rotation >= FACTORED_MIN_BLOCK:  # the same product by its Kronecker factors (fewer flops)
                w = rotate_factored(w, self.rotation, self.regular, out=w, scratch=turned[: (j - i) * k])
            elif self.rotation:  # unrotate's product: W @ H.T per block, the same matmul on fewer rows
                b = self.rotation
                w = torch.matmul(w.view(j - i, k // b, b), h.T,
                                 out=turned[: (j - i) * k].view(j - i, k // b, b)).view(j - i, k)
            # |w|'s row maximum, without an |w| temporary: the larger of max and -min (the same value)
            s = int8_scale(torch.maximum(w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True).neg_()))
            # no clamp: |w| / s rounds to at most 127 (s is fl(amax / 127) or larger), and a NaN stays one either way
            q[i:j].copy_(w.div_(s).round_())
            scale[i:j] = s
        return q, scale

    def dequantize_stored(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                          out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as stored, not rotated back (``W @ blockdiag(H).T``): ``rotate(x) @ this.T`` is
        ``x @ W.T``, which costs less than rotating the weight back when x has fewer rows than W."""
        return self._dequantize_chunked(q, scale, dtype, out, rotate_back=False)

    def _dequantize_chunked(self, q, scale, dtype, out, rotate_back: bool):
        """``q * scale`` in float32 (rotated back when asked), rounded once into ``dtype``; on the CPU in
        row chunks through a reused float32 buffer that stays in cache (one pass over the weight)."""
        s = scale.to(device=q.device, dtype=torch.float32)
        if q.device.type != "cpu" or tracing() or dtype in (torch.float32, torch.float64) or not q.is_contiguous():
            w = q.float() * s
            if rotate_back:
                w = unrotate(w, self.rotation, self.regular)
            return out.copy_(w) if out is not None else w.to(dtype)
        n, k = q.shape
        out = torch.empty((n, k), dtype=dtype) if out is None else out
        step = max(1, _CHUNK_ELEMS // max(k, 1))
        for i in range(0, n, step):
            j = min(n, i + step)
            tmp = workspace("int8_dequant_f32", (j - i) * k, torch.float32).view(j - i, k)
            torch.mul(q[i:j], s if s.numel() == 1 else s[i:j], out=tmp)
            out[i:j].copy_(unrotate(tmp, self.rotation, self.regular) if rotate_back else tmp)
        return out

    def dequantize(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        if not self.cast_first:
            return self._dequantize_chunked(q, scale, dtype, out, rotate_back=bool(self.rotation))
        w = q.float() * scale.to(device=q.device, dtype=torch.float32)
        if self.rotation:  # cast first, then rotate back in dtype
            n, k = w.shape
            h = hadamard(self.rotation, self.regular, w.device).to(dtype)
            w = torch.matmul(w.to(dtype).reshape(n, k // self.rotation, self.rotation), h.T).reshape(n, k)
        if out is not None:
            return out.copy_(w)
        return w.to(dtype)
