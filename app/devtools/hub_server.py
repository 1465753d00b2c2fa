"""A loopback stand-in for the Hugging Face hub and a plain file server: the paths huggingface_hub asks for
(/api/models/<repo>/tree/<rev>, HEAD and GET /<repo>/resolve/<rev>/<file>) and /files/<name>, with HTTP
Range, a configurable cut of the connection, redirects, a gate that holds downloads, a log of what
was asked and a count of the connections accepted (a refused pull must have made none)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def tiny_gguf(path: Path, arch: str = "llama", weights_mib: int = 6) -> Path:
    """A small but complete GGUF header and tensor: a one-layer llama with a few MiB of (zero) weights."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_tensor("token_embd.weight", np.zeros((weights_mib * 4096, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


class HubServer:
    """Serves `files` (name → path) as repo `owner/repo` and under /files/, on `host` (IPv4 or IPv6) and `port` (0: any)."""

    def __init__(self, files: dict[str, Path], repo: str = "owner/repo", host: str = "127.0.0.1", port: int = 0):
        self.files = files
        self.repo = repo
        self.log: list[tuple[str, str, str | None]] = []
        self.arrived_s: list[float] = []  # time.monotonic() of each request of the log, in order
        self.connections = 0  # accepted, whatever was sent on them
        self.redirects: dict[str, str] = {}  # path → Location answered with a 302
        self.hold: threading.Event | None = None  # set: file bodies wait for it (pulls kept under way)
        self.held = 0  # file GETs waiting on `hold`
        self._count_lock = threading.Lock()
        self.cut_after: int | None = None  # bytes of the next GET after which the connection is dropped
        self.sha_override: str | None = None  # a wrong sha256 to announce
        self.sent_bytes = 0
        self._sha: dict[str, str] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_HEAD(self):
                server._answer(self, head=True)

            def do_GET(self):
                server._answer(self, head=False)

        class Server(ThreadingHTTPServer):
            address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

            def verify_request(self, request, client_address):
                """Count every connection accepted (the accept loop takes them in order)."""
                server.connections += 1
                return True

            def handle_error(self, request, client_address):
                """A client that hangs up mid-body is a pull refused at its header: nothing to print."""
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.httpd = Server((host, port), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{f'[{host}]' if ':' in host else host}:{self.httpd.server_address[1]}"
        # close() waits for serve_forever's next poll: 0.5 s by default, paid by every test that closes a hub.
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()

    def sha256(self, name: str) -> str:
        """The sha256 of a served file (or the wrong one announced), computed once."""
        if name not in self._sha:
            self._sha[name] = hashlib.sha256(self.files[name].read_bytes()).hexdigest()
        return self._sha[name]

    def _answer(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?")[0]
        self.log.append((h.command, path, h.headers.get("Range")))
        self.arrived_s.append(time.monotonic())
        if path in self.redirects:
            h.send_response(302)
            h.send_header("Location", self.redirects[path])
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        tree = re.fullmatch(rf"/api/models/{re.escape(self.repo)}/tree/[^/]+/?", path)
        if tree:
            body = json.dumps([{"type": "file", "path": n, "size": p.stat().st_size, "oid": "0" * 40}
                               for n, p in self.files.items()]).encode()
            h.send_response(200)
            h.send_header("Content-Type", "application/json")
            h.send_header("Content-Length", str(len(body)))
            h.end_headers()
            if not head:
                h.wfile.write(body)
            return
        m = re.fullmatch(rf"/{re.escape(self.repo)}/resolve/[^/]+/(.+)", path) or re.fullmatch(r"/files/(.+)", path)
        if not m or m.group(1) not in self.files:
            h.send_response(404)
            h.send_header("Content-Length", "0")
            h.send_header("X-Error-Code", "EntryNotFound")
            h.end_headers()
            return
        name = m.group(1)
        file = self.files[name]
        size = file.stat().st_size
        start = 0
        rng = h.headers.get("Range")
        if rng:
            start = int(re.fullmatch(r"bytes=(\d+)-", rng).group(1))
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(size - start))
        h.send_header("Accept-Ranges", "bytes")
        if rng:
            h.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        if "/resolve/" in path:
            h.send_header("X-Repo-Commit", COMMIT)
            h.send_header("X-Linked-Etag", f'"{self.sha_override or self.sha256(name)}"')
            h.send_header("X-Linked-Size", str(size))
            h.send_header("ETag", f'"{self.sha_override or self.sha256(name)}"')
        h.end_headers()
        if head:
            return
        if self.hold is not None:
            with self._count_lock:  # handlers run on threads of their own
                self.held += 1
            self.hold.wait()
        limit, self.cut_after = self.cut_after, None
        with open(file, "rb") as f:
            f.seek(start)
            sent = 0
            while True:
                want = 1024 * 1024 if limit is None else min(1024 * 1024, limit - sent)
                if want <= 0:
                    h.close_connection = True
                    h.wfile.flush()
                    h.connection.shutdown(2)  # the cut: the client sees the body end early
                    return
                n = os.sendfile(h.connection.fileno(), f.fileno(), start + sent, want)
                if n == 0:
                    return
                sent += n
                self.sent_bytes += n

    def close(self) -> None:
        """Stop serving (a held download is let go first)."""
        if self.hold is not None:
            self.hold.set()
        self.httpd.shutdown()
        self.httpd.server_close()
