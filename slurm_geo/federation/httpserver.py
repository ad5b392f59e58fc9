"""An HTTP server for the daemon's small JSON service that a crowd of clients cannot starve.

http.server's ThreadingHTTPServer starts a thread per connection, and a thread waits as
long as its client likes: 300 connections that send nothing hold 300 threads, and one
that sends a byte a minute holds its thread for hours. Here, with `Limits`:

- one thread accepts connections and waits, in one selector, for each one's first bytes.
  At most `waiting` connections wait (when more come, the one waiting longest is closed),
  and one still silent after `idle_s` is closed. A silent connection costs a socket, no
  thread.
- A connection with bytes to read goes to a fixed pool of `workers` threads, through a
  queue of at most `queue`; when both are full it is closed at once (the client's next
  renewal tries again) and counted in `refused_busy`.
- A worker has until `deadline_s` after the accept for the TLS handshake and the whole
  request: a client trickling bytes is cut off there. Each receive or send waits at most
  `idle_s`.

Replies are HTTP/1.0, one request per connection, so a worker is free after each reply.
With an `ssl.SSLContext` the server speaks only TLS; the handshake runs in the worker,
never in the accepting thread.
"""

from __future__ import annotations

import io
import logging
import selectors
import socket
import ssl
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger("slurm_geo.federation")

ACCEPTS_PER_ROUND = 64  # then the waiting connections get their turn


@dataclass(frozen=True)
class Limits:
    workers: int = 8          # threads serving requests
    queue: int = 64           # connections with a request, waiting for a worker
    waiting: int = 1024       # accepted connections not yet sending
    idle_s: float = 5.0       # silence allowed before the first byte, and per receive/send
    deadline_s: float = 10.0  # from the accept to the end of the request (TLS included)


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Connection:
    """What a handler is given as its `request`: the socket and when reading must end."""

    sock: socket.socket
    deadline: float  # time.monotonic()
    idle_s: float


class DeadlineHandler(BaseHTTPRequestHandler):
    """A BaseHTTPRequestHandler whose reads end at the connection's deadline; a read past
    it raises TimeoutError, which http.server answers by closing the connection."""

    request: Connection

    def setup(self) -> None:
        connection = self.request
        self.connection = connection.sock
        self.connection.settimeout(connection.idle_s)
        self.rfile = io.BufferedReader(_DeadlineReader(connection))
        self.wfile = self.connection.makefile("wb")


class _DeadlineReader(io.RawIOBase):
    def __init__(self, connection: Connection):
        self._connection = connection

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self._connection.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the request was not read in time")
        sock = self._connection.sock
        sock.settimeout(min(left, self._connection.idle_s))
        return sock.recv_into(buffer)


class BoundedHTTPServer:
    """Serves `handler` (a DeadlineHandler subclass) on (address, port); `serve_forever` on
    a thread of the caller's, `shutdown` from another, then `server_close`."""

    def __init__(self, address: str, port: int, handler: type[DeadlineHandler], *,
                 tls: ssl.SSLContext | None = None, limits: Limits = DEFAULT_LIMITS):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.socket = socket.create_server((address, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()[:2]
        self.handler, self.tls, self.limits = handler, tls, limits
        self.dispatched = 0    # connections handed to the workers
        self.refused_busy = 0  # closed because every worker was busy and the queue full
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="federation-http")
        self._slots = threading.BoundedSemaphore(limits.workers + limits.queue)
        # Accepted, not yet sending, oldest first: socket -> (accepted at, peer address).
        self._waiting: OrderedDict[socket.socket, tuple[float, Any]] = OrderedDict()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()

    # --- the accepting thread -------------------------------------------------------------

    def serve_forever(self) -> None:
        self._idle.clear()
        selector = selectors.DefaultSelector()
        selector.register(self.socket, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in selector.select(self._until_next_expiry()):
                    if key.fileobj is self.socket:
                        self._accept(selector)
                    elif key.fileobj in self._waiting:  # not closed by _accept meanwhile
                        self._dispatch(selector, key.fileobj)  # type: ignore[arg-type]
                self._expire(selector)
        finally:
            for sock in self._waiting:
                sock.close()
            self._waiting.clear()
            selector.close()
            self._idle.set()

    def _accept(self, selector: selectors.BaseSelector) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the others go on
                log.warning("event=http_accept_failed error=%r", str(exc))
                return
            if len(self._waiting) >= self.limits.waiting:
                oldest, _ = self._waiting.popitem(last=False)
                selector.unregister(oldest)
                oldest.close()
            sock.setblocking(False)
            self._waiting[sock] = (time.monotonic(), address)
            selector.register(sock, selectors.EVENT_READ)

    def _dispatch(self, selector: selectors.BaseSelector, sock: socket.socket) -> None:
        selector.unregister(sock)
        accepted_at, address = self._waiting.pop(sock)
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            sock.close()
            return
        self.dispatched += 1
        self._pool.submit(self._serve, sock, address, accepted_at + self.limits.deadline_s)

    def _expire(self, selector: selectors.BaseSelector) -> None:
        silent_since = time.monotonic() - self.limits.idle_s
        while self._waiting:
            sock, (accepted_at, _) = next(iter(self._waiting.items()))
            if accepted_at > silent_since:
                return
            del self._waiting[sock]
            selector.unregister(sock)
            sock.close()

    def _until_next_expiry(self) -> float | None:
        if not self._waiting:
            return None
        accepted_at, _ = next(iter(self._waiting.values()))
        return max(0.0, accepted_at + self.limits.idle_s - time.monotonic())

    # --- a worker ---------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, address: Any, deadline: float) -> None:
        try:
            if self.tls is not None:
                sock = _handshake(self.tls, sock, deadline)
            sock.settimeout(self.limits.idle_s)
            self.handler(Connection(sock, deadline, self.limits.idle_s),  # type: ignore[arg-type]
                         address, self)  # type: ignore[arg-type]
        except (OSError, ValueError) as exc:  # a client gone, slow, or not speaking TLS
            log.debug("http connection from %s ended: %s", address, exc)
        except Exception:  # a bug must cost one request, not a worker
            log.exception("event=http_request_crashed")
        finally:
            _close(sock)
            self._slots.release()

    # --- stopping ----------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop `serve_forever` and wait until it has returned."""
        self._stop.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._idle.wait()

    def server_close(self) -> None:
        self.socket.close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _handshake(context: ssl.SSLContext, sock: socket.socket, deadline: float
               ) -> ssl.SSLSocket:
    """The server side of a TLS handshake, done by `deadline` or abandoned (TimeoutError)."""
    sock.setblocking(False)
    tls = context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
    try:
        with selectors.DefaultSelector() as selector:
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    event = selectors.EVENT_READ
                except ssl.SSLWantWriteError:
                    event = selectors.EVENT_WRITE
                left = deadline - time.monotonic()
                selector.register(tls, event)
                ready = left > 0 and selector.select(left)
                selector.unregister(tls)
                if not ready:
                    raise TimeoutError("the TLS handshake did not end in time")
    except BaseException:
        tls.close()
        raise
    tls.setblocking(True)
    return tls


def _close(sock: socket.socket) -> None:
    """Close after sending what is sent: SHUT_WR first, as socketserver does, so unread
    request bytes do not reset the connection under the reply."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
