"""Rules both libraries (quant/ and engram/) share, below every floor of the pack: atomic file writes,
positioned reads (in parallel where large), /proc facts, source digests, sizes in words. Pure Python (no
torch), never imports ComfyUI, and imports nothing from the pack above it, so quant/ and engram/ each keep
one copy of a rule without importing each other.
"""
