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
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

CONNECT_TIMEOUT_S = 15.0
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

_CGNAT = ipaddress.ip_network("100.64.0.0/10")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_HOST_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*$")
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


def address_kind(ip: IpAddress) -> str | None:
    """What kind of non-public address `ip` is ("loopback", "private", …), None for a public one.
    IPv4 written inside IPv6 (::ffff:a.b.c.d, 6to4, NAT64) is judged by its IPv4 address."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour or (
            ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF) if ip in _NAT64 else None)
        if embedded is not None:
            kind = address_kind(embedded)
            if kind is not None or ip.ipv4_mapped is not None:
                return kind
    if ip.is_unspecified:
        return "unspecified"
    if ip.is_loopback:
        return "loopback"
    if ip.is_link_local:
        return "link-local"
    if ip.is_multicast:
        return "multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip in _CGNAT:
        return "carrier-grade NAT (100.64.0.0/10)"
    if ip.is_private:
        return "private"
    if ip.is_reserved or not ip.is_global:
        return "reserved"
    return None


def _plain(ip: IpAddress) -> IpAddress:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    return ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped else ip


@dataclass(frozen=True)
class HostPolicy:
    """The hosts a pull may connect to: every public address, plus the host names and networks an admin allowed."""

    names: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> HostPolicy:
        """The policy of a pull_allowed_hosts value (names, addresses, CIDR networks; commas or spaces);
        ValueError naming the first entry that is none of them."""
        names, networks = set(), []
        for item in re.split(r"[,\s]+", (text or "").strip()):
            if not item:
                continue
            bare = item.removeprefix("[").removesuffix("]") if item.startswith("[") else item
            try:
                networks.append(ipaddress.ip_network(bare, strict=False))
                continue
            except ValueError:
                pass
            name = item.lower().rstrip(".")
            if not _HOST_NAME.match(name) or name.replace(".", "").isdigit():
                raise ValueError(f"'{item}' is not a host name, an address or a network: write e.g. mirror.lan, "
                                 "192.168.1.20 or 192.168.1.0/24 (no port, no scheme), comma-separated")
            names.add(name)
        return cls(frozenset(names), tuple(networks))

    def with_endpoint(self, endpoint: str | None) -> HostPolicy:
        """This policy, also allowing the host of the Hugging Face endpoint the admin set (a mirror)."""
        host = urlsplit(endpoint).hostname if endpoint else None
        if not host:
            return self
        try:
            return HostPolicy(self.names, self.networks + (ipaddress.ip_network(host),))
        except ValueError:
            return HostPolicy(self.names | {host.lower().rstrip(".")}, self.networks)

    def allows(self, host: str, ip: IpAddress) -> bool:
        """Whether `host` at `ip` may be connected to: a public address, an allowed name or an allowed network."""
        ip = _plain(ip)
        if address_kind(ip) is None or host.lower().rstrip(".") in self.names:
            return True
        return any(ip.version == net.version and ip in net for net in self.networks)

    def connect_addresses(self, host: str, port: int) -> list[str]:
        """The addresses to connect to for `host`, in the resolver's order: resolved once here and checked,
        so the connection goes where the check looked. PullError (refused) when none may be reached."""
        literal = host.removeprefix("[").removesuffix("]")
        allowed, refused = [], []
        for *_, sockaddr in socket.getaddrinfo(literal, port, type=socket.SOCK_STREAM):
            address = sockaddr[0]
            ip = ipaddress.ip_address(address.split("%", 1)[0])
            if self.allows(host, ip):
                allowed.append(address)
            else:
                refused.append((_plain(ip), address_kind(_plain(ip))))
        if allowed:
            return allowed
        if not refused:
            raise OSError(f"{host} has no address")
        ip, kind = refused[0]
        raise PullError(f"refused to connect to {host} ({ip}, a {kind} address): pulls reach public hosts only, so a "
                        f"model source cannot reach into the household's network; to pull from a LAN mirror the "
                        f"admin adds it to the setting {ALLOW_SETTING}", refused=True, code="host_refused")


def allowed_hosts_problem(text: str) -> str | None:
    """The problem with a pull_allowed_hosts value, or None (the setting's check)."""
    try:
        HostPolicy.parse(text)
    except ValueError as exc:
        return str(exc)
    return None

# -- requests ---------------------------------------------------------------------------------------


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to one of `addresses`, those checked for its host (the Host header still names the host)."""

    def __init__(self, host: str, port: int, addresses: list[str], **kwargs):
        super().__init__(host, port, **kwargs)
        self._addresses = addresses
        # HTTPConnection.connect (and HTTPSConnection's, before it wraps the socket for `host`) opens
        # its socket through this attribute: only an address that was checked is connected to.
        self._create_connection = self._connect_checked

    def _connect_checked(self, host_port, timeout, source_address):
        error: OSError | None = None
        for address in self._addresses:  # as socket.create_connection tries a name's addresses in turn
            try:
                sock = socket.create_connection((address, host_port[1]), CONNECT_TIMEOUT_S, source_address)
            except OSError as exc:
                error = exc
                continue
            sock.settimeout(timeout)
            return sock
        raise error or OSError(f"no address to connect to for {self.host}")


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection to one of `addresses`; the certificate is checked against the host name, as usual."""

    def __init__(self, host: str, port: int, addresses: list[str], **kwargs):
        super().__init__(host, port, **kwargs)
        self._addresses = addresses
        self._create_connection = self._connect_checked

    _connect_checked = _PinnedHTTPConnection._connect_checked


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
        addresses = hosts.connect_addresses(parts.hostname, port)
        conn_class = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
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
