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


def deep_png(width: int, height: int, value: int = 0x8000, color_type: int = 6) -> bytes:
    """A 16-bit PNG (RGBA by default, color_type 0 for grey) of one value in every channel, written row by row
    (Pillow cannot write 16-bit RGBA): 8192×8192 RGBA is ~520 KB of zlib but 512 MiB of 16-bit pixels."""
    import struct
    import zlib

    channels = {0: 1, 2: 3, 4: 2, 6: 4}[color_type]
    row = b"\0" + struct.pack(">H", value) * (width * channels)  # filter byte 0, then the samples

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    z = zlib.compressobj(9)
    parts = [z.compress(row) for _ in range(height)]
    idat = b"".join(parts) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")
