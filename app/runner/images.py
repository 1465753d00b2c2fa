"""Images in chat requests: taken from the messages, decoded and checked before libmtmd sees them.

OpenAI's `image_url` parts carry a base64 data URL (or raw base64, as Ollama sends its `images`); an
http(s) URL is fetched only where the runner allows it (--image-url-fetch, off by default: a
household server should not fetch what a prompt names), and then from public hosts only: every hop is
resolved, each address checked and the connection made to a checked one (app.netguard, which model
pulls use too), so a prompt cannot reach the router, the NAS's own services or a cloud metadata
address; the bytes and the whole fetch's time are limited. Each image is checked with Pillow: one of
PNG, JPEG or WebP, within the byte and pixel limits, and decodable to its end (a truncated file is
refused here, not half-read by the vision tower). Every refusal is a 400 naming the part and what
to send instead. libmtmd decodes the bytes again itself, as llama-server does, so both see the same
pixels — where that decode is as small as it need be.

Decoded pixels are what cost memory (a 520 KB 16-bit RGBA PNG of 8192×8192 is 512 MiB in stb_image's
16-bit decode, beside Pillow's 256 MiB), so a request's images share a budget of decoded pixels
(ImageLimits.max_request_pixels), counted from each header before a pixel is decoded, after the reduction on
decode a format allows (a JPEG's DCT scaling, Pillow's draft(): 1/2, 1/4 or 1/8 of each side, toward MAX_SIDE).
An image libmtmd would decode larger than it needs — a side over MAX_SIDE, 16 bits a channel, a JPEG decoded
reduced, a WebP (stb_image has no WebP) — goes to it as the 8-bit PNG of Pillow's pixels, scaled to MAX_SIDE.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import math
import time
import warnings
from urllib.parse import urljoin, urlsplit

from PIL import Image, UnidentifiedImageError

from app.engine.template_inputs import MEDIA_MARKER
from app.netguard import AddressRefused, HostPolicy, PinnedHTTPConnection, PinnedHTTPSConnection
from app.protocols.openai import ApiError, content_parts
from app.runner.config import ImageLimits

FORMATS = ("PNG", "JPEG", "WEBP")
# The longest side an image reaches libmtmd with. Every vision tower Hearth knows takes less (Gemma 3's 896 px,
# Qwen2.5-VL's ~1 MP by default) and libmtmd scales a larger image down to its tower's size itself, so a larger
# one only costs stb_image's decode of it (3 bytes a pixel, 8 for 16-bit RGBA) beside Pillow's.
MAX_SIDE = 2048
MAX_IMAGE_REDIRECTS = 3
# The content parts libmtmd takes at a media marker: images, and audio (app.runner.audio).
MEDIA_PARTS = ("image_url", "input_audio")
FETCH_CHUNK_BYTES = 64 * 1024


def image_parts(messages: list[dict]) -> list[tuple[str, str]]:
    """(url, where) of every image_url part, in prompt order; where is the part's path in the body."""
    return [((part.get("image_url") or {}).get("url", ""), where)
            for part, where in content_parts(messages, ("image_url",))]


def with_markers(messages: list[dict], marker: str) -> list[dict]:
    """The messages with each image (and audio) part replaced by a media-marker part (the template renders its text)."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(p, dict) and p.get("type") in MEDIA_PARTS for p in content):
            content = [{"type": MEDIA_MARKER, "text": marker}
                       if isinstance(p, dict) and p.get("type") in MEDIA_PARTS else p for p in content]
            m = {**m, "content": content}
        out.append(m)
    return out


class PixelBudget:
    """The pixels a request's images may still decode to (ImageLimits.max_request_pixels)."""

    def __init__(self, max_pixels: int):
        self.max_pixels = max_pixels
        self.used = 0

    def take(self, num_pixels: int, param: str) -> None:
        """Count an image's decoded pixels; a 400 naming the budget when they do not fit."""
        if self.used + num_pixels > self.max_pixels:
            raise ApiError(400, f"'{param}': this request's images decode to {self.used + num_pixels:,} pixels, more "
                                f"than the limit of {self.max_pixels:,} for one request: send fewer images, or smaller "
                                f"ones (the model sees at most {MAX_SIDE} px a side anyway)", param=param,
                           code="image_too_large")
        self.used += num_pixels


