"""One log line per event, in logfmt (`event=verified run=r step=100 ...`), journald-friendly.

Under systemd (JOURNAL_STREAM set) each line starts with the syslog priority `<N>`, which
journald reads as the entry's priority, and carries no timestamp (journald adds its own).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any, TextIO

_PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
               logging.CRITICAL: 2}


def event(log: logging.Logger, name: str, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event=name` and the fields that are not None, as one logfmt line."""
    parts = [f"event={name}"]
    parts += [f"{key}={_value(value)}" for key, value in fields.items() if value is not None]
    log.log(level, " ".join(parts))


def _value(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\\\n\t'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class JournalFormatter(logging.Formatter):
    """`<priority>message`; a traceback follows on the same record as escaped text."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += " traceback=" + _value(self.formatException(record.exc_info))
        return f"<{_PRIORITIES.get(record.levelno, 6)}>{message}"


def configure_logging(env: Mapping[str, str], level: int = logging.INFO,
                      stream: TextIO = sys.stderr) -> None:
    """Log lines to `stream`: journald style under systemd, timestamped otherwise."""
    handler = logging.StreamHandler(stream)
    if env.get("JOURNAL_STREAM"):
        handler.setFormatter(JournalFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
