"""Images in chat requests, before any model sees them: decoded and checked, every refusal a 400 naming the
part and what to send; image parts as llama.cpp's media markers in the rendered prompt; a runner without a
projector saying what to add."""

from __future__ import annotations

import base64
import io
import socket
import threading

import pytest
from PIL import Image
from werkzeug.serving import make_server
from werkzeug.wrappers import Response

from app.engine.template_caps import TemplateCaps
from app.engine.template_inputs import MEDIA_MARKER, template_messages
from app.protocols.openai import ApiError
from app.runner.config import ImageLimits
from app.runner.images import as_png, image_parts, load_image, with_markers
from tests.images import data_url, image_bytes, image_message

WHERE = "messages.0.content.1"
PARAM = WHERE + ".image_url.url"


def refusal(url: str, limits: ImageLimits = ImageLimits()) -> ApiError:
    with pytest.raises(ApiError) as info:
        load_image(url, WHERE, limits)
    assert info.value.status == 400 and info.value.param == PARAM
    return info.value


@pytest.mark.parametrize(("fmt", "mime"), [("PNG", "image/png"), ("JPEG", "image/jpeg")])
def test_png_and_jpeg_go_to_libmtmd_as_sent(fmt, mime):
    data = image_bytes(fmt)
    assert load_image(data_url(data, mime), WHERE, ImageLimits()) == (data, data)


def test_webp_goes_to_libmtmd_as_the_png_of_its_pixels():
    data = image_bytes("WEBP")
    sent, for_mtmd = load_image(data_url(data, "image/webp"), WHERE, ImageLimits())
    assert sent == data and for_mtmd[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(io.BytesIO(data)) as a, Image.open(io.BytesIO(for_mtmd)) as b:
        assert a.convert("RGB").tobytes() == b.convert("RGB").tobytes()


def test_raw_base64_is_taken_as_ollama_sends_it():
    data = image_bytes("PNG")
    assert load_image(base64.b64encode(data).decode(), WHERE, ImageLimits())[0] == data


def test_an_image_over_the_byte_limit_names_the_limit():
    data = image_bytes("PNG", size=(64, 64))
    err = refusal(data_url(data), ImageLimits(max_bytes=len(data) - 1))
    assert f"{len(data) - 1:,} bytes" in err.message and err.code == "image_too_large"


def test_an_image_over_the_pixel_limit_names_the_limit():
    err = refusal(data_url(image_bytes("PNG", size=(80, 48))), ImageLimits(max_pixels=80 * 48 - 1))
    assert "80×48" in err.message and f"{80 * 48 - 1:,}" in err.message and "scale it down" in err.message


def test_a_truncated_image_is_refused():
    data = image_bytes("PNG", size=(64, 64))
    assert "truncated or corrupt" in refusal(data_url(data[: len(data) // 2])).message


def test_svg_is_refused_with_what_to_send_instead():
    svg = b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"></svg>'
    err = refusal(data_url(svg, "image/svg+xml"))
    assert "SVG" in err.message and "PNG, JPEG or WebP" in err.message


def test_other_formats_and_non_images_are_refused():
    gif = io.BytesIO()
    Image.new("RGB", (4, 4)).save(gif, format="GIF")
    assert "GIF image: send PNG, JPEG or WebP" in refusal(data_url(gif.getvalue(), "image/gif")).message
    assert "not an image" in refusal(data_url(b"hello, I am text")).message
    assert "not valid base64" in refusal("data:image/png;base64,@@@").message
    assert "base64 data URL" in refusal("data:text/plain,hello").message


def test_http_urls_are_refused_unless_fetching_is_on():
    err = refusal("http://127.0.0.1:9/cat.png")
    assert err.code == "image_url_fetch_off" and "--image-url-fetch" in err.message and "data URL" in err.message


@pytest.fixture
def image_server():
    """A loopback HTTP server: /cat.png, /unsized.png (chunked, no length), /slow.png (headers, then nothing until the
    test ends), /to-metadata (a redirect to the cloud metadata address), /to-cat (a redirect to /cat.png)."""
    data = image_bytes("PNG")
    done = threading.Event()

    def app(environ, start_response):
        path = environ["PATH_INFO"]
        if path == "/cat.png":
            return Response(data, mimetype="image/png")(environ, start_response)
        if path == "/unsized.png":
            return Response(iter([data[:100], data[100:]]), mimetype="image/png")(environ, start_response)
        if path == "/slow.png":
            def drip():
                yield data[:10]
                done.wait(30)  # released when the test ends: the client must give up first
                yield data[10:]
            return Response(drip(), mimetype="image/png")(environ, start_response)
        if path == "/to-metadata":
            return Response("", 302, headers={"Location": "http://169.254.169.254/latest/meta-data/"})(
                environ, start_response)
        if path == "/to-cat":
            return Response("", 302, headers={"Location": "/cat.png"})(environ, start_response)
        return Response(b"", status=404)(environ, start_response)

    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    server.data = data
    server.base = f"http://127.0.0.1:{server.server_port}"
    yield server
    done.set()
    server.shutdown()
    server.server_close()


LOOPBACK_ALLOWED = ImageLimits(fetch_urls=True, fetch_allowed_hosts="127.0.0.1")


def test_http_urls_are_fetched_when_allowed(image_server):
    data, base = image_server.data, image_server.base
    assert load_image(f"{base}/cat.png", WHERE, LOOPBACK_ALLOWED) == (data, data)
    assert load_image(f"{base}/to-cat", WHERE, LOOPBACK_ALLOWED) == (data, data)
    assert load_image(f"{base}/unsized.png", WHERE, LOOPBACK_ALLOWED) == (data, data)
    assert "HTTP 404" in refusal(f"{base}/nope.png", LOOPBACK_ALLOWED).message


def test_fetching_is_off_by_default_in_the_runner_and_in_serve():
    from app.store.settings import REGISTRY

    assert ImageLimits().fetch_urls is False and REGISTRY["runner_image_url_fetch"].default is False


def test_a_fetch_reaches_public_hosts_only(image_server, monkeypatch):
    on = ImageLimits(fetch_urls=True)
    err = refusal(f"{image_server.base}/cat.png", on)
    assert err.code == "image_url_refused" and "127.0.0.1, a loopback address" in err.message
    assert "--image-url-hosts" in err.message
    for url, kind in (("http://169.254.169.254/latest/meta-data/", "link-local"), ("http://10.0.0.1/cam.jpg", "private"),
                      ("http://192.168.1.1/cam.jpg", "private"), ("http://[::1]/x.png", "loopback"),
                      ("http://[::ffff:169.254.169.254]/x.png", "link-local"), ("http://0.0.0.0/x.png", "unspecified")):
        err = refusal(url, on)
        assert err.code == "image_url_refused" and f"a {kind} address" in err.message, (url, err.message)
    # A redirect is checked before a byte goes to it, even from a host the admin allowed.
    err = refusal(f"{image_server.base}/to-metadata", LOOPBACK_ALLOWED)
    assert err.code == "image_url_refused" and "169.254.169.254" in err.message
    # A public name that resolves to a private address (DNS rebinding) is refused by the address it resolved to.
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, port, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.168.1.50", port))])
    err = refusal("http://images.example.com/cat.png", on)
    assert err.code == "image_url_refused" and "192.168.1.50, a private address" in err.message


def test_a_fetch_is_held_to_the_byte_and_time_limits(image_server):
    data, base = image_server.data, image_server.base
    small = ImageLimits(fetch_urls=True, fetch_allowed_hosts="127.0.0.1", max_bytes=len(data) - 1)
    for path in ("/cat.png", "/unsized.png"):  # refused by its Content-Length, and while it is read
        err = refusal(f"{base}{path}", small)
        assert err.code == "image_too_large" and f"{len(data) - 1:,} bytes" in err.message
    quick = ImageLimits(fetch_urls=True, fetch_allowed_hosts="127.0.0.1", fetch_timeout_s=0.5)
    err = refusal(f"{base}/slow.png", quick)
    assert err.code == "image_url_timeout" and "0.5 s" in err.message
    assert "not an http(s) URL" in refusal("http:///nohost.png", LOOPBACK_ALLOWED).message


def test_image_parts_become_media_markers_joined_as_llama_cpp_joins_them():
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "data:..."}},
        {"type": "text", "text": "what is it?"}, {"type": "text", "text": "Be brief."}]}]
    assert image_parts(messages) == [("data:...", "messages.0.content.1")]
    marked = with_markers(messages, "<M>")
    assert marked[0]["content"][1] == {"type": MEDIA_MARKER, "text": "<M>"}
    caps = TemplateCaps(supports_string_content=False, supports_typed_content=True)
    rendered = template_messages(marked, caps, "")
    # No newline around the marker; text parts newline-joined; a string whatever the template's caps.
    assert rendered[0]["content"] == "Look:<M>what is it?\nBe brief."


