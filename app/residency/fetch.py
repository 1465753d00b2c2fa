"""The network side of a pull: which hosts it may reach, requests connected only to the address that
was checked, URLs redacted for display, and PullError, the one error a pull ends with.

A pull reaches public hosts only: on every hop (the first request and each redirect) the host is
resolved here, every address it has is checked, and the connection goes to an address that was
checked (a second lookup could answer otherwise: DNS rebinding). Private, loopback, link-local,
CGNAT, multicast, unspecified and reserved addresses (IPv4 inside IPv6 judged as IPv4) are refused
before a byte is sent to them — a model source must not be a way to probe the household's router —
unless the admin allows the host in `pull_allowed_hosts` (a LAN mirror); the Hugging Face endpoint
the admin set is allowed too. URLs are shown and logged with their credentials and query values as
*** (signed CDN links carry tokens); PullError redacts its message once, for every caller.
"""

from __future__ import annotations

import base64
import http.client
import re
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

from app.netguard import (  # noqa: F401  (address_kind and IpAddress: this module's names since before the move)
    AddressRefused,
    HostPolicy,
    IpAddress,
    PinnedHTTPConnection,
    PinnedHTTPSConnection,
    address_kind,
)

READ_TIMEOUT_S = 60.0
MAX_REDIRECTS = 5
ALLOW_SETTING = "pull_allowed_hosts"
# Why a pull ended otherwise than done: the API answers each with its own HTTP status.
PULL_CODES = ("bad_source", "not_found", "host_refused", "exists", "busy", "disk_full", "read_only",
              "unservable", "upstream", "mismatch", "write_failed", "cut")


# -- redaction -------------------------------------------------------------------------------------

_URL_IN_TEXT = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """`url` with its credentials, query values and any fragment but `sha256=` as ***: host and path stay."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unreadable URL>"
    if not parts.scheme or not parts.netloc:
        return url
    netloc = parts.netloc
    if "@" in netloc:
        netloc = "***@" + netloc.rpartition("@")[2]
    query = "&".join(f"{key}=***" if sep else "***"
                     for key, sep, _ in (piece.partition("=") for piece in parts.query.split("&") if piece))
    fragment = parts.fragment if not parts.fragment or _SHA256_FRAGMENT.match(parts.fragment) else "***"
    return urlunsplit((parts.scheme, netloc, parts.path, query, fragment))


_SHA256_FRAGMENT = re.compile(r"^sha256=[0-9a-fA-F]{64}$")


def redact(text: str) -> str:
    """`text` with every URL in it redacted (error messages quote the URL they failed on)."""
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


class PullError(Exception):
    """A pull that cannot go on; `refused` when it was stopped by a check rather than a failure.

    `code` (one of PULL_CODES) says why, for the API's status; `discard` deletes the part file (a
    model refused from its header), otherwise what was downloaded stays to be resumed. The message
    is redacted here, once, so no caller can show or log a signed URL.
    """

    def __init__(self, message: str, refused: bool = False, code: str = "upstream", discard: bool = False):
        super().__init__(redact(message))
        self.refused = refused
        self.code = code
        self.discard = discard


# -- which hosts a pull may reach ------------------------------------------------------------------

# The policy and the checked connections are app.netguard's, shared with the runner's image URLs.


def allowed_hosts_problem(text: str) -> str | None:
    """The problem with a pull_allowed_hosts value, or None (the setting's check)."""
    try:
        HostPolicy.parse(text)
    except ValueError as exc:
        return str(exc)
    return None

# -- requests ---------------------------------------------------------------------------------------


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


def _basic_auth(url: str) -> str | None:
    """The Authorization header of a URL's user:password@ (sent to that URL's origin only)."""
    parts = urlsplit(url)
    if parts.username is None:
        return None
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode()
    return "Basic " + base64.b64encode(pair).decode()


def open_url(url: str, headers: dict[str, str], hosts: HostPolicy,
          method: str = "GET") -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A request on `url`, following redirects (a hub's CDN), each hop's host checked against `hosts`
    and connected at the address checked; with the response's headers read."""
    first, auth = url, _basic_auth(url)
    for _ in range(MAX_REDIRECTS + 1):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PullError(f"{url} is not an http(s) URL: pulls follow http and https only", refused=True,
                            code="bad_source")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            addresses = hosts.connect_addresses(parts.hostname, port)
        except AddressRefused as exc:
            raise PullError(f"refused to connect to {exc.host} ({exc.ip}, a {exc.kind} address): pulls reach public "
                            f"hosts only, so a model source cannot reach into the household's network; to pull from a "
                            f"LAN mirror the admin adds it to the setting {ALLOW_SETTING}", refused=True,
                            code="host_refused")
        conn_class = PinnedHTTPSConnection if parts.scheme == "https" else PinnedHTTPConnection
        conn = conn_class(parts.hostname, port, addresses, timeout=READ_TIMEOUT_S)
        sent = {"User-Agent": "hearth-library", "Accept-Encoding": "identity", **headers}
        if auth and _origin(url) == _origin(first):
            sent["Authorization"] = auth
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request(method, target, headers=sent)
            resp = conn.getresponse()
        except BaseException:
            conn.close()
            raise
        if resp.status in (301, 302, 303, 307, 308) and resp.getheader("Location"):
            conn.close()  # a redirect's body is not read: the next hop is checked before anything is sent to it
            url = urljoin(url, resp.getheader("Location"))
            continue
        return conn, resp
    raise PullError(f"more than {MAX_REDIRECTS} redirects from {first}", code="upstream")
