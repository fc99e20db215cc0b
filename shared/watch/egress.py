"""Where the server may send a request of its own: the one outgoing-request policy (OWASP's SSRF rules),
used by every sender of alerts (the deliver function on AWS, the local stack's delivery worker).

A webhook's URL is chosen by whoever holds a project's token, and the server POSTs to it from where it
runs: next to the Lambda runtime API and the cloud's metadata and credentials service, and, in a VPC,
next to private services. So an address is checked, not its spelling:

- ``refusal(address)``: why a request must not go to an address, or None. Never: link-local (all of
  169.254.0.0/16 and fe80::/10, where the metadata and credentials services live; ``fd00:ec2::254``,
  EC2's IPv6 metadata), unspecified, multicast, broadcast and reserved addresses. Loopback and private
  addresses (RFC 1918, fc00::/7, shared and benchmarking ranges) only where the deployment lists them
  (``WEBHOOK_ALLOWED_NETWORKS``: CIDRs, or ``loopback`` / ``private``); the public internet always.
  An IPv6 address that carries an IPv4 one (IPv4-mapped or -compatible, 6to4, NAT64) is judged by it.
- ``url_refusal(url)``: what can be told from the URL alone (its host spelled as an address in any
  form ``inet_aton`` takes, decimal, octal, hex and short forms too, or a name that means this machine
  or the metadata service), for ``PUT .../alerts`` to answer 400 at once.
- ``open_pinned(url)``: the host resolved once, every address checked, and the connection made to the
  address that was checked (no second lookup, so no DNS rebinding), with TLS verified for the URL's
  host name. ``http.client`` never follows a redirect and never reads proxy variables; the senders
  treat a 3xx as a failed delivery.

Standard library only (the deliver function loads no numpy or pydantic).
"""

from __future__ import annotations

import http.client
import ipaddress
import os
import socket
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeAlias
from urllib.parse import urlsplit

Address: TypeAlias = ipaddress.IPv4Address | ipaddress.IPv6Address
Network: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network
#: host, port -> the addresses it resolves to (``socket.getaddrinfo``'s, or a test's).
Resolver: TypeAlias = Callable[[str, int], list[str]]

#: The deployment's networks a webhook may reach beyond the public internet (template.yaml's
#: ``WebhookAllowedNetworks`` on AWS, none by default; ``instantml local`` allows loopback and private).
ALLOWED_ENV = "WEBHOOK_ALLOWED_NETWORKS"
LOCAL_DEFAULT = "loopback,private"

_METADATA = (ipaddress.ip_address("fd00:ec2::254"),)
_NAMED = {
    "loopback": ("127.0.0.0/8", "::1/128"),
    "private": ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "fc00::/7"),
}
#: Names that mean this machine or a cloud's metadata service whatever DNS says.
_LOCAL_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")
_METADATA_NAMES = ("metadata", "metadata.google.internal", "instance-data", "instance-data.ec2.internal")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPATIBLE = ipaddress.ip_network("::/96")


class Refused(Exception):
    """The policy forbids this request; the message says why (never the URL: it is a secret)."""


class Unresolved(Exception):
    """The host name gives no address now (DNS may answer later: a failed delivery, retried)."""


