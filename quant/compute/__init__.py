"""The compute floor: how ``y = x @ W.T + b`` runs for a QuantizedTensor W, and what proved it right.

    linear.py     the entry point: the route cached on the weight, the book's pick, the run, one fallback rule
    paths/        the registry of paths (plain "weight-only", fp8, int8, kitchen int8, kitchen awq and svdquant,
                  the fused GEMMs)
    prove.py      proving a product: the verdict for a kind of product, the check of each new shape
    proof.py      the rules a proof applies (SQNR against a reference, the twin's margin, which outputs, timing)
    book.py       the book of verdicts, proven shapes and failures; the verdict file
    scaled_mm.py  the fp8 x fp8 scaled matmul: API probe, block-scale forms, its custom op
    int8.py       the int8 x int8 product and the conversion of FP8 weights to int8
    matmul.py     QuantizedTensor's matmul-like ops, routed to linear.py
"""

from __future__ import annotations

from .. import tensor as _tensor
from . import matmul as _matmul  # noqa: F401  (registers the matmul-like ops)
from .book import Book, book_for_file, default_book
from .linear import fp8_supported, linear


def _routing_state(config) -> str:
    book = getattr(config, "book", None) or default_book()
    return book.fingerprint()


_tensor.routing_state = _routing_state  # compiled graphs are cached per state of the verdicts that routed them

__all__ = ["linear", "fp8_supported", "Book", "book_for_file", "default_book"]
