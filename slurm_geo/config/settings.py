"""How a config table is declared: one `Setting` per key, read by one set of validators.

A table is a tuple of Settings (name, validator, default, help). `read_settings` checks a
TOML table against it, refusing unknown keys and missing required ones by name, and
`settings_table` renders the same tuple as the Markdown table the docs show. Every
validator takes `(value, where)` and raises ConfigError with one line: `where` (the file,
the table and the key), what the key must be, and the value it got.

Numbers are finite: TOML's `nan` and `inf` are refused everywhere, and so are booleans
(Python counts `true` as 1).
"""

from __future__ import annotations

import ipaddress
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from slurm_geo.errors import ConfigError
from slurm_geo.names import NAME_RULE, is_name

Parse = Callable[[Any, str], Any]


@dataclass(frozen=True)
class Setting:
    """One key of a table: how to read it (raising ConfigError naming `where`), its default
    and its help. A required setting has no default. A sub-table (`[x.prices]`) is named
    `where.key` in messages, a plain value `where: key`."""

    name: str
    parse: Parse
    default: Any
    help: str
    required: bool = False
    subtable: bool = False


def read_settings(table: Any, settings: tuple[Setting, ...], where: str) -> dict[str, Any]:
    """The table's values, each read by its Setting; unknown keys and missing required
    ones are refused, naming them. Keys the table leaves out are left out (defaults are
    the dataclass's)."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table")
    reject_unknown(table, {s.name for s in settings}, where)
    values = {}
    for setting in settings:
        if setting.name in table:
            at = f"{where}.{setting.name}" if setting.subtable else f"{where}: {setting.name}"
            values[setting.name] = setting.parse(table[setting.name], at)
        elif setting.required:
            raise ConfigError(f"{where}: missing {setting.name} ({setting.help})")
    return values


def reject_unknown(table: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(table) - known)
    if unknown:
        named = ", ".join(printable(str(key)) for key in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise ConfigError(
            f"{where}: unknown key(s) {named}{more}; allowed: {', '.join(sorted(known))}")


SHOWN_CHARS = 80  # of a refused value in a message: the line stays short


def shown(value: Any) -> str:
    """A refused value as a message shows it: its repr, on one line, cut to SHOWN_CHARS."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<a {type(value).__name__} nested too deep>"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def printable(text: str) -> str:
    """`text` with control characters as '?': a name or path that goes into a message."""
    return "".join("?" if ord(c) < 32 or ord(c) == 127 else c for c in text)


def table_of(table: Any, where: str, what: str) -> dict[str, Any]:
    """`table` when it is a TOML table; `what` says what it holds ("cost center = USD")."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where} must be a table of {what}, got {shown(table)}")
    return table


def settings_table(settings: tuple[Setting, ...]) -> str:
    """The Markdown table of a settings declaration, as the docs show it."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for s in settings:
        default = "required" if s.required else ("-" if s.default is None else
                                                 f"`{_toml_value(s.default)}`")
        rows.append(f"| `{s.name}` | {default} | {s.help} |")
    return "\n".join(rows)


def _toml_value(value: Any) -> str:
    if isinstance(value, str | Path):
        return f'"{value}"'
    return f"{value:g}" if isinstance(value, float) else str(value)


# --- validators ---------------------------------------------------------------------------

def whole(low: int, high: int | None = None) -> Parse:
    """A whole number in [low, high] (no upper bound when high is None)."""
    bounds = f">= {low}" if high is None else f"from {low} to {high}"

    def parse(value: Any, where: str) -> int:
        if (not isinstance(value, int) or isinstance(value, bool) or value < low
                or (high is not None and value > high)):
            raise ConfigError(f"{where} must be a whole number {bounds}, got {shown(value)}")
        return value
    return parse