def load_image(url: str, where: str, limits: ImageLimits, param: str | None = None,
               budget: PixelBudget | None = None) -> tuple[bytes, bytes]:
    """One image part's URL (data URL, raw base64, or http(s) where allowed), checked: (the bytes as sent,
    the bytes for libmtmd, see decode_image). param: the field a refusal names (default: the part's
    image_url.url); budget: the request's decoded pixels (None: only this image's limits)."""
    param = param or f"{where}.image_url.url"
    if url.startswith(("http://", "https://")):
        data = _fetch(url, param, limits)
    else:
        payload = url
        if url.startswith("data:"):
            header, sep, payload = url.partition(",")
            if not sep or not header.startswith("data:image/") or not header.endswith(";base64"):
                raise ApiError(400, f"'{param}' must be a base64 data URL of an image "
                                    "(data:image/png;base64,...)", param=param, code="invalid_image")
        if len(payload) > limits.max_bytes * 4 // 3 + 4:
            raise _too_big(param, limits)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, f"'{param}' is not valid base64: send the image as "
                                "data:image/png;base64,... or plain base64", param=param, code="invalid_image")
    if len(data) > limits.max_bytes:
        raise _too_big(param, limits)
    return data, decode_image(data, param, limits, budget)[1]


def as_png(data: bytes) -> bytes:
    """An image's decoded pixels as a PNG (RGB, or RGBA where it has transparency)."""
    with Image.open(io.BytesIO(data)) as im:
        out = io.BytesIO()
        im.convert("RGBA" if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info else "RGB").save(
            out, format="PNG", compress_level=1)
        return out.getvalue()


def _too_big(param: str, limits: ImageLimits) -> ApiError:
    return ApiError(400, f"'{param}' is larger than the image limit of {limits.max_bytes:,} bytes: send it "
                         "smaller (scaled down or recompressed)", param=param, code="image_too_large")


def check_image(data: bytes, param: str, limits: ImageLimits) -> str:
    """The image's format, after checking it is PNG, JPEG or WebP, within max_pixels, and not truncated."""
    return decode_image(data, param, limits)[0]


def _png_bit_depth(data: bytes) -> int:
    """A PNG's bits per channel, from its IHDR (the first chunk): 1, 2, 4, 8 or 16."""
    return data[24] if len(data) > 24 else 8


def _eight_bit(im: Image.Image) -> Image.Image:
    """The image as 8-bit RGB, or RGBA where it has transparency (16-bit grey scaled, not clipped)."""
    if im.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        return im.convert("I").point(lambda v: v * (1 / 256)).convert("L").convert("RGB")
    return im.convert("RGBA" if im.mode in ("RGBA", "LA", "PA") or "transparency" in im.info else "RGB")


def _small_png(im: Image.Image) -> bytes:
    """The decoded image as an 8-bit PNG of at most MAX_SIDE px a side (a box reduction, then an exact resize)."""
    factor = max(im.size) // MAX_SIDE
    if factor > 1:
        im = im.reduce(factor)
    if max(im.size) > MAX_SIDE:
        im = im.copy()
        im.thumbnail((MAX_SIDE, MAX_SIDE), Image.Resampling.BICUBIC)
    out = io.BytesIO()
    _eight_bit(im).save(out, format="PNG", compress_level=1)
    return out.getvalue()


def decode_image(data: bytes, param: str, limits: ImageLimits, budget: PixelBudget | None = None) -> tuple[str, bytes]:
    """Check an image (PNG, JPEG or WebP, within max_pixels and the request's budget, not truncated), decoding it no
    larger than needed; returns its format and the bytes libmtmd should decode: those sent where libmtmd's decode of
    them is as small as needed, else the 8-bit PNG of Pillow's pixels (see the module docstring)."""
    if not data:
        raise ApiError(400, f"'{param}' is empty", param=param, code="invalid_image")
    head = data[:1024].lstrip().lower()
    if head.startswith(b"<") and b"<svg" in head:
        raise ApiError(400, f"'{param}' is an SVG, which is not taken: send it rasterised as PNG, JPEG or WebP",
                       param=param, code="unsupported_image_format")
    try:
        with warnings.catch_warnings():
            # Pillow's own bomb warning fires above ~89 MP: the pixel limit below is the one that answers.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                fmt = im.format or "unknown"
                if fmt not in FORMATS:
                    raise ApiError(400, f"'{param}' is a {fmt} image: send PNG, JPEG or WebP", param=param,
                                   code="unsupported_image_format")
                width, height = im.size
                if width * height > limits.max_pixels:
                    raise ApiError(400, f"'{param}' has {width}×{height} = {width * height:,} pixels, more than the "
                                        f"limit of {limits.max_pixels:,}: scale it down", param=param,
                                   code="image_too_large")
                if fmt == "JPEG" and max(width, height) > MAX_SIDE:
                    # Decoded reduced (DCT scaling): the largest power-of-two reduction that keeps MAX_SIDE.
                    scale = MAX_SIDE / max(width, height)
                    im.draft(None, (math.ceil(width * scale), math.ceil(height * scale)))
                if budget is not None:
                    budget.take(im.size[0] * im.size[1], param)
                im.load()
                if (fmt == "WEBP" or max(im.size) > MAX_SIDE or im.size != (width, height)
                        or (fmt == "PNG" and _png_bit_depth(data) == 16)):
                    return fmt, _small_png(im)
    except Image.DecompressionBombError:
        raise ApiError(400, f"'{param}' has more pixels than the limit of {limits.max_pixels:,}: scale it down",
                       param=param, code="image_too_large")
    except UnidentifiedImageError:
        raise ApiError(400, f"'{param}' is not an image (or not one of PNG, JPEG, WebP)", param=param,
                       code="invalid_image")
    except (OSError, SyntaxError, ValueError) as exc:
        raise ApiError(400, f"'{param}' is truncated or corrupt ({exc}): send the whole file", param=param,
                       code="invalid_image")
    return fmt, data


