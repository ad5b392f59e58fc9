"""Object names in a checkpoint store (docs/format.md §2): building and checking them."""

from __future__ import annotations

import re

from slurm_geo.ckpt.errors import UnsafeObjectName

MAX_NAME_LENGTH = 1024
STEP_DIGITS = 20

_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_HEX_ID = re.compile(r"[0-9a-f]{64}")


def check_object_name(name: str) -> str:
    """Return `name` if a store may hold it; it then cannot leave the store's root."""
    if not isinstance(name, str) or not name:
        raise UnsafeObjectName(repr(name), "object names are non-empty strings")
    if len(name) > MAX_NAME_LENGTH:
        raise UnsafeObjectName(name[:64] + "...", f"longer than {MAX_NAME_LENGTH} characters")
    for component in name.split("/"):
        if not _COMPONENT.fullmatch(component):
            raise UnsafeObjectName(
                name, "each '/'-separated part must start with a letter or digit and contain "
                "only letters, digits, '.', '_' and '-' (no absolute paths, no '..')",
            )
    return name


def check_run_id(run: str) -> str:
    if not isinstance(run, str) or not _RUN_ID.fullmatch(run):
        raise UnsafeObjectName(
            repr(run), "a run id is 1-128 letters, digits, '.', '_' or '-', starting with a "
            "letter or digit",
        )
    return run


def is_hex_id(value: object) -> bool:
    return isinstance(value, str) and _HEX_ID.fullmatch(value) is not None


def key_name(run: str) -> str:
    return f"keys/{check_run_id(run)}"


def latest_name(run: str) -> str:
    return f"latest/{check_run_id(run)}"


def manifest_prefix(run: str) -> str:
    return f"manifests/{check_run_id(run)}/"


def manifest_name(run: str, step: int) -> str:
    if not isinstance(step, int) or not 0 <= step < 10**STEP_DIGITS:
        raise UnsafeObjectName(repr(step), f"a step is an integer from 0 to 10**{STEP_DIGITS}-1")
    return f"{manifest_prefix(run)}{step:0{STEP_DIGITS}d}"


def promoted_name(run: str, step: int) -> str:
    return f"promoted/{manifest_name(run, step).removeprefix('manifests/')}"


def verified_name(run: str, step: int) -> str:
    """Where the daemons record that a checkpoint was verified as written (format §8.7)."""
    return f"verified/{manifest_name(run, step).removeprefix('manifests/')}"


def fence_name(run: str) -> str:
    return f"fences/{check_run_id(run)}"


def lock_name(token: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{32}", token):
        raise UnsafeObjectName(token, "a lock token is 32 lowercase hex digits")
    return f"locks/{token}"


def run_of_manifest_name(name: str) -> str | None:
    """The run a name under `manifests/` belongs to, or None."""
    parts = name.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "manifests" else None


def step_of_manifest_name(run: str, name: str) -> int | None:
    """The step a manifest name stands for, or None if `name` is not one of `run`'s."""
    tail = name.removeprefix(manifest_prefix(run))
    if tail == name or len(tail) != STEP_DIGITS or not (tail.isascii() and tail.isdigit()):
        return None
    return int(tail)


# Where packs live (docs/format.md §2): a format 4 or 5 manifest's under its run, where a
# key minted for that run alone may write them and no other run's key can; a format 1-3
# manifest's in the directory every run shared.
RUN_PACKS = "run-packs"
PACK_PREFIXES = ("packs/", f"{RUN_PACKS}/")


def pack_name(pack_id: str, run: str | None = None) -> str:
    """The object holding pack `pack_id` of `run`, or (None) in the shared `packs/`."""
    if not is_hex_id(pack_id):
        raise UnsafeObjectName(str(pack_id), "a pack id is 64 lowercase hex digits")
    if run is not None:
        return f"{run_packs_prefix(run)}{pack_id}"
    return f"packs/{pack_id[:2]}/{pack_id}"


def run_packs_prefix(run: str) -> str:
    return f"{RUN_PACKS}/{check_run_id(run)}/"


def pack_id_of_name(name: str) -> str | None:
    """The pack id an object name under either pack prefix stands for, or None."""
    if not name.startswith(PACK_PREFIXES):
        return None
    tail = name.rpartition("/")[2]
    return tail if is_hex_id(tail) else None
