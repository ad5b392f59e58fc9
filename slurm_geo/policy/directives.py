"""The `--geo-*` directives: declared once, parsed from any of the places they travel.

A user writes `#SBATCH --geo-residency=home` (or passes it to sbatch). The SPANK plugin
(slurm_geo/share/spank/geo_directives.c) only carries values: to the validator as `--geo-NAME=VALUE`
arguments, to Slurm's hooks as `SPANK_GEO_<NAME>` (job_submit.lua sees `GEO_<NAME>` in
`job_desc.spank_job_env`) and to the job as `SLURM_GEO_<NAME>`. Jobs submitted through
slurmrestd carry `SLURM_GEO_<NAME>` in their environment. Everything here is pure: text in,
typed values or a `DirectiveError` with one line naming the option and the fix out.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode
from slurm_geo.names import NAME_RULE, is_name

DATA_CLASSES = ("public", "internal", "restricted")
FAILOVER_MODES = ("auto", "manual", "never")
MAX_INTERVAL_MIN = 10080  # a week
USD_DECIMALS = 6          # to a millionth of a dollar: a short job on a cheap node
_USD = re.compile(rf"[0-9]{{1,9}}(\.[0-9]{{1,{USD_DECIMALS}}})?")

SPANK_PREFIX = "SPANK_GEO_"      # Prolog, Epilog, PrologSlurmctld, EpilogSlurmctld
CONTROL_PREFIX = "GEO_"          # job_desc.spank_job_env as job_submit.lua sees it
JOB_PREFIX = "SLURM_GEO_"        # the job's environment; REST submissions


class DirectiveError(SlurmGeoError):
    """A `--geo-*` directive is malformed, names something unknown, or lacks a partner."""

    exit_code = ExitCode.DIRECTIVE


class PolicyViolation(DirectiveError):
    """Well-formed directives the site's policy forbids (residency, data class, budget)."""

    exit_code = ExitCode.POLICY_VIOLATION


@dataclass(frozen=True)
class Directives:
    """What a job asked for; None / () where a directive was not given."""

    ckpt_dir: str | None = None
    ckpt_interval_min: int | None = None
    residency: tuple[str, ...] = ()
    data_class: str | None = None
    cost_center: str | None = None
    max_cost_usd: float | None = None
    failover: str | None = None
    clusters: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()    # "PATH" or "PATH:CLASS", normalised (policy.world)
    env: str | None = None
    outputs: tuple[str, ...] = ()

    @property
    def is_geo(self) -> bool:
        return self != Directives()

    def as_options(self) -> dict[str, str]:
        """`{option: value}` of the directives given, as a user would write them."""
        out = {}
        for spec in DIRECTIVES:
            value = getattr(self, spec.field)
            if value not in (None, ()):
                out[spec.option] = spec.render(value)
        return out


@dataclass(frozen=True)
class DirectiveSpec:
    """One directive: its option, its environment name, how to read it, its help."""

    option: str          # without the leading "--"
    env: str             # the NAME in GEO_NAME, SPANK_GEO_NAME and SLURM_GEO_NAME
    field: str
    parse: Callable[[str, str], Any]
    help: str
    example: str

    def render(self, value: Any) -> str:
        if isinstance(value, tuple):
            return ",".join(value)
        if isinstance(value, float):  # every decimal given, none invented
            return f"{value:.{USD_DECIMALS}f}".rstrip("0").rstrip(".")
        return str(value)


SHOWN_BYTES = 72  # a longer value is shown by its head and tail: messages stay one line
HEAD_BYTES, TAIL_BYTES = 48, 16
PATH_MAX = 4096  # bytes, with the terminating NUL (Linux)
NAME_MAX = 255   # bytes of one path component


