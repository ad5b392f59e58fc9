"""A TLS-terminating TCP relay: the sandbox's stand-in for the reverse proxy (nginx,
haproxy) a site puts in front of slurmrestd, which speaks no TLS itself.

    python -m slurm_geo.sandbox.tls_relay --listen 10.77.1.2:16825 \\
        --to 127.0.0.1:16826 --cert rest.pem --key rest.key

It accepts TCP, completes the TLS handshake (TLS 1.2 or later) within --handshake-timeout,
opens a plain TCP connection to --to and copies bytes both ways; when either side closes,
it closes both. It never reads what it copies, so HTTP/1.1 keep-alive works as it would
without it. At most --max-connections are open at once; one more is closed at accept,
so a client that opens many and sends nothing cannot starve the others. Each failure is
one line on stderr. SIGTERM (or SIGINT) closes the listener and every connection, and
the relay exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import ssl
import sys
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 10.0
CHUNK_BYTES = 64 * 1024
CLOSE_TIMEOUT_S = 2.0  # for the buffered bytes and TLS's close_notify to go out


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int
    unix_path: str | None = None  # `unix:PATH`: a unix socket (slurmrestd's, in the sandbox)

    def __str__(self) -> str:
        if self.unix_path is not None:
            return f"unix:{self.unix_path}"
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def connect(self) -> Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
        if self.unix_path is not None:
            return asyncio.open_unix_connection(self.unix_path)
        return asyncio.open_connection(self.host, self.port)


def endpoint(text: str) -> Endpoint:
    """ADDR:PORT or [IPv6]:PORT, as argparse reads --listen and --to."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not ADDR:PORT (e.g. 127.0.0.1:6820)")
    return Endpoint(host, int(port))


def upstream(text: str) -> Endpoint:
    """--to: ADDR:PORT, or unix:PATH (an absolute path)."""
    if text.startswith("unix:"):
        path = text.removeprefix("unix:")
        if not path.startswith("/"):
            raise argparse.ArgumentTypeError(f"{text!r}: a unix socket is unix:/ABSOLUTE/PATH")
        return Endpoint("", 0, path)
    return endpoint(text)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def say(line: str) -> None:
    print(f"tls_relay: {line}", file=sys.stderr, flush=True)


class Relay:
    """The listener's state: the TLS context, the upstream, and the open connections."""

    def __init__(self, context: ssl.SSLContext, upstream: Endpoint, max_connections: int,
                 handshake_timeout_s: float):
        self.context = context
        self.upstream = upstream
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.open: set[asyncio.Task[None]] = set()

    async def accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = _peer(writer)
        if len(self.open) >= self.max_connections:
            say(f"{peer}: refused, {self.max_connections} connections already open "
                "(--max-connections)")
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        self.open.add(task)
        try:
            await self._serve(peer, reader, writer)
        except asyncio.CancelledError:
            # The relay is stopping. Ending quietly rather than as cancelled: Python 3.11's
            # streams call task.exception() on a finished connection task, which raises
            # (and prints a traceback) for a cancelled one.
            pass
        finally:
            self.open.discard(task)
            writer.transport.abort()  # nothing left to do once _serve has closed it

    async def _serve(self, peer: str, client_in: asyncio.StreamReader,
                     client_out: asyncio.StreamWriter) -> None:
        try:
            await client_out.start_tls(self.context,
                                       ssl_handshake_timeout=self.handshake_timeout_s)
        except (ConnectionResetError, BrokenPipeError):
            return  # gone before saying anything: a port probe (the sandbox's readiness check)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            say(f"{peer}: TLS handshake failed: {_reason(exc)}")
            return
        try:
            server_in, server_out = await asyncio.wait_for(
                self.upstream.connect(),
                CONNECT_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            say(f"{peer}: cannot reach {self.upstream}: {_reason(exc)}")
            return
        try:
            copies = [asyncio.create_task(_copy(client_in, server_out)),
                      asyncio.create_task(_copy(server_in, client_out))]
            try:
                # One side closing ends the exchange: TLS has no half-close to pass on.
                await asyncio.wait(copies, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for copy in copies:
                    copy.cancel()
                await asyncio.gather(*copies, return_exceptions=True)
        finally:
            await asyncio.gather(_close(server_out), _close(client_out))


async def _copy(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(CHUNK_BYTES):
            sink.write(chunk)
            await sink.drain()
    except OSError:
        pass  # a reset or a TLS error on one side: both are closed all the same


async def _close(writer: asyncio.StreamWriter) -> None:
    """Close after what is buffered is sent (with TLS, then close_notify, so a reply that
    ends at the close reads as complete); abort a peer that does not take it in time."""
    writer.close()
    try:
        await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S)
    except (OSError, TimeoutError):
        writer.transport.abort()


def _peer(writer: asyncio.StreamWriter) -> str:
    address = writer.get_extra_info("peername")
    return str(Endpoint(address[0], address[1])) if address else "a client"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        if exc.reason == "HTTP_REQUEST":
            return "the client spoke plain HTTP to the TLS port (it wants https://)"
        return exc.reason or str(exc)
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return str(exc) or type(exc).__name__


async def serve(listen: Endpoint, relay: Relay) -> None:
    """Relay until SIGTERM or SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for number in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(number, stop.set)  # the handler only flags; the loop acts
    server = await asyncio.start_server(relay.accept, listen.host, listen.port)
    async with server:
        await stop.wait()
        server.close()
        for task in list(relay.open):
            task.cancel()
        await asyncio.gather(*relay.open, return_exceptions=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m slurm_geo.sandbox.tls_relay",
        description="Terminate TLS on --listen and relay the bytes to --to in plain TCP: "
                    "the sandbox's stand-in for the reverse proxy in front of slurmrestd.")
    parser.add_argument("--listen", type=endpoint, required=True, metavar="ADDR:PORT",
                        help="where clients connect with TLS")
    parser.add_argument("--to", type=upstream, required=True, metavar="HOST:PORT",
                        help="the plain-TCP server behind (slurmrestd), or unix:PATH for "
                        "one on a unix socket")
    parser.add_argument("--cert", type=Path, required=True, metavar="CERT.pem",
                        help="the certificate chain the relay presents (PEM)")
    parser.add_argument("--key", type=Path, required=True, metavar="KEY.pem",
                        help="its private key (PEM)")
    parser.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                        metavar="N", help="connections open at once; more are closed "
                        f"at accept (default {DEFAULT_MAX_CONNECTIONS})")
    parser.add_argument("--handshake-timeout", type=float,
                        default=DEFAULT_HANDSHAKE_TIMEOUT_S, metavar="SECONDS",
                        help="a client that has not completed TLS by then is dropped "
                        f"(default {DEFAULT_HANDSHAKE_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if args.max_connections < 1 or not args.handshake_timeout > 0:
        parser.error("--max-connections must be >= 1 and --handshake-timeout > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        context = server_context(args.cert, args.key)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        say(f"cannot load --cert {args.cert} and --key {args.key} ({_reason(exc)}); give "
            "a PEM certificate chain and its PEM private key")
        return 2
    relay = Relay(context, args.to, args.max_connections, args.handshake_timeout)
    try:
        asyncio.run(serve(args.listen, relay))
    except OSError as exc:
        say(f"cannot listen on {args.listen}: {exc.strerror or exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
