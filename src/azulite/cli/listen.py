"""The listening flags shared by ``serve``, ``observe`` and ``dashboard``: a port out of range, an address that
does not resolve, and a bind refused (taken, or not this machine's) are said naming their flag and a fix,
before anything starts, instead of as socket tracebacks."""

from __future__ import annotations

import socket
from typing import Callable, TypeVar

from azulite.errors import AzuliteError, SpecError

T = TypeVar("T")


def check_port(port: int, flag: str) -> None:
    if not 0 <= port <= 65535:
        raise SpecError(f"{port} is not a port (0-65535)", field=flag, fix=f"e.g. {flag} 0 (any free port)")


def check_address(address: str, flag: str) -> None:
    """An address that does not resolve would fail at bind with "Name or service not known" and a fix about
    ports; said here, naming its flag."""
    if not address:  # asyncio's "every interface"
        return
    try:
        socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise SpecError(f"cannot listen on {address!r}: {exc}", field=flag,
                        fix=f"give an address of this machine, e.g. {flag} 127.0.0.1 (this machine only) or "
                            "0.0.0.0 (every interface)") from None


def listen(open_listener: Callable[[], T], host: str, port: int, *, host_flag: str = "--host",
           port_flag: str = "--port") -> T:
    """``open_listener()`` after checking the flags; a bind it cannot make (the port taken, an address not
    this machine's) as an error naming both flags."""
    check_port(port, port_flag)
    check_address(host, host_flag)
    try:
        return open_listener()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise AzuliteError(f"cannot listen on {host}:{port}: {reason}", where=f"{host_flag} {host} {port_flag} {port}",
                           fix=f"{port_flag} 0 picks any free port; {host_flag} must be an address of this machine "
                               "(127.0.0.1, 0.0.0.0)") from None
