"""systemd's notify protocol (sd_notify(3)): a datagram to $NOTIFY_SOCKET. No dependency.

Without NOTIFY_SOCKET every call is a no-op, and no call ever raises: telling systemd how
we are must never be the reason we fail.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    """READY, WATCHDOG, RELOADING, STOPPING and STATUS messages for the service manager."""

    def __init__(self, env: Mapping[str, str] = os.environ, pid: int | None = None):
        self._address = _socket_address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_interval_s = _watchdog_interval_s(env, os.getpid() if pid is None else pid)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *fields: str) -> bool:
        """Send `KEY=value` lines; False when there is no socket or sending failed."""
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(self._address)
                sock.sendall("\n".join(fields).encode())
        except OSError:
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> bool:
        return self.send("RELOADING=1", "STATUS=reloading the configuration")

    def stopping(self) -> bool:
        return self.send("STOPPING=1", "STATUS=stopping")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")


def _socket_address(value: str) -> str | None:
    """A filesystem path, or '@name' for the abstract namespace."""
    if not value or value[0] not in "/@":
        return None
    return "\0" + value[1:] if value[0] == "@" else value


def _watchdog_interval_s(env: Mapping[str, str], pid: int) -> float | None:
    """How often to ping: half of WatchdogSec, as sd_watchdog_enabled(3) advises."""
    try:
        usec = int(env.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    watchdog_pid = env.get("WATCHDOG_PID", "")
    if usec <= 0 or (watchdog_pid and watchdog_pid != str(pid)):
        return None
    return usec / 2e6