def _fetch(url: str, param: str, limits: ImageLimits) -> bytes:
    """An http(s) image, where the runner allows fetching: public hosts only (app.netguard, as model pulls), every
    hop resolved and checked and connected at the checked address, at most max_bytes read, all within the timeout."""
    if not limits.fetch_urls:
        raise ApiError(400, f"'{param}': this server does not fetch image URLs; send the image itself as a base64 "
                            "data URL (data:image/png;base64,...), or start the runner with --image-url-fetch "
                            "(hearth serve: the setting runner_image_url_fetch)", param=param, code="image_url_fetch_off")
    hosts = HostPolicy.parse(limits.fetch_allowed_hosts)
    deadline = time.monotonic() + limits.fetch_timeout_s
    for _ in range(MAX_IMAGE_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ApiError(400, f"'{param}': {url[:200]!r} is not an http(s) URL", param=param, code="image_url_failed")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        addresses = _addresses(hosts, parts.hostname, port, param)
        left = _time_left(deadline, param, limits)
        conn_class = PinnedHTTPSConnection if parts.scheme == "https" else PinnedHTTPConnection
        conn = conn_class(parts.hostname, port, addresses, connect_timeout_s=left, timeout=left)
        resp = None
        try:
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            conn.request("GET", target, headers={"User-Agent": "hearth-runner", "Accept": "image/*",
                                                 "Accept-Encoding": "identity"})
            sock = conn.sock  # kept: the connection lets go of it once a response that closes is read
            resp = conn.getresponse()
            if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
                url = urljoin(url, resp.getheader("Location"))  # the next hop is checked before a byte goes to it
                continue
            if resp.status != 200:
                raise ApiError(400, f"'{param}': fetching the image answered HTTP {resp.status}", param=param,
                               code="image_url_failed")
            length = resp.getheader("Content-Length")
            if length and length.isdigit() and int(length) > limits.max_bytes:
                raise _too_big(param, limits)
            return _read_body(resp, sock, deadline, param, limits)
        except TimeoutError:
            raise _too_slow(param, limits)
        except (OSError, http.client.HTTPException) as exc:
            raise ApiError(400, f"'{param}': the image could not be fetched ({exc})", param=param,
                           code="image_url_failed")
        finally:
            if resp is not None:
                resp.close()
            conn.close()
    raise ApiError(400, f"'{param}': more than {MAX_IMAGE_REDIRECTS} redirects", param=param, code="image_url_failed")


def _addresses(hosts: HostPolicy, host: str, port: int, param: str) -> list:
    """The checked addresses of one hop's host (a 400 naming the param when it is refused or unknown)."""
    try:
        return hosts.connect_addresses(host, port)
    except AddressRefused as exc:
        raise ApiError(400, f"'{param}': refused to fetch from {exc.host} ({exc.ip}, a {exc.kind} address): image "
                            "URLs reach public hosts only; send the image itself as a data URL, or allow the host "
                            "with --image-url-hosts (hearth serve: runner_image_url_hosts)", param=param,
                       code="image_url_refused")
    except OSError as exc:
        raise ApiError(400, f"'{param}': the image's host could not be resolved ({exc})", param=param,
                       code="image_url_failed")


def _read_body(resp, sock, deadline: float, param: str, limits: ImageLimits) -> bytes:
    """The answer's body, at most max_bytes, each read within what is left of the fetch's time."""
    data = bytearray()
    while True:
        sock.settimeout(_time_left(deadline, param, limits))
        piece = resp.read1(FETCH_CHUNK_BYTES)
        if not piece:
            return bytes(data)
        data += piece
        if len(data) > limits.max_bytes:
            raise _too_big(param, limits)


def _time_left(deadline: float, param: str, limits: ImageLimits) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise _too_slow(param, limits)
    return left


def _too_slow(param: str, limits: ImageLimits) -> ApiError:
    return ApiError(400, f"'{param}': fetching the image took longer than the limit of {limits.fetch_timeout_s:g} s: "
                         "send the image itself as a data URL", param=param, code="image_url_timeout")
