"""A peer the netns tests run inside a site: `python tests/site_peer.py MODE ADDRESS PORT`.

listen  an echo server; prints "ready" once it listens
probe   exits 0 when an echo round trip with the server works within 0.5 s, else 1
hold    connects, prints "connected", then for each stdin line sends it and prints the echo
"""

from __future__ import annotations

import socket
import sys
import threading


def listen(address: str, port: int) -> None:
    server = socket.create_server((address, port))
    print("ready", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()


def echo(conn: socket.socket) -> None:
    with conn:
        while data := conn.recv(4096):
            conn.sendall(data)


def probe(address: str, port: int) -> int:
    try:
        with socket.create_connection((address, port), timeout=0.5) as conn:
            conn.sendall(b"ping")
            return 0 if conn.recv(4) == b"ping" else 1
    except OSError:
        return 1


def hold(address: str, port: int) -> None:
    with socket.create_connection((address, port), timeout=1) as conn:
        conn.settimeout(60)
        print("connected", flush=True)
        for line in sys.stdin:
            conn.sendall(line.encode())
            print(conn.recv(4096).decode().strip(), flush=True)


if __name__ == "__main__":
    mode, where, at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if mode == "listen":
        listen(where, at)
    elif mode == "probe":
        sys.exit(probe(where, at))
    else:
        hold(where, at)
