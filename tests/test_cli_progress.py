"""The progress bar: drawn on a terminal with bytes, throughput and ETA, silent otherwise;
and the commands that draw it, under a real pseudo-terminal and in scripts."""

from __future__ import annotations

import io
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_geo.ckpt import LocalDirStore, Metadata, Repository, Tensor, load_master_key
from slurm_geo.ckpt.files.skeleton import encode_skeleton
from slurm_geo.cli.progress import (
    REDRAW_S,
    Progress,
    bar_line,
    final_line,
    human_bytes,
    human_seconds,
    progress,
)
from tests.helpers import pack_files
from tests.kit.clock import ManualClock

MIB = 1024 * 1024


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("count, text", [
    (0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (10 * MIB, "10.0 MiB"),
    (3 * 1024 * MIB, "3.0 GiB"), (5 * 1024 ** 4, "5.0 TiB"),
])
def test_bytes_read_in_binary_units(count, text):
    assert human_bytes(count) == text


@pytest.mark.parametrize("seconds, text", [
    (0.4, "0 s"), (42.3, "42 s"), (185, "3m05s"), (7300, "2h01m"),
])
def test_durations_read_at_a_glance(seconds, text):
    assert human_seconds(seconds) == text


def test_the_bar_line_has_bytes_throughput_and_eta():
    line = bar_line("push r@20", 25 * MIB, 100 * MIB, 5.0)
    assert line.startswith("push r@20  [")
    assert "25%" in line and "25.0 MiB / 100.0 MiB" in line
    assert "5.0 MiB/s" in line and line.endswith("ETA 15 s")


def test_without_a_total_there_is_no_bar_nor_eta():
    assert bar_line("retry r", 3 * MIB, None, 2.0) == "retry r  3.0 MiB  1.5 MiB/s"


def test_a_narrow_terminal_drops_the_bar_before_the_figures():
    wide = bar_line("pull r@1", MIB, 4 * MIB, 1.0, columns=120)
    narrow = bar_line("pull r@1", MIB, 4 * MIB, 1.0, columns=50)
    assert "[" in wide and "[" not in narrow and len(narrow) <= 50


def test_counts_of_objects_are_not_bytes():
    assert "3/10 manifests" in bar_line("check manifests", 3, 10, 1.0, unit="manifests")
    assert final_line("check manifests", 10, 2.0, unit="manifests") == (
        "check manifests  10 manifests in 2.0 s (5.0 manifests/s)")


def test_redraws_are_throttled_and_the_final_line_stays():
    out, clock = Terminal(), ManualClock(100.0)
    bar = Progress("push r@1", out, draw=True, clock=clock)
    for done in range(1, 11):  # ten reports within one redraw interval: one line drawn
        clock.now += REDRAW_S / 20
        bar(done * MIB, 40 * MIB)
    assert out.getvalue().count("\r") == 1
    clock.now += REDRAW_S
    bar(20 * MIB, 40 * MIB)
    assert out.getvalue().count("\r") == 2 and "20.0 MiB / 40.0 MiB" in out.getvalue()
    clock.now = 100.4
    bar(40 * MIB, 40 * MIB)
    bar.finish()
    assert out.getvalue().endswith("\rpush r@1  40.0 MiB in 0.4 s (100.0 MiB/s)\x1b[K\n")


def test_a_second_stage_leaves_the_first_ones_line():
    out, clock = Terminal(), ManualClock(100.0)
    bar = Progress("check manifests", out, draw=True, unit="manifests", clock=clock)
    clock.now += 1
    bar(4, 4)
    packs = bar.then("check packs")
    clock.now += 2
    packs(MIB, 2 * MIB)
    bar.finish()
    lines = out.getvalue().split("\n")
    assert lines[0].endswith("check manifests  4 manifests in 1.0 s (4.0 manifests/s)\x1b[K")
    assert "check packs  [" in lines[1] and "512.0 KiB/s" in lines[1]


def test_silent_when_not_a_terminal_or_asked_for_json_and_counts_all_the_same():
    for stream, as_json in ((io.StringIO(), False), (Terminal(), True)):
        with progress("pull r@1", as_json, stream=stream) as bar:
            bar(MIB, MIB)
        assert stream.getvalue() == "" and bar.done == MIB and bar.seconds >= 0


def test_an_error_wipes_the_bar_and_leaves_no_final_line():
    out = Terminal()
    with pytest.raises(RuntimeError), progress("pull r@1", False, stream=out) as bar:
        bar(1, 2)
        raise RuntimeError("store gone")
    assert out.getvalue().endswith("\r\x1b[K") and " in " not in out.getvalue()


# --- the commands ---------------------------------------------------------------------

def slurm_geo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slurm_geo", *args], capture_output=True,
                          text=True, timeout=120, check=False)


