"""Addresses, for the launchers and the ranks alike (a leaf, torch-free): endpoint parsing, loopback or not,
"is this endpoint me?", the route to it, reachability.

In two network namespaces (10.x addresses over a veth pair) torchrun's own guesses failed: the endpoint's node
did not recognise the address as its own, and workers advertised a hostname the other node could not reach.
These helpers answer both questions from the routing table instead.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time
from dataclasses import dataclass

from ddp_amp.errors import UsageError

DEFAULT_PORT = 29400


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_endpoint(text: str | None, flag: str = "--endpoint") -> Endpoint:
    """host:port, host (port 29400), 1.2.3.4:port or [v6::addr]:port; None: the flag was not given."""
    if text is None:
        raise UsageError(f"{flag} is required: host:port of the node that hosts the rendezvous, "
                         f"e.g. node0:{DEFAULT_PORT}")
    if not text:
        raise UsageError(f"{flag} is empty; expected host:port, e.g. node0:{DEFAULT_PORT}")
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise UsageError(f"{flag} {text!r}: unclosed '[' in an IPv6 address; expected [addr]:port")
        host, rest = text[1:close], text[close + 1:]
        if rest and not rest.startswith(":"):
            raise UsageError(f"{flag} {text!r}: expected [addr]:port")
        port_text = rest[1:] if rest else None
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise UsageError(f"{flag} {text!r}: {host!r} is not an IPv6 address") from None
    elif text.count(":") > 1:
        raise UsageError(f"{flag} {text!r}: write an IPv6 address in brackets, e.g. [{text}]:{DEFAULT_PORT}")
    else:
        host, sep, port_text = text.partition(":")
        port_text = port_text if sep else None
    if not host:
        raise UsageError(f"{flag} {text!r} has no host; expected host:port")
    if port_text is None:
        return Endpoint(host, DEFAULT_PORT)
    if not (port_text.isascii() and port_text.isdigit()):  # not "²" (int() refuses it) nor "٣" (int() takes it)
        raise UsageError(f"{flag} {text!r}: port {port_text!r} is not a number from 1 to 65535")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise UsageError(f"{flag} {text!r}: port {port} is not in 1..65535")
    return Endpoint(host, port)


def resolve(endpoint: Endpoint, flag: str = "--endpoint") -> list[str]:
    """The endpoint's IP addresses; a name that does not resolve is a usage error."""
    try:
        infos = socket.getaddrinfo(endpoint.host, endpoint.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UsageError(f"{flag} {endpoint}: host {endpoint.host!r} does not resolve ({exc.strerror}); "
                         "check the name or use an IP address") from None
    return list(dict.fromkeys(info[4][0] for info in infos))


def _family(address: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def is_loopback(address: str, *, resolve: bool = False) -> bool:
    """Whether `address` is this machine's loopback: an IP literal (an IPv6 zone ignored) or "localhost". With
    `resolve`, a host name counts by what it resolves to here (as --local-addr may be one); without, any other
    name is not loopback (a rank deciding where to serve its store resolves nothing)."""
    try:
        return ipaddress.ip_address(address.split("%")[0]).is_loopback
    except ValueError:
        pass
    if not resolve:
        return address == "localhost"
    try:
        return ipaddress.ip_address(socket.gethostbyname(address)).is_loopback
    except OSError:
        return False


def is_local_address(address: str) -> bool:
    """True if this machine owns `address`: binding to it succeeds only for local addresses."""
    try:
        with socket.socket(_family(address), socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def route_source_address(address: str, port: int) -> str:
    """The local address the kernel would use to reach `address` (a UDP connect sends no packet)."""
    with socket.socket(_family(address), socket.SOCK_DGRAM) as probe:
        probe.connect((address, port))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface holding an IPv4 `address` (for GLOO_SOCKET_IFNAME), if it can be found."""
    if _family(address) != socket.AF_INET:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(probe.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # an interface without an IPv4 address
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def wait_until_reachable(address: str, port: int, timeout_s: float) -> bool:
    """Retry a TCP connect until it succeeds or `timeout_s` passes (the host node may start a little later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            with socket.create_connection((address, port), timeout=min(2.0, remaining)):
                return True
        except OSError:
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
