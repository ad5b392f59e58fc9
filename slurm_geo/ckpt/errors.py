"""Typed checkpoint failures; each names the object it concerns and what to do about it.

Pure layers (codec, chunking) know no object names: they raise `MalformedData`, and the
layer that fetched the bytes re-raises it as `CorruptObject` naming the object.
"""

from __future__ import annotations

from slurm_geo.errors import SlurmGeoError
from slurm_geo.exitcodes import ExitCode


class MalformedData(ValueError):
    """Bytes that do not decode; raised by pure functions that do not know the object."""


class CkptError(SlurmGeoError):
    """Base of every checkpoint-store error; `name` is the object concerned."""

    exit_code = ExitCode.STORE

    def __init__(self, name: str, message: str):
        self.name = name
        super().__init__(message)


class CorruptObject(CkptError):
    exit_code = ExitCode.CORRUPT_OBJECT

    def __init__(self, name: str, detail: str):
        self.detail = detail
        super().__init__(
            name,
            f"object '{name}' is corrupt ({detail}); restore it from another replica or "
            "resume from an earlier checkpoint",
        )


class UnsupportedFormat(CkptError):
    exit_code = ExitCode.UNSUPPORTED_FORMAT

    def __init__(self, name: str, version: object, readable: str = "1"):
        self.version = version
        super().__init__(
            name,
            f"object '{name}' has format version {version!r}, this slurm-geo reads version "
            f"{readable}; upgrade slurm-geo",
        )


class LegacyObject(UnsupportedFormat):
    """A version 1 fence or promotion marker (docs/format.md §8.4): sealed under the run's
    data key, which every job of the run holds, so it proves nothing and is refused."""

    def __init__(self, name: str, what: str, remedy: str):
        self.version = 1
        CkptError.__init__(
            self, name,
            f"object '{name}' is a version 1 {what}, sealed under the run's data key, which "
            f"jobs hold: it is not trusted (docs/format.md §8.4); {remedy}",
        )


class WrongKey(CkptError):
    exit_code = ExitCode.WRONG_KEY

    def __init__(self, name: str, expected: str, held: str):
        super().__init__(
            name,
            f"object '{name}' was sealed with key {expected}, not with the key given ({held}); "
            "use the site master key this run was written with",
        )


class UnsafeObjectName(CkptError):
    exit_code = ExitCode.UNSAFE_NAME

    def __init__(self, name: str, reason: str):
        super().__init__(name, f"object name {name!r} is refused: {reason}")


class UnsafeStoreDirectory(CkptError):
    """A shared store's directory another user owns, or may write without the sticky bit,
    or an object another user made under a name we write (docs/stores.md): never written
    into, lest they remove what we write. The message names the path, whose, the fix."""

    exit_code = ExitCode.UNSAFE_NAME

    def __init__(self, name: str, message: str):
        CkptError.__init__(self, name, message)


class StoreUnavailable(CkptError):
    """A store that could not serve a request. `permanent`: retrying cannot help (bad
    credentials, no such bucket), so `RetryingStore` gives up at once. `side`: which store
    of a transfer is out ("root", "source", "destination"), tagged by the `PacedStore` the
    failure passed through; None where no transfer named it."""

    exit_code = ExitCode.STORE_UNAVAILABLE
    permanent: bool
    side: str | None

    def __init__(self, name: str, detail: str, *, permanent: bool = False,
                 side: str | None = None):
        self.permanent = permanent
        self.side = side
        super().__init__(
            name, f"store cannot access '{name}' ({detail}); check the store path and its mount"
        )


class ObjectMissing(CkptError):
    exit_code = ExitCode.OBJECT_MISSING

    def __init__(self, name: str):
        super().__init__(
            name,
            f"object '{name}' does not exist; the checkpoint is incomplete in this store, "
            "resume from another replica or an earlier checkpoint",
        )


class StepMismatch(CkptError):
    exit_code = ExitCode.STEP_MISMATCH

    def __init__(self, name: str, global_step: int, optimizer_step: int):
        super().__init__(
            name,
            f"checkpoint '{name}' refused: weights are from step {global_step} but the "
            f"optimizer state is from step {optimizer_step}; save both from the same step",
        )


class KeyFileError(CkptError):
    exit_code = ExitCode.KEY_FILE

    def __init__(self, name: str, detail: str):
        super().__init__(
            name, f"master key file '{name}': {detail}; fix it or point to the site key file"
        )


class ImmutableCheckpoint(CkptError):
    """Tier 3: a promoted checkpoint is never overwritten or deleted."""

    exit_code = ExitCode.IMMUTABLE

    def __init__(self, name: str):
        super().__init__(
            name,
            f"checkpoint '{name}' is promoted (immutable); save under another step, or leave it",
        )


class StoreBusy(CkptError):
    """Garbage collection refused while a push may still be writing packs."""

    exit_code = ExitCode.STORE_BUSY

    def __init__(self, name: str, since: str, stale_at: str = ""):
        until = f" or once the lock is stale ({stale_at})" if stale_at else ""
        super().__init__(
            name,
            f"a push holds lock '{name}' (since {since}); run gc again once it has "
            f"finished{until}",
        )
