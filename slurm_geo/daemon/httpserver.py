"""An HTTP server for the daemon's small JSON service that a crowd of clients cannot starve.

http.server's ThreadingHTTPServer starts a thread per connection, and a thread waits as
long as its client likes: 300 connections that send nothing hold 300 threads, and one
that sends a byte a minute holds its thread for hours. Here, with `Limits`:

- One thread accepts connections and reads them, all at once in one selector, without
  blocking: the TLS handshake, then the request head and its body (Content-Length). A
  connection costs a socket and a buffer until its request is complete, never a thread.
  At most `waiting` connections are being read; when more come, the one accepted first
  is closed. A connection silent for `idle_s`, or not done `deadline_s` after its accept
  (a client trickling bytes), is closed.
- A complete request goes to a fixed pool of `workers` threads, through a queue of at
  most `queue`; when both are full the connection is closed at once (the client's next
  renewal tries again) and counted in `refused_busy`. A worker runs the handler on the
  request already read and sends the reply, each send waiting at most `idle_s`.

Replies are HTTP/1.0, one request per connection. The handler is a BaseHTTPRequestHandler
(`PrereadHandler`) whose rfile is the request as read, so http.server still parses it.
"""

from __future__ import annotations

import io
import logging
import math
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger("slurm_geo.federation")

ACCEPTS_PER_ROUND = 64     # then the connections being read get their turn
MAX_HEAD_BYTES = 32 * 1024  # a longer head is handed over as read (http.server refuses it)
RECV_BYTES = 16 * 1024     # so a connection buffers at most 128 KiB (docs/security.md)
TICK_S = 0.25               # how often deadlines are looked at while connections are read
ACCEPT_PAUSE_S = 0.05       # after a failed accept with no connection to close


@dataclass(frozen=True)
class Limits:
    workers: int = 8          # threads running handlers
    queue: int = 64           # complete requests waiting for a worker
    waiting: int = 1024       # connections being read
    idle_s: float = 5.0       # silence allowed while reading, and per send of a reply
    deadline_s: float = 10.0  # from the accept to a complete request (TLS included)


DEFAULT_LIMITS = Limits()

# A longer request body is refused unread: the lease protocol's bound
# (slurm_geo.lease.protocol.MAX_BODY_BYTES, kept equal by tests/test_federation_http.py).
MAX_BODY_BYTES = 64 * 1024


@dataclass(frozen=True)
class Connection:
    """What a handler is given as its `request`: the socket and the request read from it."""

    sock: socket.socket
    data: bytes


class PrereadHandler(BaseHTTPRequestHandler):
    """A BaseHTTPRequestHandler over a request the server has read in full already."""

    request: Connection  # type: ignore[assignment]

    def setup(self) -> None:
        self.connection = self.request.sock
        self.rfile = io.BytesIO(self.request.data)
        self.wfile = self.connection.makefile("wb")


def request_length(data: bytes | bytearray) -> int | None:
    """How many bytes of `data` make up its HTTP request once all of it is there (its head,
    and its body when Content-Length asks for one of at most MAX_BODY_BYTES); None while
    it is not. A head over MAX_HEAD_BYTES counts as complete as it stands."""
    ends = [i for i in (data.find(b"\r\n\r\n"), data.find(b"\n\n")) if i >= 0]
    if not ends:
        return len(data) if len(data) >= MAX_HEAD_BYTES else None
    head_end = min(ends)
    head = bytes(data[:head_end])
    head_length = head_end + (4 if data.startswith(b"\r\n\r\n", head_end) else 2)
    body = _content_length(head)
    if not 0 < body <= MAX_BODY_BYTES:
        return head_length  # nothing to read, or too much to read: refused unread
    return head_length + body if len(data) >= head_length + body else None