@dataclass(frozen=True)
class Policy:
    """The networks allowed beyond the public internet (never link-local, metadata or reserved)."""

    allowed: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, text: str) -> Policy:
        """``"loopback,private,10.1.0.0/16"``; ValueError names an entry that is neither."""
        networks: list[Network] = []
        for entry in (e.strip() for e in text.split(",")):
            if not entry:
                continue
            for cidr in _NAMED.get(entry, (entry,)):
                try:
                    networks.append(ipaddress.ip_network(cidr, strict=False))
                except ValueError:
                    raise ValueError(
                        f"{ALLOWED_ENV}: {entry!r} is neither a CIDR nor 'loopback' or 'private'"
                    ) from None
        return cls(tuple(networks))

    @classmethod
    def from_environment(cls) -> Policy:
        return cls.parse(os.environ.get(ALLOWED_ENV, ""))

    def refusal(self, address: Address) -> str | None:
        """Why a request must not go to ``address``; None when it may."""
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            why = self.refusal(embedded)
            return None if why is None else f"{address} carries the IPv4 address {embedded}: {why}"
        if address in _METADATA or address.is_link_local:
            return f"{address} is link-local, where the cloud's metadata and credentials services answer"
        if address.is_unspecified or address.is_multicast:
            return f"{address} is an unspecified or multicast address"
        if address.is_reserved and not address.is_loopback:  # (IPv4 broadcast is reserved; ::1 in ::/8)
            return f"{address} is a reserved address"
        if address.is_global:
            return None
        if any(address.version == n.version and address in n for n in self.allowed):
            return None
        kind = "loopback" if address.is_loopback else "private or otherwise not public"
        return f"{address} is {kind}, and this deployment allows no such target (see {ALLOWED_ENV})"

    def url_refusal(self, url: str) -> str | None:
        """Why ``url`` can be refused from its spelling alone; None when only a lookup can tell."""
        host = (urlsplit(url).hostname or "").rstrip(".").lower()
        address = literal_address(host)
        if address is not None:
            return self.refusal(address)
        return self._name_refusal(host)

    def _name_refusal(self, host: str) -> str | None:
        """Names that mean this machine or a metadata service whatever a resolver says."""
        if host in _METADATA_NAMES:
            return f"{host} names a cloud's metadata service"
        if host in _LOCAL_NAMES or host.endswith(".localhost"):
            return self.refusal(ipaddress.ip_address("127.0.0.1"))
        return None

    def check(self, host: str, port: int, resolve: Resolver | None = None) -> Address:
        """The address to connect to: ``host`` resolved once, every address it gives checked (one
        forbidden address refuses them all: a name that also points inward is not a webhook)."""
        host = host.rstrip(".").lower()  # "169.254.169.254." is that address, "LOCALHOST" that name
        named = self._name_refusal(host)
        if named is not None:
            raise Refused(f"the webhook's host {named}")
        literal = literal_address(host)
        found = [literal] if literal is not None else [_parse(a) for a in (resolve or _resolve)(host, port)]
        if not found:
            raise Unresolved("the webhook's host name resolves to no address")
        for address in found:
            why = self.refusal(address)
            if why is not None:
                raise Refused(f"the webhook's host resolves to {why}")
        return found[0]


def literal_address(host: str) -> Address | None:
    """``host`` as an address when it is one in any spelling a resolver takes (``2852039166``,
    ``0251.0376.0251.0376``, ``0xa9fea9fe``, ``169.254.43518``, ``[::ffff:a9fe:a9fe]``); None for a name."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host.split("%")[0])  # an IPv6 zone (fe80::1%eth0) is no disguise
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefx." for c in host.lower()):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _embedded_ipv4(address: Address) -> ipaddress.IPv4Address | None:
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in _NAT64 or (address in _COMPATIBLE and int(address) > 1):
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


def _parse(text: str) -> Address:
    return ipaddress.ip_address(text.split("%")[0])


def _resolve(host: str, port: int) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise Unresolved(f"the webhook's host name does not resolve ({type(exc).__name__})") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def open_pinned(
    url: str, timeout: float, policy: Policy, resolve: Resolver | None = None
) -> tuple[http.client.HTTPConnection, str]:
    """A connection for ``url`` to the address ``policy`` checked, and the request target (path and
    query). ``Refused`` when the policy forbids it, ``Unresolved`` when the name gives no address now;
    ValueError for a URL that is not http(s)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    address = policy.check(parts.hostname, port, resolve)
    connection: http.client.HTTPConnection
    if parts.scheme == "https":
        connection = http.client.HTTPSConnection(
            parts.hostname, port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        connection = http.client.HTTPConnection(parts.hostname, port, timeout=timeout)
    # Connect to the checked address; the Host header and TLS (SNI, the certificate's name) keep the
    # URL's host name.
    connection._create_connection = _pinned(str(address))  # type: ignore[attr-defined]
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return connection, target


def _pinned(address: str) -> Callable[..., socket.socket]:
    def create(where: tuple[str, int], timeout: float, source: object = None) -> socket.socket:
        return socket.create_connection((address, where[1]), timeout)

    return create
