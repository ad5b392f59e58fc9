"""A job's world: what it reads (`--geo-inputs`), the software it runs in (`--geo-env`) and
what it writes (`--geo-outputs`), typed, for whatever stages them. Pure: no I/O.

    World.of(directives).inputs  -> (Input("/pfs/data/tokens", "restricted"),
                                     Input("/home/alice/llm", None))

An input's `data_class` is its own (`PATH:CLASS`), None where it has the job's. The rules
that hold between them (outputs outside the read-only inputs and environment, a data class
per input) are checked with the others in slurm_geo.policy.geo; `env_refusal` is what the
submit-time check (as the submitting user, slurm_geo.hooks.validator) says of the
environment it found on disk.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from slurm_geo.policy.directives import BY_OPTION, DirectiveError, Directives, quote

ENV_IMAGE_SUFFIXES = (".sqsh", ".squashfs", ".sif")  # enroot squashfs, Apptainer SIF
WORLD_OPTIONS = ("geo-inputs", "geo-env", "geo-outputs")

PathKind = Literal["directory", "file", "other", "missing", "unreadable"]


@dataclass(frozen=True)
class Input:
    path: str
    data_class: str | None = None  # its own; None: the job's

    def class_given(self, job_class: str) -> str:
        """The data class it has: its own, else the job's."""
        return self.data_class or job_class


def split_input(entry: str) -> Input:
    """`PATH` or `PATH:CLASS`, as `--geo-inputs` holds them once parsed (every entry with
    a ':' ends in its class)."""
    path, sep, data_class = entry.rpartition(":")
    return Input(path, data_class) if sep else Input(entry)


@dataclass(frozen=True)
class World:
    inputs: tuple[Input, ...] = ()
    env: str | None = None
    outputs: tuple[str, ...] = ()

    @classmethod
    def of(cls, directives: Directives) -> World:
        return cls(tuple(split_input(e) for e in directives.inputs), directives.env,
                   directives.outputs)

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> World:
        """The world of `{option: value}` directives as recorded (a LogicalJob's);
        `DirectiveError` if one of its three no longer parses."""
        values: dict[str, Any] = {}
        for option in WORLD_OPTIONS:
            if option in options:
                spec = BY_OPTION[option]
                values[spec.field] = spec.parse(options[option], option)
        return cls.of(Directives(**values))

    @property
    def empty(self) -> bool:
        return self == World()

    def read_only(self) -> tuple[tuple[str, str], ...]:
        """`(what, path)` of everything read-only where the job moves: inputs, then env."""
        found = tuple(("the input", i.path) for i in self.inputs)
        return found + ((("the --geo-env", self.env),) if self.env else ())

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [{"path": i.path, "data_class": i.data_class} for i in self.inputs],
                "env": self.env, "outputs": list(self.outputs)}

    def lines(self) -> list[tuple[str, str]]:
        """`(label, text)` for `slurm-geo status`: one each, '-' when none."""
        inputs = ", ".join(i.path + (f" ({i.data_class})" if i.data_class else "")
                           for i in self.inputs)
        return [("inputs", inputs or "-"), ("env", self.env or "-"),
                ("outputs", ", ".join(self.outputs) or "-")]


def _inside(path: str, other: str) -> bool:
    return path.startswith(other + "/")


def overlap(world: World) -> str | None:
    """Why an output overlaps what is read-only where the job moves; None when none does."""
    for output in world.outputs:
        for what, path in world.read_only():
            if output == path:
                relation = "is"
            elif _inside(output, path):
                relation = "is inside"
            elif _inside(path, output):
                relation = "holds"
            else:
                continue
            return (f"geo: --geo-outputs: {quote(output)} {relation} {what} {quote(path)}, "
                    "read-only where the job moves; write the outputs outside it")
    return None


def env_refusal(path: str, kind: PathKind) -> str | None:
    """What the submit-time check says of `--geo-env=path` found to be `kind` (stat(2),
    following links, as the submitting user); None when it will do."""
    option = "--geo-env"
    if kind == "directory":
        return None
    if kind == "file" and path.endswith(ENV_IMAGE_SUFFIXES):
        return None
    if kind == "file":
        return (f"geo: {option}: {quote(path)} is a file but no container image (a name "
                f"ending in {', '.join(ENV_IMAGE_SUFFIXES)}); name a virtualenv or conda "
                "directory, or the image")
    if kind == "missing":
        return (f"geo: {option}: {quote(path)} does not exist; name your virtualenv or conda "
                "directory, or container image")
    if kind == "unreadable":
        return f"geo: {option}: {quote(path)} cannot be looked at by you; check its permissions"
    return (f"geo: {option}: {quote(path)} is neither a directory nor a regular file; name "
            "a virtualenv or conda directory, or a container image")


def check_world(directives: Directives) -> None:
    """The syntactic rule between the three: no output overlaps an input or the env."""
    why = overlap(World.of(directives))
    if why is not None:
        raise DirectiveError(why)
