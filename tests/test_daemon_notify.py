"""sd_notify without systemd, and one journald-friendly log line per event."""

from __future__ import annotations

import io
import logging
import socket

import pytest

from slurm_geo.daemon.events import JournalFormatter, configure_logging, event
from slurm_geo.daemon.notify import Notifier


@pytest.fixture
def notify_socket(tmp_path):
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    yield path, sock
    sock.close()


def test_without_notify_socket_every_call_is_a_no_op():
    notifier = Notifier({})
    assert not notifier.enabled
    assert notifier.ready("x") is False and notifier.watchdog() is False
    assert notifier.watchdog_interval_s is None


def test_messages_reach_the_socket(notify_socket):
    path, sock = notify_socket
    notifier = Notifier({"NOTIFY_SOCKET": str(path)})
    assert notifier.ready("replicating")
    assert sock.recv(1024) == b"READY=1\nSTATUS=replicating"
    notifier.watchdog()
    notifier.stopping()
    assert sock.recv(1024) == b"WATCHDOG=1"
    assert sock.recv(1024).startswith(b"STOPPING=1")


def test_abstract_socket_names_are_understood():
    name = f"slurm-geo-test-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).watchdog()
        assert sock.recv(64) == b"WATCHDOG=1"


@pytest.mark.parametrize("value", ["relative/path", "/nonexistent/notify"])
def test_a_bad_socket_never_raises(value):
    assert Notifier({"NOTIFY_SOCKET": value}).ready("x") is False


@pytest.mark.parametrize("env, expected", [
    ({"WATCHDOG_USEC": "20000000"}, 10.0),
    ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "42"}, 10.0),
    ({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "43"}, None),   # meant for another pid
    ({"WATCHDOG_USEC": "0"}, None),
    ({"WATCHDOG_USEC": "soon"}, None),
])
def test_watchdog_interval_is_half_of_watchdog_sec(env, expected):
    assert Notifier(env, pid=42).watchdog_interval_s == expected


def test_one_logfmt_line_per_event_with_quoting():
    stream = io.StringIO()
    log = logging.getLogger("test.daemon.events")
    handler = logging.StreamHandler(stream)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        event(log, "failed", logging.ERROR, run="r1", step=5, error='no "bucket"\nhere',
              retry_in_s=None)
    finally:
        log.removeHandler(handler)
    assert stream.getvalue() == 'event=failed run=r1 step=5 error="no \\"bucket\\"\\nhere"\n'


def test_under_journald_lines_carry_their_priority_and_no_timestamp():
    record = logging.LogRecord("x", logging.WARNING, __file__, 1, "event=outage", None, None)
    assert JournalFormatter().format(record) == "<4>event=outage"
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging({"JOURNAL_STREAM": "8:1234"}, stream=stream)
    try:
        logging.getLogger("slurm_geo.sync").error("event=corrupted")
    finally:
        root.handlers[:], root.level = saved
    assert stream.getvalue() == "<3>event=corrupted\n"
