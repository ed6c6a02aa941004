"""The pictures of a tiny-world graph (scripts/example_graphs.py), fetched from the server and judged."""

from __future__ import annotations

import io

import numpy as np

import tiny_world as world  # scripts/ is on sys.path (tests/conftest.py)


def judged_pictures(comfy, history: dict, saves: dict) -> dict:
    """{key: (picture uint8 [SIZE, SIZE, 3], verdict)} for every key of `saves` ({key: SaveImage node id})
    in the run `history`."""
    from PIL import Image

    out = {}
    for key, node_id in saves.items():
        image = history["outputs"][node_id]["images"][0]
        data = comfy.view(image["filename"], image.get("subfolder", ""), image.get("type", "output"))
        picture = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert picture.shape == (world.SIZE, world.SIZE, 3), (key, picture.shape)
        out[key] = (picture, world.judge(picture))
    return out
