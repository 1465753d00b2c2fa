"""The client's connection under gunicorn, as the gateway and the runner both look at it."""

from __future__ import annotations

import select
import socket


def client_gone(environ) -> bool:
    """True when the client closed its connection: readable and at EOF, seen without blocking or consuming data.

    A request with no gunicorn socket (a test's WSGI call) has a client that never goes away."""
    sock = environ.get("gunicorn.socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        if not readable:
            return False
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except (OSError, ValueError):  # reset, or a socket already closed (fileno -1)
        return True


def no_delay(listeners) -> None:
    """TCP_NODELAY on gunicorn's listeners (accepted sockets inherit it): a streamed token is one small
    write, and Nagle's algorithm would hold it back waiting for the previous write's ACK."""
    for listener in listeners:
        sock = getattr(listener, "sock", None)
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
