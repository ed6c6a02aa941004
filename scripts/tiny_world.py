"""The tiny world the demo's models are trained on: 64x64 pictures drawn by code, and a judge.

Each picture is one shape (circle, square or upright triangle) in one of four colours on a plain light
background, at a random size and place; its prompt says what it is ("a red circle"). The judge reads
colour and shape back from any RGB picture, drawn or generated:

- foreground: pixels far (in RGB) from the background, which is the median of the picture's border;
  the largest connected part of them is the shape;
- colour: the circular mean hue of the foreground, weighted by saturation, against the four hues;
- shape: from the foreground's bounding box: an upright triangle keeps only a quarter of its area in
  the box's upper half (circles and squares half); a square fills the box's corners outside the
  inscribed ellipse, a circle leaves them empty, and a rounded square still fills most of them (the
  fill of the box alone, square ~1.0, circle ~0.785, triangle ~0.5, reads rounded squares as
  circles; it is reported beside the verdict).

Pure numpy (scipy for connected parts); no torch, no ComfyUI.
"""

from __future__ import annotations

import colorsys
import math
from dataclasses import dataclass

import numpy as np

SIZE = 64
COLOURS = {  # name -> RGB (0..255)
    "red": (214, 44, 44),
    "green": (40, 164, 70),
    "blue": (44, 86, 214),
    "yellow": (236, 196, 34),
}
SHAPES = ("circle", "square", "triangle")
BACKGROUND = (238, 236, 230)
JITTER = 5.0  # pixels the centre of a shape moves from the middle of the picture
# Every (colour, shape) of the world, in a fixed order: class index = position here.
CLASSES = tuple((c, s) for c in COLOURS for s in SHAPES)
# Shape thresholds (see judge()), between what drawn shapes give under blur and noise.
TRIANGLE_TOP_SHARE = 0.375
SQUARE_CORNERS = 0.33  # blurred squares keep ~0.5 of their corners, blurred circles under ~0.2
_HUES = {name: colorsys.rgb_to_hsv(*(v / 255 for v in rgb))[0] for name, rgb in COLOURS.items()}