def number(low: float, high: float | None = None, *, above: bool = False, unit: str = "",
           note: str = "") -> Parse:
    """A finite number >= low (> low when `above`), and <= high when high is given;
    `unit` ("seconds") and `note` ("(0: no cap)") go into the message."""
    bounds = (f"> {low:g}" if above else f">= {low:g}") if high is None else \
        f"from {low:g} to {high:g}"
    what = f"a number{f' of {unit}' if unit else ''} {bounds}{f' {note}' if note else ''}"

    def parse(value: Any, where: str) -> float:
        if (not isinstance(value, int | float) or isinstance(value, bool)
                or not math.isfinite(value) or value < low or (above and value == low)
                or (high is not None and value > high)):
            raise ConfigError(f"{where} must be {what}, got {shown(value)}")
        return float(value)
    return parse


seconds = number(0, above=True, unit="seconds")


def flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where} must be true or false, got {shown(value)}")
    return value


def text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty string, got {shown(value)}")
    return value


def site_name(value: Any, where: str) -> str:
    """A cluster, region, store or cost-center name: the grammar of slurm_geo.names."""
    if not is_name(value):
        raise ConfigError(f"{where} must be {NAME_RULE}, got {shown(value)}")
    return str(value)


def path(value: Any, where: str) -> Path:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ConfigError(f"{where} must be an absolute path, got {shown(value)}")
    return Path(value)


def choice(*choices: str) -> Parse:
    def parse(value: Any, where: str) -> str:
        if value not in choices:
            raise ConfigError(f"{where} must be one of {', '.join(choices)}, got {shown(value)}")
        return str(value)
    return parse


def url(*schemes: str, empty: bool = False) -> Parse:
    """A URL starting with one of `schemes` ("s3://"); "" too when `empty`."""
    def parse(value: Any, where: str) -> str:
        if not isinstance(value, str) or ((value or not empty)
                                          and not value.startswith(schemes)):
            raise ConfigError(f"{where} must {'be empty or ' if empty else ''}start with "
                              f"{' or '.join(schemes)}, got {shown(value)}")
        return value
    return parse


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 or localhost: a host whose traffic never leaves the machine."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def secure_url(fix: str) -> Parse:
    """An http:// or https:// URL with a host, plain http only to a loopback host: anything
    else would carry tokens and keys across a network in clear. `fix` ends the message."""
    def parse(value: Any, where: str) -> str:
        host = urlsplit(value).hostname if isinstance(value, str) else None
        if not host or not value.startswith(("http://", "https://")):
            raise ConfigError(f"{where} must be an http:// or https:// URL with a host, "
                              f"got {value!r}")
        if value.startswith("http://") and not is_loopback(host):
            raise ConfigError(f"{where} is plain http to {host}, which is not loopback "
                              f"(127.0.0.1, ::1, localhost): {fix}")
        return value
    return parse


def names(*, what: str = "names", each: str = "a name", non_empty: bool = False) -> Parse:
    """A list of distinct non-empty strings; `what` they are and `each` one of them, for
    the messages."""
    def parse(value: Any, where: str) -> tuple[str, ...]:
        if (not isinstance(value, list) or (non_empty and not value)
                or not all(isinstance(v, str) and v for v in value)):
            raise ConfigError(f"{where} must be a {'non-empty ' if non_empty else ''}list of "
                              f"{what}, got {shown(value)}")
        if len(set(value)) != len(value):
            raise ConfigError(f"{where} names {each} twice: {shown(value)}")
        return tuple(value)
    return parse


def tables(value: Any, where: str) -> list[dict[str, Any]]:
    """A TOML array of tables ([[x]] entries); each is read by its own Settings."""
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where} must be a list of tables ([[...]] entries), got {shown(value)}")
    return value


def moment(value: Any, where: str) -> int:
    """A TOML date or date-time, or an ISO string of one, as Unix seconds; UTC unless it
    carries an offset."""
    try:
        if isinstance(value, str):
            value = datetime.fromisoformat(value.strip())
        if isinstance(value, date) and not isinstance(value, datetime):
            value = datetime.combine(value, time())
        if not isinstance(value, datetime):
            raise TypeError(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a date or time (YYYY-MM-DD or YYYY-MM-DDTHH:MM:SS,"
                          f" UTC), got {shown(value)}") from None
    return int((value.replace(tzinfo=UTC) if value.tzinfo is None else value).timestamp())
