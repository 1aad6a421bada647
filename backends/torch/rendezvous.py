"""Where the ranks of a run meet: the rendezvous endpoint, the socket its store listens on, and which
network interface the ranks' own sockets use.

Without `--rdzv-endpoint` everything stays on loopback (static rendezvous, a free port); with one,
node 0 hosts the store there and the listeners bind the address this machine reaches it from (or
`--listen-host`). Node 0 binds the store's socket before any process starts (`listen`): a port in use
is refused at once, and no other program can take the port between a check and its use.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass

from dapple_ir.errors import DappleError


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Endpoint:
    """Where the rendezvous store listens (`host`:`port`) and which address this node's listeners bind."""

    host: str
    port: int
    listen_host: str
    given: bool
    """Whether the user gave the endpoint (`--rdzv-endpoint`): c10d rendezvous, else static on loopback."""

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def resolve_endpoint(rdzv_endpoint: str | None, listen_host: str | None) -> Endpoint:
    """The rendezvous endpoint and listen address of a run (loopback unless told otherwise)."""
    if not rdzv_endpoint:
        return Endpoint("127.0.0.1", 0, listen_host or "127.0.0.1", False)
    host, _, port = rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DappleError(f"rendezvous endpoint '{rdzv_endpoint}' is not HOST:PORT (a port from 1 to 65535)")
    return Endpoint(host, int(port), listen_host or _address_towards(host, int(port)), True)


def _address_towards(host: str, port: int) -> str:
    """The address of this machine that packets to `host` leave from: where the other nodes reach it."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))  # UDP: chooses a route, sends nothing
            return str(s.getsockname()[0])
    except OSError as exc:
        raise DappleError(
            f"cannot reach the rendezvous host {host} ({exc.strerror or exc}); check --rdzv-endpoint, or give "
            "the address to listen on with --listen-host"
        ) from None


def listen(endpoint: Endpoint) -> socket.socket:
    """Node 0's rendezvous store socket, bound and listening before any process starts (no port race)."""
    try:
        infos = socket.getaddrinfo(endpoint.listen_host, endpoint.port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise DappleError(f"listen host '{endpoint.listen_host}' does not resolve ({exc.strerror})") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise DappleError(
                f"port {endpoint.port} of the rendezvous endpoint {endpoint} is already in use on "
                f"{endpoint.listen_host} (another run or program holds it); pick another port, or leave out "
                "--rdzv-endpoint to use a free one on loopback"
            ) from None
        raise DappleError(
            f"cannot listen on {endpoint.listen_host}:{endpoint.port} for the rendezvous ({exc.strerror}): "
            "is it an address of this machine? Give one with --listen-host"
        ) from None
    return sock


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]
    return min(names, key=len) if names else None