def quote(value: str) -> str:
    """`'value'` with control characters shown as '?', and a long value elided to its
    head and tail (cut at character boundaries): messages stay one short line.

    job_submit.lua quotes the same way, counting the same UTF-8 bytes, so both sides print
    the same message."""
    shown = "".join("?" if ord(c) < 32 or ord(c) == 127 else c for c in value)
    if _utf8_len(shown) > SHOWN_BYTES:
        shown = _head(shown, HEAD_BYTES) + "..." + _head(shown[::-1], TAIL_BYTES)[::-1]
    return "'" + shown + "'"


def _utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))


def _head(text: str, limit: int) -> str:
    """The longest start of `text` whose UTF-8 encoding fits in `limit` bytes."""
    used = 0
    for index, char in enumerate(text):
        used += _utf8_len(char)
        if used > limit:
            return text[:index]
    return text


def _reject(option: str, value: str, why: str) -> DirectiveError:
    return DirectiveError(f"geo: --{option}: {quote(value)} {why}")


def _absolute_path(value: str, option: str) -> str:
    """The path normalised (no `//`, `/./` or trailing `/`); `..` refused rather than
    resolved, since what it leads to depends on links the prolog would follow as root."""
    if not value.startswith("/") or any(c in value for c in "\0\n\r"):
        raise _reject(option, value, "is not an absolute path")
    parts = [part for part in value.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise _reject(option, value, "contains '..'; name the directory without it")
    if any(_utf8_len(part) > NAME_MAX for part in parts):
        raise _reject(option, value, f"has a component longer than {NAME_MAX} bytes (NAME_MAX)")
    normal = "/" + "/".join(parts)
    if _utf8_len(normal) >= PATH_MAX:
        raise _reject(option, value, f"is {_utf8_len(normal)} bytes long; paths are at most "
                      f"{PATH_MAX - 1} (PATH_MAX)")
    return normal


MAX_WORLD_PATHS = 32       # entries of --geo-inputs or --geo-outputs
MAX_WORLD_BYTES = 16384    # bytes of a whole --geo-inputs or --geo-outputs value


def _world_path(path: str, option: str) -> str:
    """A path of the job's world: absolute and normalised (`_absolute_path`), not `/`."""
    normal = _absolute_path(path, option)
    if normal == "/":
        raise _reject(option, path, "is the root directory; name the directories and files "
                      "the job uses")
    return normal


def _path_list(value: str, option: str, classes: bool) -> tuple[str, ...]:
    """Comma-separated paths, each normalised; with `classes`, an entry may end in
    `:CLASS` (its data class), and one containing ':' must."""
    if _utf8_len(value) > MAX_WORLD_BYTES:
        raise _reject(option, value, f"is {_utf8_len(value)} bytes long; a list is at most "
                      f"{MAX_WORLD_BYTES}: name the directories that hold the files")
    entries = value.split(",")
    if len(entries) > MAX_WORLD_PATHS:
        raise _reject(option, value, f"names {len(entries)} paths; at most {MAX_WORLD_PATHS}: "
                      "name the directories that hold them")
    out: list[str] = []
    seen: set[str] = set()
    for entry in entries:
        if entry == "":
            raise _reject(option, value, "has an empty entry (two commas, or one at an end)")
        path, data_class = entry, ""
        if classes and ":" in entry:
            path, _, data_class = entry.rpartition(":")
            if data_class not in DATA_CLASSES:
                raise _reject(option, entry, f"ends in {quote(':' + data_class)}, not a data "
                              f"class ({', '.join(DATA_CLASSES)}): write PATH or PATH:CLASS "
                              "(a path with ':' needs its class after it)")
        if not path.startswith("/"):
            raise _reject(option, entry, "is not an absolute path")
        normal = _world_path(path, option)
        if normal in seen:
            raise _reject(option, value, f"names {quote(normal)} twice")
        seen.add(normal)
        out.append(normal + (":" + data_class if data_class else ""))
    return tuple(out)


def _inputs(value: str, option: str) -> tuple[str, ...]:
    return _path_list(value, option, classes=True)


def _outputs(value: str, option: str) -> tuple[str, ...]:
    return _path_list(value, option, classes=False)


def _env(value: str, option: str) -> str:
    if "," in value:
        raise _reject(option, value, "names more than one path; a job has one environment")
    return _world_path(value, option)


def _minutes(value: str, option: str) -> int:
    if not re.fullmatch(r"[0-9]{1,6}", value) or not 1 <= int(value) <= MAX_INTERVAL_MIN:
        raise _reject(option, value, f"is not a whole number of minutes from 1 to "
                      f"{MAX_INTERVAL_MIN}")
    return int(value)


def _names(value: str, option: str) -> tuple[str, ...]:
    names = value.split(",")
    if not all(is_name(n) for n in names):
        raise _reject(option, value, "is not a comma-separated list of names")
    if len(set(names)) != len(names):
        raise _reject(option, value, "names one entry twice")
    return tuple(names)


def _one_of(choices: tuple[str, ...]) -> Callable[[str, str], str]:
    def parse(value: str, option: str) -> str:
        if value not in choices:
            raise _reject(option, value, f"is not one of {', '.join(choices)}")
        return value
    return parse


def _name(value: str, option: str) -> str:
    if not is_name(value):
        raise _reject(option, value, f"must be {NAME_RULE}")
    return value


def _usd(value: str, option: str) -> float:
    if not _USD.fullmatch(value) or float(value) <= 0:
        raise _reject(option, value, f"is not an amount of USD greater than 0, with at most "
                      f"{USD_DECIMALS} decimals (e.g. 250, 99.50 or 0.001)")
    return float(value)


DIRECTIVES = (
    DirectiveSpec("geo-ckpt-dir", "CKPT_DIR", "ckpt_dir", _absolute_path,
                  "Checkpoint directory of the job: its trainer's store, or, for a "
                  "FederatedRun (which saves to its cluster's store), its records. Gives "
                  "the job --requeue and a warning signal before its time limit, and lets "
                  "it move with its checkpoints.",
                  "/pfs/ckpt/llm-7b"),
    DirectiveSpec("geo-ckpt-interval", "CKPT_INTERVAL", "ckpt_interval_min", _minutes,
                  "Minutes between checkpoints (what a failure may cost).", "30"),
    DirectiveSpec("geo-residency", "RESIDENCY", "residency", _names,
                  "Regions the job's data and checkpoints may go to. Default: every region "
                  "its data class allows.", "home,eu-west"),
    DirectiveSpec("geo-data-class", "DATA_CLASS", "data_class", _one_of(DATA_CLASSES),
                  "Sensitivity of the job's data; the site says where each class may "
                  "reside.", "internal"),
    DirectiveSpec("geo-cost-center", "COST_CENTER", "cost_center", _name,
                  "Cost center charged for the job.", "ml-research"),
    DirectiveSpec("geo-max-cost", "MAX_COST", "max_cost_usd", _usd,
                  "Most the job may cost, in USD; at most the cost center's budget.", "500"),
    DirectiveSpec("geo-failover", "FAILOVER", "failover", _one_of(FAILOVER_MODES),
                  "When the cluster is lost: move the job (auto), ask (manual) or stay "
                  "(never). auto needs --geo-ckpt-dir.", "auto"),
    DirectiveSpec("geo-clusters", "CLUSTERS", "clusters", _names,
                  "Clusters the job may run on. Default: every cluster its residency "
                  "allows.", "onprem,rented"),
    DirectiveSpec("geo-inputs", "INPUTS", "inputs", _inputs,
                  "What the job reads (datasets, code, configs): absolute paths, read-only "
                  "where it moves. An entry may end in :CLASS, its own data class; without, "
                  "it has the job's.", "/pfs/data/tokens:restricted,/home/alice/llm"),
    DirectiveSpec("geo-env", "ENV", "env", _env,
                  "The job's software: a virtualenv or conda directory, or a container image "
                  "file (.sqsh, .squashfs, .sif).", "/home/alice/venvs/llm"),
    DirectiveSpec("geo-outputs", "OUTPUTS", "outputs", _outputs,
                  "What the job writes, brought home: absolute paths, outside its inputs "
                  "and --geo-env.", "/pfs/results/llm-7b"),
)
BY_OPTION = {spec.option: spec for spec in DIRECTIVES}


def parse_options(raw: Mapping[str, str]) -> Directives:
    """Directives from `{option: value}` (options without "--"); unknown options rejected."""
    values: dict[str, Any] = {}
    for option, text in raw.items():
        spec = BY_OPTION.get(option)
        if spec is None:
            raise DirectiveError(unknown_option_message(option))
        values[spec.field] = spec.parse(_given(text, option), option)
    return replace(Directives(), **values)


def closest_option(option: str) -> str | None:
    """The directive `option` (without "--") most likely meant; None when none is close.

    difflib's similarity (0.6 at least) of the words after "geo-", case and '_' for '-'
    ignored: every directive shares "geo-", which would make any two look alike."""
    def word(name: str) -> str:
        return name.lower().replace("_", "-").removeprefix("geo-")

    by_word = {word(spec.option): spec.option for spec in DIRECTIVES}
    found = difflib.get_close_matches(word(option), list(by_word), n=1)
    return by_word[found[0]] if found else None


def unknown_option_message(option: str) -> str:
    """One line for a `--geo-*` option that is no directive (`option` without "--"):
    "geo: unknown option --geo-failovr; did you mean --geo-failover?"."""
    shown = "--" + quote(option)[1:-1]
    meant = closest_option(option)
    if meant is not None:
        return f"geo: unknown option {shown}; did you mean --{meant}?"
    known = ", ".join(f"--{s.option}" for s in DIRECTIVES)
    return f"geo: unknown option {shown} (known: {known})"


def _given(value: str, option: str) -> str:
    """`value`, unless the option came without one. Slurm gives an option written without
    `=VALUE` the next word, which after `#SBATCH --geo-NAME` is the next line's option:
    that option would be lost, so the job is refused instead."""
    if value == "":
        raise DirectiveError(f"geo: --{option} has no value; write --{option}=VALUE")
    if value.startswith("--") or re.match(r"-[A-Za-z]", value):
        raise DirectiveError(f"geo: --{option} has no value (it took the next option, "
                             f"{quote(value)}); write --{option}=VALUE on one line")
    return value


def from_environment(environ: Mapping[str, str], prefix: str) -> Directives:
    """Directives from `<prefix><NAME>` variables, e.g. SPANK_GEO_RESIDENCY."""
    return parse_options({spec.option: environ[prefix + spec.env] for spec in DIRECTIVES
                          if prefix + spec.env in environ})


def to_environment(directives: Directives, prefix: str = JOB_PREFIX) -> dict[str, str]:
    """`{<prefix><NAME>: value}`: how a REST submission carries its directives."""
    return {prefix + BY_OPTION[option].env: value
            for option, value in directives.as_options().items()}


def parse_arguments(argv: Iterable[str]) -> Directives:
    """Directives from `--geo-NAME=VALUE` arguments, as the SPANK plugin passes them."""
    raw = {}
    for arg in argv:
        option, sep, value = arg.removeprefix("--").partition("=")
        if not arg.startswith("--") or not sep:
            raise DirectiveError(f"geo: cannot read {quote(arg)}; expected --geo-NAME=VALUE")
        raw[option] = value
    return parse_options(raw)


def directives_table() -> str:
    """The Markdown table of the directives, as docs/directives.md shows it."""
    rows = ["| directive | job sees | meaning | example |", "|---|---|---|---|"]
    for spec in DIRECTIVES:
        rows.append(f"| `--{spec.option}` | `{JOB_PREFIX}{spec.env}` | {spec.help} | "
                    f"`--{spec.option}={spec.example}` |")
    return "\n".join(rows)
