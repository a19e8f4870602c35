"""Where this host is on the network: its address toward the controller, and which
interface that is.

A job that spans hosts never uses 127.0.0.1 for anything another host must reach: the
node agents, the controller's report and join server, the rendezvous (``MASTER_ADDR``),
the memory tier's replicas and checkpointless state transfer all use the address of the
interface that routes to the controller (:func:`route_to`), and the workers'
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name that interface unless the user set
them (gloo otherwise resolves the hostname, which a hosts file may map to loopback).
Linux only (``SIOCGIFADDR``), stdlib only.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass

__all__ = [
    "JobEndpoint",
    "LocalAddress",
    "interface_of",
    "is_local",
    "parse_endpoint",
    "route_to",
]

_SIOCGIFADDR = 0x8915


@dataclass(frozen=True)
class JobEndpoint:
    """``HOST:PORT`` as given to ``--rdzv-endpoint``."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class LocalAddress:
    """This host's address toward a peer, and the interface it is on."""

    addr: str
    ifname: str | None


def parse_endpoint(text: str, default_port: int = 29500) -> JobEndpoint:
    """``HOST[:PORT]`` (torchrun's ``--rdzv-endpoint``; ``[v6]:PORT`` for IPv6); ValueError
    naming what is wrong."""
    text = text.strip()
    if not text:
        raise ValueError("expected HOST:PORT, got an empty value")
    host, port_text = text, ""
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"expected [IPv6]:PORT, got {text!r}")
        host, rest = text[1:end], text[end + 1 :]
        port_text = rest[1:] if rest.startswith(":") else rest
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    if not host:
        raise ValueError(f"expected HOST:PORT, got {text!r}")
    if not port_text:
        return JobEndpoint(host, default_port)
    if not port_text.isdigit() or not 0 < int(port_text) <= 65535:
        raise ValueError(f"{port_text!r} is not a port number (in {text!r})")
    return JobEndpoint(host, int(port_text))


def resolve(host: str) -> str:
    """``host``'s address (the first the resolver gives); OSError when it has none."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return str(infos[0][4][0])


def route_to(host: str, port: int = 9) -> LocalAddress:
    """The address this host sends from to reach ``host`` (the kernel's route, found by
    connecting a UDP socket: nothing is sent), and its interface."""
    addr = resolve(host)
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((addr, port))
        local = str(s.getsockname()[0])
    return LocalAddress(local, interface_of(local))


def interface_of(addr: str) -> str | None:
    """The name of the interface holding IPv4 ``addr`` (None: none, or IPv6)."""
    if ":" in addr:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(reply[20:24]) == addr:
                return name
    return None


def is_local(host: str) -> bool:
    """Whether ``host`` names this machine: an address one of its interfaces holds (a
    loopback address included). False when it does not resolve."""
    try:
        addr = resolve(host)
    except OSError:
        return False
    if ipaddress.ip_address(addr).is_loopback:
        return True
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))  # only an address of this host can be bound
        except OSError:
            return False
    return True