def prompt(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def parse_prompt(text: str) -> tuple[str, str] | None:
    """(colour, shape) named by a prompt of the world, else None."""
    words = text.lower().replace(",", " ").split()
    colours = [w for w in words if w in COLOURS]
    shapes = [w for w in words if w in SHAPES]
    return (colours[0], shapes[0]) if len(colours) == 1 and len(shapes) == 1 else None


# ----- drawing -----

def _coverage(shape: str, cx: float, cy: float, r: float, oversample: int = 4) -> np.ndarray:
    """Fraction [SIZE, SIZE] of each pixel inside the shape (supersampled, so edges are anti-aliased).

    `r` is the half-size: a circle's radius, half a square's side, half a triangle's base."""
    n = SIZE * oversample
    coords = (np.arange(n) + 0.5) / oversample
    x, y = np.meshgrid(coords, coords)
    if shape == "circle":
        inside = (x - cx) ** 2 + (y - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(x - cx) <= r) & (np.abs(y - cy) <= r)
    elif shape == "triangle":
        h = r * math.sqrt(3)  # equilateral, apex up, centred on its bounding box
        top, bottom = cy - h / 2, cy + h / 2
        t = (y - top) / h  # 0 at the apex, 1 at the base
        inside = (t >= 0) & (t <= 1) & (np.abs(x - cx) <= r * t)
    else:
        raise ValueError(f"unknown shape {shape!r} (one of {SHAPES})")
    return inside.reshape(SIZE, oversample, SIZE, oversample).mean(axis=(1, 3))


def draw(colour: str, shape: str, rng: np.random.Generator) -> np.ndarray:
    """One picture of the world: uint8 [SIZE, SIZE, 3], a random size and place, colour jittered."""
    # Sizes and places vary, but not so much that a two-block model trained for minutes cannot learn them:
    # the shape stays near the middle (a wide spread of places made it draw blobs instead of shapes).
    r = rng.uniform(13.0, 19.0) if shape != "triangle" else rng.uniform(15.0, 21.0)
    cx = SIZE / 2 + rng.uniform(-JITTER, JITTER)
    cy = SIZE / 2 + rng.uniform(-JITTER, JITTER)
    alpha = _coverage(shape, cx, cy, r)[..., None]
    fg = np.clip(np.array(COLOURS[colour], dtype=np.float64) + rng.uniform(-14, 14, 3), 0, 255)
    bg = np.clip(np.array(BACKGROUND, dtype=np.float64) + rng.uniform(-8, 8), 0, 255)
    return np.round(bg * (1 - alpha) + fg * alpha).astype(np.uint8)


def dataset(n_per_class: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [N, SIZE, SIZE, 3], class indices int64 [N]), classes interleaved, from `seed`."""
    rng = np.random.default_rng(seed)
    labels = np.tile(np.arange(len(CLASSES)), n_per_class)
    images = np.stack([draw(*CLASSES[k], rng) for k in labels])
    return images, labels


# ----- judging -----

@dataclass(frozen=True)
class Verdict:
    colour: str | None  # None: no shape found
    shape: str | None
    fill: float = 0.0  # foreground area / bounding box area (square ~1.0, circle ~0.785, triangle ~0.5)
    top_share: float = 0.0  # share of the shape in the upper half of its box (upright triangle ~0.25, else ~0.5)
    corners: float = 0.0  # how full the box is outside its inscribed ellipse (square ~1, circle ~0)
    pixels: int = 0  # foreground pixels in the shape

    @property
    def label(self) -> str:
        return f"{self.colour} {self.shape}" if self.colour else "nothing"

    def reads(self, colour: str, shape: str) -> bool:
        return self.colour == colour and self.shape == shape


def judge(image: np.ndarray, min_pixels: int = 24) -> Verdict:
    """Read colour and shape from an RGB picture (uint8 [H, W, 3], or float in [0, 1])."""
    from scipy import ndimage

    img = np.asarray(image, dtype=np.float64)
    if img.max() <= 1.0 + 1e-6:
        img = img * 255.0
    border = np.concatenate([img[:2].reshape(-1, 3), img[-2:].reshape(-1, 3), img[:, :2].reshape(-1, 3), img[:, -2:].reshape(-1, 3)])
    bg = np.median(border, axis=0)
    dist = np.linalg.norm(img - bg, axis=-1)
    peak = np.percentile(dist, 99.5)
    if peak < 40:
        return Verdict(None, None)
    mask = dist > max(30.0, 0.45 * peak)
    labels, count = ndimage.label(mask)
    if count == 0:
        return Verdict(None, None)
    sizes = ndimage.sum(mask, labels, index=np.arange(1, count + 1))
    part = labels == (1 + int(np.argmax(sizes)))
    part = ndimage.binary_fill_holes(part)
    pixels = int(part.sum())
    if pixels < min_pixels:
        return Verdict(None, None, pixels=pixels)

    # colour: saturation-weighted circular mean hue of the shape's pixels
    rgb = img[part] / 255.0
    mx, mn = rgb.max(axis=1), rgb.min(axis=1)
    sat = np.where(mx > 0, (mx - mn) / np.maximum(mx, 1e-9), 0.0)
    hue = np.array([colorsys.rgb_to_hsv(*p)[0] for p in rgb])
    angle = math.atan2(float((sat * np.sin(2 * np.pi * hue)).sum()), float((sat * np.cos(2 * np.pi * hue)).sum()))
    mean_hue = (angle / (2 * np.pi)) % 1.0
    colour = min(_HUES, key=lambda name: min(abs(mean_hue - _HUES[name]), 1 - abs(mean_hue - _HUES[name])))

    # shape: two features of the bounding box. An upright triangle holds a quarter of its area in the
    # box's upper half (a circle or square half); a square fills the corners outside the inscribed
    # ellipse, a circle leaves them empty (a rounded square still fills most of them).
    rows, cols = np.nonzero(part)
    box = part[rows.min(): rows.max() + 1, cols.min(): cols.max() + 1]
    h, w = box.shape
    fill = pixels / float(h * w)
    yy = (np.arange(h)[:, None] + 0.5) / h - 0.5
    xx = (np.arange(w)[None, :] + 0.5) / w - 0.5
    outside = (xx ** 2 + yy ** 2) > 0.25
    top_share = float(box[yy[:, 0] < 0].sum() + 0.5 * box[np.isclose(yy[:, 0], 0)].sum()) / pixels
    corners = float(box[outside].mean()) if outside.any() else 0.0
    if top_share < TRIANGLE_TOP_SHARE:
        shape = "triangle"
    else:
        shape = "square" if corners > SQUARE_CORNERS else "circle"
    return Verdict(colour, shape, fill, top_share, corners, pixels)
