"""Small test images made with Pillow, in every format the runner takes (and some it must refuse)."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (80, 48), seed: int = 1) -> bytes:
    """A noise image of size (width, height) encoded as fmt (PNG, JPEG or WEBP)."""
    rng = np.random.default_rng(seed)
    pixels = (rng.random((size[1], size[0], 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    """The bytes as a base64 data URL."""
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def image_message(text: str, url: str) -> dict:
    """An OpenAI user message of a text part and an image_url part."""
    return {"role": "user", "content": [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]}