def under_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run `slurm-geo ARGS` with stderr on a pseudo-terminal: exit code, stdout, stderr."""
    leader, follower = pty.openpty()
    child = subprocess.Popen([sys.executable, "-m", "slurm_geo", *args],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower)
    os.close(follower)
    drawn = b""
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the child closed its end
            break
        if not data:
            break
        drawn += data
    os.close(leader)
    assert child.stdout is not None
    out = child.stdout.read().decode()
    return child.wait(timeout=120), out, drawn.decode()


@pytest.fixture
def key_file(tmp_path) -> Path:
    path = tmp_path / "master.key"
    assert slurm_geo("keys", "init", str(path)).returncode == 0
    return path


@pytest.fixture
def checkpoint(tmp_path, key_file) -> Path:
    """A directory holding run `r` at step 5: a state dict of one 3 MiB tensor, in
    several chunks."""
    root = tmp_path / "pfs"
    root.mkdir()
    data = os.urandom(3 * MIB)
    _, skeleton = encode_skeleton({"w": data}, lambda value: value is data)
    Repository(LocalDirStore(root), load_master_key(key_file)).write_checkpoint(
        "r", [Tensor("w", "uint8", (len(data),), data)], skeleton,
        Metadata(5, 5, 1, 0.5, "2026-12-04T12:00:00Z", "onprem", "42"))
    return root


def stored_pack_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in pack_files(root))


def test_push_and_pull_draw_the_bar_on_a_terminal(tmp_path, key_file, checkpoint):
    offsite = tmp_path / "offsite"
    offsite.mkdir()
    key = ["--key-file", str(key_file)]
    code, out, drawn = under_a_terminal("ckpt", "push", str(checkpoint), "--to",
                                        f"file://{offsite}", *key)
    assert (code, out) == (0, "pushed r@5\n"), drawn
    assert "push r@5  [" in drawn and "/s" in drawn and "ETA" in drawn
    assert " in " in drawn.splitlines()[-1]  # the final line: bytes in seconds

    code, out, drawn = under_a_terminal("ckpt", "pull", "r", "--from", f"file://{offsite}",
                                        "--to", str(tmp_path / "back"), *key)
    assert code == 0, drawn
    assert "pull r@5  [" in drawn and "verify r@5  [" in drawn and "3.0 MiB in" in drawn


def test_in_scripts_stderr_stays_empty_and_json_says_bytes_and_seconds(tmp_path, key_file,
                                                                        checkpoint):
    offsite = tmp_path / "offsite"
    offsite.mkdir()
    key = ["--key-file", str(key_file)]
    pushed = slurm_geo("ckpt", "push", str(checkpoint), "--to", f"file://{offsite}", "--json",
                       *key)
    assert pushed.returncode == 0 and pushed.stderr == ""
    summary = json.loads(pushed.stdout)
    assert summary["bytes"] == summary["bytes_copied"] == stored_pack_bytes(offsite)
    assert isinstance(summary["seconds"], float) and summary["seconds"] >= 0

    pulled = slurm_geo("ckpt", "pull", "r@5", "--from", f"file://{offsite}", "--to",
                       str(tmp_path / "back"), *key)
    assert pulled.returncode == 0 and pulled.stderr == ""
    pulled = slurm_geo("ckpt", "pull", "r@5", "--from", f"file://{offsite}", "--to",
                       str(tmp_path / "again"), "--json", *key)
    summary = json.loads(pulled.stdout)
    assert summary["bytes"] == stored_pack_bytes(tmp_path / "again") and "seconds" in summary

    verified = json.loads(slurm_geo("ckpt", "verify", "r", "--store", f"file://{offsite}",
                                    "--json", *key).stdout)
    manifest = Repository(LocalDirStore(offsite), load_master_key(key_file)).manifest("r", 5)
    assert verified["ok"] and verified["seconds"] >= 0
    assert verified["bytes"] == sum(ref.size for ref in manifest.refs())  # tensors and extra

    checked = slurm_geo("ckpt", "check", "--store", f"file://{offsite}", "--read-data",
                        "--json", *key)
    assert checked.returncode == 0 and checked.stderr == ""
    report = json.loads(checked.stdout)
    assert report["bytes"] == report["bytes_read"] >= stored_pack_bytes(offsite)
    assert isinstance(report["seconds"], float)


def test_a_torch_file_pull_and_push_report_the_tensor_bytes(tmp_path, key_file, checkpoint):
    key = ["--key-file", str(key_file)]
    model = tmp_path / "model.pt"
    code, _, drawn = under_a_terminal("ckpt", "pull", "r@5", "--from", f"file://{checkpoint}",
                                      "--to", str(model), *key)
    assert code == 0 and "pull r@5  [" in drawn and "3.0 MiB in" in drawn, drawn
    pulled = slurm_geo("ckpt", "pull", "r@5", "--from", f"file://{checkpoint}", "--to",
                       str(tmp_path / "again.pt"), "--json", *key)
    assert pulled.stderr == "" and json.loads(pulled.stdout)["bytes"] == 3 * MIB

    store = tmp_path / "store"
    store.mkdir()
    code, _, drawn = under_a_terminal("ckpt", "push", str(model), "--to", f"file://{store}",
                                      "--run", "ft", "--step", "1", *key)
    assert code == 0 and "push ft@1  [" in drawn and "ETA" in drawn, drawn
    pushed = slurm_geo("ckpt", "push", str(model), "--to", f"file://{store}", "--run", "ft",
                       "--step", "2", "--json", *key)
    assert pushed.stderr == "" and json.loads(pushed.stdout)["bytes"] == 3 * MIB
    assert isinstance(json.loads(pushed.stdout)["seconds"], float)


def test_the_drills_json_says_the_bytes_and_seconds_of_its_transfers():
    from tests.kit.drills import report

    summary = report().to_json()
    assert (summary["bytes"], summary["seconds"]) == (summary["replicated_bytes"],
                                                      summary["replication_seconds"])