def test_a_runner_without_a_projector_says_what_to_add(make_runner):
    client = make_runner()
    body = {"messages": [image_message("What is this?", data_url(image_bytes()))], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400
    err = r.get_json()["error"]
    assert err["param"] == WHERE and "--mmproj" in err["message"] and err["code"] == "images_unsupported"
    b64 = base64.b64encode(image_bytes()).decode()
    # Anthropic's image block and Responses' input_image, in their own error shapes, say the same.
    m = client.post("/v1/messages", json={"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}}]}]})
    assert m.status_code == 400 and m.get_json()["type"] == "error"
    assert "--mmproj" in m.get_json()["error"]["message"] and "mmproj-<model name>.gguf" in m.get_json()["error"]["message"]
    resp = client.post("/v1/responses", json={"max_output_tokens": 16, "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": f"data:image/png;base64,{b64}"}]}]})
    assert resp.status_code == 400 and "--mmproj" in resp.get_json()["error"]["message"]
    # Nothing else disturbed: the next text request is answered.
    assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                     "max_tokens": 2}).status_code == 200


def test_png_helper_keeps_transparency():
    im = Image.new("RGBA", (2, 2), (1, 2, 3, 4))
    out = io.BytesIO()
    im.save(out, format="WEBP", lossless=True)
    with Image.open(io.BytesIO(as_png(out.getvalue()))) as back:
        assert back.mode == "RGBA"


def test_the_runner_refuses_a_missing_projector_at_start(tmp_path):
    from app.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SystemExit, match="--mmproj: file not found"):
        main(["runner", "-m", str(model), "--mmproj", str(tmp_path / "nope.gguf")])


def test_the_runner_refuses_image_url_hosts_it_cannot_read(tmp_path):
    from app.cli import main

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    with pytest.raises(SystemExit, match="--image-url-hosts: 'http://cam' is not a host name"):
        main(["runner", "-m", str(model), "--image-url-fetch", "--image-url-hosts", "http://cam"])
