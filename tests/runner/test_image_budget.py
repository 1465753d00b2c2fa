"""Images decoded no larger than the model needs: a request's decoded pixels share a budget, counted from the
headers before any pixel is decoded (after a JPEG's reduction on decode), and libmtmd gets an 8-bit image of at
most MAX_SIDE px a side (a 16-bit PNG, a large image, a JPEG decoded reduced) instead of decoding the original."""

from __future__ import annotations

import io

import pytest
from PIL import Image, ImageFile

from app.protocols.openai import ApiError
from app.runner.config import ImageLimits
from app.runner.images import MAX_SIDE, PixelBudget, load_image
from tests.images import data_url, deep_png, image_bytes

WHERE = "messages.0.content.1"
PARAM = WHERE + ".image_url.url"


@pytest.fixture
def decodes(monkeypatch):
    """The sizes of the images Pillow decodes (ImageFile.load), in order."""
    seen = []
    real = ImageFile.ImageFile.load

    def load(self):
        seen.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


def _size_and_depth(png: bytes) -> tuple[tuple[int, int], int]:
    with Image.open(io.BytesIO(png)) as im:
        return im.size, png[24]


def test_a_request_over_the_pixel_budget_is_refused_before_a_pixel_is_decoded(decodes):
    limits = ImageLimits(max_request_pixels=1_000_000)
    with pytest.raises(ApiError) as info:
        load_image(data_url(deep_png(1200, 1000)), WHERE, limits, budget=PixelBudget(limits.max_request_pixels))
    err = info.value
    assert err.status == 400 and err.param == PARAM and err.code == "image_too_large"
    assert "decode to 1,200,000 pixels, more than the limit of 1,000,000 for one request" in str(err)
    assert decodes == []


def test_the_budget_is_shared_by_the_request_s_images(decodes):
    limits = ImageLimits(max_request_pixels=1_000_000)
    budget = PixelBudget(limits.max_request_pixels)
    load_image(data_url(image_bytes("PNG", (800, 800))), WHERE, limits, budget=budget)
    with pytest.raises(ApiError, match="decode to 1,280,000 pixels"):
        load_image(data_url(image_bytes("PNG", (800, 800), seed=2)), "messages.0.content.2", limits, budget=budget)
    assert decodes == [(800, 800)]  # the second was refused from its header


def test_the_default_budget_refuses_the_8192_square_16_bit_png_of_the_issue(decodes):
    png = deep_png(8192, 8192)
    assert len(png) < 1_000_000  # well inside the byte limit: only the decoded size tells
    with pytest.raises(ApiError, match="decode to 67,108,864 pixels, more than the limit of 8,388,608"):
        load_image(data_url(png), WHERE, ImageLimits(), budget=PixelBudget(ImageLimits().max_request_pixels))
    assert decodes == []


def test_a_16_bit_png_reaches_libmtmd_as_8_bits_a_channel():
    sent, for_mtmd = load_image(data_url(deep_png(64, 40, value=0x8000)), WHERE, ImageLimits())
    assert sent[24] == 16 and _size_and_depth(for_mtmd) == ((64, 40), 8)
    with Image.open(io.BytesIO(for_mtmd)) as im:
        assert im.getpixel((3, 3))[:3] == (128, 128, 128)
    grey = load_image(data_url(deep_png(16, 16, value=0xFF00, color_type=0)), WHERE, ImageLimits())[1]
    with Image.open(io.BytesIO(grey)) as im:
        assert im.getpixel((0, 0)) == (255, 255, 255)  # scaled to 8 bits, not clipped


def test_a_large_jpeg_is_decoded_reduced_and_counted_at_its_reduced_size(decodes):
    jpeg = image_bytes("JPEG", (4096 + 800, 3072))
    budget = PixelBudget(4_000_000)  # the full size (15 MP) would not fit
    sent, for_mtmd = load_image(data_url(jpeg, "image/jpeg"), WHERE, ImageLimits(), budget=budget)
    assert sent == jpeg
    assert set(decodes) == {(2448, 1536)} and budget.used == 2448 * 1536  # DCT-scaled by 1/2, never whole
    size, depth = _size_and_depth(for_mtmd)
    assert max(size) == MAX_SIDE and depth == 8


def test_a_png_wider_than_the_side_limit_is_scaled_for_libmtmd():
    _, for_mtmd = load_image(data_url(image_bytes("PNG", (3000, 100))), WHERE, ImageLimits())
    assert _size_and_depth(for_mtmd) == ((MAX_SIDE, 68), 8)


@pytest.mark.parametrize("fmt, mime", [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_an_image_libmtmd_decodes_small_enough_goes_as_sent(fmt, mime):
    data = image_bytes(fmt, (MAX_SIDE, 30))
    assert load_image(data_url(data, mime), WHERE, ImageLimits(), budget=PixelBudget(10**8)) == (data, data)
