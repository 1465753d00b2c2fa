"""Connections only to hosts a policy allows, at the address that was checked: what keeps a URL named by someone
else (a model source, an image in a prompt) from reaching into the household's network.

The host is resolved here, every address it has is checked, and the connection goes to an address that was
checked (a second lookup could answer otherwise: DNS rebinding). Private, loopback, link-local (the cloud
metadata address 169.254.169.254 among them), CGNAT, multicast, unspecified and reserved addresses (IPv4
inside IPv6 judged as IPv4) are refused before a byte is sent to them, unless the admin allowed the host.
Used by the model library's pulls (app.residency.fetch) and the runner's image URLs (app.runner.images).
"""

from __future__ import annotations

import http.client
import ipaddress
import re
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 15.0


class AddressRefused(Exception):
    """Every address of a host is one the policy refuses; `ip` and `kind` name the first."""

    def __init__(self, host: str, ip, kind: str | None):
        super().__init__(f"{host} resolves to {ip}, a {kind} address")
        self.host = host
        self.ip = ip
        self.kind = kind


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
    """The hosts a fetch may connect to: every public address, plus the host names and networks an admin allowed."""

    names: frozenset[str] = frozenset()
    networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()

    @classmethod
    def parse(cls, text: str | None) -> HostPolicy:
        """The policy of an allowed-hosts setting's value (names, addresses, CIDR networks; commas or spaces);
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
        so the connection goes where the check looked. AddressRefused when none may be reached."""
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
        raise AddressRefused(host, ip, kind)



class PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to one of `addresses`, those checked for its host (the Host header still names the host)."""

    def __init__(self, host: str, port: int, addresses: list[str], connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 **kwargs):
        super().__init__(host, port, **kwargs)
        self._addresses = addresses
        self.connect_timeout_s = connect_timeout_s
        # HTTPConnection.connect (and HTTPSConnection's, before it wraps the socket for `host`) opens
        # its socket through this attribute: only an address that was checked is connected to.
        self._create_connection = self._connect_checked

    def _connect_checked(self, host_port, timeout, source_address):
        error: OSError | None = None
        for address in self._addresses:  # as socket.create_connection tries a name's addresses in turn
            try:
                sock = socket.create_connection((address, host_port[1]), self.connect_timeout_s, source_address)
            except OSError as exc:
                error = exc
                continue
            sock.settimeout(timeout)
            return sock
        raise error or OSError(f"no address to connect to for {self.host}")


class PinnedHTTPSConnection(http.client.HTTPSConnection):
    """An HTTPS connection to one of `addresses`; the certificate is checked against the host name, as usual."""

    def __init__(self, host: str, port: int, addresses: list[str], connect_timeout_s: float = CONNECT_TIMEOUT_S,
                 **kwargs):
        super().__init__(host, port, **kwargs)
        self._addresses = addresses
        self.connect_timeout_s = connect_timeout_s
        self._create_connection = self._connect_checked

    _connect_checked = PinnedHTTPConnection._connect_checked