def _content_length(head: bytes) -> int:
    for line in head.split(b"\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            try:
                return int(value.strip())
            except ValueError:
                return 0
    return 0


@dataclass(eq=False)
class _Reading:
    """A connection whose request is being read."""

    sock: socket.socket
    address: Any
    accepted_at: float
    active_at: float
    handshaking: bool
    data: bytearray = field(default_factory=bytearray)


class BoundedHTTPServer:
    """Serves `handler` on (address, port), https with `tls`; `serve_forever` on a thread
    of the caller's, `shutdown` from another, then `server_close`."""

    def __init__(self, address: str, port: int, handler: type[PrereadHandler], *,
                 tls: ssl.SSLContext | None = None, limits: Limits = DEFAULT_LIMITS):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self.socket = socket.create_server((address, port), family=family, backlog=128)
        self.socket.setblocking(False)
        self.server_address = self.socket.getsockname()[:2]
        self.handler, self.tls, self.limits = handler, tls, limits
        self.dispatched = 0    # complete requests handed to the workers
        self.refused_busy = 0  # closed because every worker was busy and the queue full
        self._accept_warned_at = -math.inf
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="federation-http")
        self._slots = threading.BoundedSemaphore(limits.workers + limits.queue)
        self._reading: dict[socket.socket, _Reading] = {}  # in the order accepted
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()

    # --- the reading thread ---------------------------------------------------------------

    def serve_forever(self) -> None:
        self._idle.clear()
        self._selector.register(self.socket, selectors.EVENT_READ)
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stop.is_set():
                for key, _ in self._selector.select(TICK_S if self._reading else None):
                    if key.fileobj is self.socket:
                        self._accept()
                    elif key.fileobj in self._reading:  # not closed meanwhile
                        self._advance(self._reading[key.fileobj])  # type: ignore[index]
                self._expire()
        finally:
            for reading in list(self._reading.values()):
                self._drop(reading)
            self._selector.unregister(self.socket)
            self._selector.unregister(self._wake_r)
            self._idle.set()

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_ROUND):
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say
                self._accept_failed(exc)
                return
            if len(self._reading) >= self.limits.waiting:
                self._drop(next(iter(self._reading.values())))
            sock.setblocking(False)
            if self.tls is not None:
                sock = self.tls.wrap_socket(sock, server_side=True,
                                            do_handshake_on_connect=False)
            now = time.monotonic()
            reading = _Reading(sock, address, now, now, handshaking=self.tls is not None)
            self._reading[sock] = reading
            self._selector.register(sock, selectors.EVENT_READ)

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors (or another accept error): free one by closing the connection
        accepted first, or pause a moment; never spin on a listener that stays readable.
        Said once a minute at most."""
        if self._reading:
            self._drop(next(iter(self._reading.values())))
        else:
            time.sleep(ACCEPT_PAUSE_S)
        now = time.monotonic()
        if now - self._accept_warned_at >= 60.0:
            self._accept_warned_at = now
            log.warning("event=http_accept_failed error=%r", str(exc))

    def _advance(self, reading: _Reading) -> None:
        """Take the connection as far as it goes without waiting: the handshake, then the
        request; a complete one goes to the workers."""
        reading.active_at = time.monotonic()
        try:
            if reading.handshaking:
                reading.sock.do_handshake()  # type: ignore[attr-defined]
                reading.handshaking = False
            while (length := request_length(reading.data)) is None:
                chunk = reading.sock.recv(RECV_BYTES)
                if not chunk:
                    raise ConnectionError("closed before its request was complete")
                reading.data += chunk
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
            self._selector.modify(reading.sock, selectors.EVENT_READ)
            return
        except ssl.SSLWantWriteError:
            self._selector.modify(reading.sock, selectors.EVENT_WRITE)
            return
        except OSError as exc:  # gone, reset, or not speaking TLS: nothing to answer
            log.debug("http connection from %s ended: %s", reading.address, exc)
            self._drop(reading)
            return
        self._selector.unregister(reading.sock)
        del self._reading[reading.sock]
        self._dispatch(reading, bytes(reading.data[:length]))

    def _dispatch(self, reading: _Reading, request: bytes) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused_busy += 1
            reading.sock.close()
            return
        self.dispatched += 1
        self._pool.submit(self._serve, reading.sock, reading.address, request)

    def _expire(self) -> None:
        now = time.monotonic()
        for reading in list(self._reading.values()):
            if now - reading.active_at >= self.limits.idle_s \
                    or now - reading.accepted_at >= self.limits.deadline_s:
                self._drop(reading)

    def _drop(self, reading: _Reading) -> None:
        del self._reading[reading.sock]
        self._selector.unregister(reading.sock)
        reading.sock.close()

    # --- a worker ---------------------------------------------------------------------------

    def _serve(self, sock: socket.socket, address: Any, request: bytes) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(self.limits.idle_s)
            self.handler(Connection(sock, request), address, self)  # type: ignore[arg-type]
        except OSError as exc:  # the client went away, or reads its reply too slowly
            log.debug("http reply to %s failed: %s", address, exc)
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
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        self._pool.shutdown(wait=False, cancel_futures=True)


def _close(sock: socket.socket) -> None:
    """Close after sending what is sent: SHUT_WR first, as socketserver does, so unread
    request bytes do not reset the connection under the reply."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    sock.close()
