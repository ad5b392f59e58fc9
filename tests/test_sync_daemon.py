"""The daemon as systemd runs it, against a directory destination (no sandbox needed):
--once, SIGTERM, SIGHUP, sd_notify, metrics, and mistakes at start."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from slurm_geo.ckpt import LocalDirStore, Repository
from slurm_geo.sync.metrics import METRIC_NAMES
from tests.helpers import pack_files
from tests.kit.sync import (
    ROOT,
    Trainer,
    all_verified,
    free_port,
    master_key,
    rows,
    site_config,
    start_daemon,
    statuses,
    stop,
    wait_for,
)

MIB = 1024 * 1024


@pytest.fixture
def setup(tmp_path):
    """A root with a run being trained, an empty directory destination, a config."""
    (tmp_path / "root").mkdir()
    (tmp_path / "offsite").mkdir()
    key_file, key = master_key(tmp_path)
    trainer = Trainer(tmp_path / "root", key, "run-a")
    config = site_config(tmp_path / "site.toml", {"pfs": tmp_path / "root"},
                         f"file://{tmp_path / 'offsite'}", key_file=key_file,
                         state=tmp_path / "state.db")
    return tmp_path, trainer, config


def restore(directory, key, run, step):
    return Repository(LocalDirStore(directory), key).read_checkpoint(run, step)


def test_once_replicates_verifies_and_restores_byte_identical(setup):
    tmp_path, trainer, config = setup
    saved = {}
    for _ in range(3):
        trainer.train(5)
        saved[trainer.save()] = [bytes(t.data) for t in trainer.tensors()]

    proc = start_daemon(config, "--once", log=tmp_path / "log")
    assert proc.wait(60) == 0, (tmp_path / "log").read_text()

    assert statuses(tmp_path / "state.db") == {("run-a", s): "verified" for s in saved}
    for step, tensors in saved.items():
        checkpoint = restore(tmp_path / "offsite", trainer.repository.master_keys, "run-a", step)
        assert [bytes(t.data) for t in checkpoint.tensors] == tensors
    kinds = {r["kind"] for r in rows(tmp_path / "state.db", "SELECT kind FROM transfers")}
    # Verified as written: nothing read back (no "verify" transfer), a record left instead
    assert kinds == {"keys", "packs", "manifests", "latest", "verified"}
    log = (tmp_path / "log").read_text()
    assert log.count("event=verified") == 3 and "Traceback" not in log


def test_sigterm_ends_the_attempt_before_its_next_object_and_exits_0(setup):
    tmp_path, trainer, config = setup
    trainer.weights = trainer.rng.standard_normal((1024, 1024), dtype="float32")  # ~4 MB
    trainer.save()
    site_config(config, {"pfs": tmp_path / "root"}, f"file://{tmp_path / 'offsite'}",
                key_file=tmp_path / "master.key", state=tmp_path / "state.db",
                bandwidth_mb_s=0.5)  # ~8 s for the pack: SIGTERM lands while it waits
    proc = start_daemon(config, log=tmp_path / "log")
    wait_for(lambda: "uploading" in statuses(tmp_path / "state.db").values(), 30, "uploading")
    time.sleep(0.3)
    began = time.monotonic()
    assert stop(proc, signal.SIGTERM) == 0
    assert time.monotonic() - began < 5

    [row] = rows(tmp_path / "state.db", "SELECT * FROM replicas")
    assert (row["status"], row["charged"], row["failures"]) == ("pending", 0, 0)
    log = (tmp_path / "log").read_text()
    assert "event=stopping signal=SIGTERM" in log and "event=interrupted" in log
    assert log.rstrip().endswith("event=stopped")

    site_config(config, {"pfs": tmp_path / "root"}, f"file://{tmp_path / 'offsite'}",
                key_file=tmp_path / "master.key", state=tmp_path / "state.db")
    assert start_daemon(config, "--once", log=tmp_path / "log").wait(60) == 0
    assert set(statuses(tmp_path / "state.db").values()) == {"verified"}


def test_sighup_reloads_the_config_and_keeps_the_old_one_if_the_new_is_broken(setup):
    tmp_path, trainer, config = setup
    trainer.train(3)
    trainer.save()
    other_root = tmp_path / "root-b"
    other_root.mkdir()
    other = Trainer(other_root, trainer.repository.master_keys, "run-b", seed=1)
    other.train(2)
    other.save()
    proc = start_daemon(config, log=tmp_path / "log")
    try:
        state = tmp_path / "state.db"
        wait_for(lambda: all_verified(state, {("run-a", 3)}), 30, "run-a verified")
        site_config(config, {"pfs": tmp_path / "root", "scratch": other_root},
                    f"file://{tmp_path / 'offsite'}", key_file=tmp_path / "master.key",
                    state=state)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: all_verified(state, {("run-b", 2)}), 30, "run-b verified after HUP")

        config.write_text(config.read_text().replace('poll_interval_s = 0.2',
                                                      'poll_interval_s = -1'))
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "event=reload_failed" in (tmp_path / "log").read_text(), 10,
                 "reload refused")
        other.train(2)
        other.save()
        wait_for(lambda: all_verified(state, {("run-b", 4)}), 30, "still replicating")
    finally:
        assert stop(proc) == 0
    log = (tmp_path / "log").read_text()
    assert "event=reloaded roots=pfs,scratch" in log
    assert "poll_interval_s must be a number of seconds > 0" in log


def test_sd_notify_ready_watchdog_stopping(setup):
    tmp_path, trainer, config = setup
    trainer.train(1)
    trainer.save()
    address = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(address))
        sock.settimeout(10)
        proc = start_daemon(config, log=tmp_path / "log",
                            env={"NOTIFY_SOCKET": str(address), "WATCHDOG_USEC": "400000"})
        messages = [sock.recv(4096).decode()]
        while len([m for m in messages if m == "WATCHDOG=1"]) < 3:
            messages.append(sock.recv(4096).decode())
        assert stop(proc) == 0
        messages += _drain(sock)
    assert messages[0].startswith("READY=1\nSTATUS=replicating to offsite")
    assert any(m.startswith("STOPPING=1") for m in messages)
    assert messages.index(next(m for m in messages if m.startswith("STOPPING=1"))) > 3


def _drain(sock: socket.socket) -> list[str]:
    sock.settimeout(0.5)
    found = []
    try:
        while True:
            found.append(sock.recv(4096).decode())
    except TimeoutError:
        return found


def test_metrics_serve_the_documented_names(setup):
    tmp_path, trainer, config = setup
    for _ in range(2):
        trainer.train(2)
        trainer.save()
    port = free_port()
    proc = start_daemon(config, "--metrics-port", str(port), log=tmp_path / "log")
    try:
        wait_for(lambda: all_verified(tmp_path / "state.db", {("run-a", 2), ("run-a", 4)}), 30,
                 "verified")
        text = wait_for(lambda: _scrape(port), 10, "metrics")
    finally:
        stop(proc)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    names = {name for name, _ in samples}
    # the scrub report's age shows once a scrub turn has looked for one (a day after this)
    assert {n if n in names else n + "_total" for n in METRIC_NAMES
            if n != "slurm_geo_sync_scrub_report_age_seconds"} <= names
    offsite = (("destination", "offsite"),)
    assert samples[("slurm_geo_sync_replicas", (*offsite, ("status", "verified")))] == 2
    assert samples[("slurm_geo_sync_queue_depth", offsite)] == 0
    assert samples[("slurm_geo_sync_replication_lag_seconds", offsite)] == 0
    assert samples[("slurm_geo_sync_runs", (*offsite, ("state", "verified")))] == 1
    assert samples[("slurm_geo_sync_runs", (*offsite, ("state", "waiting")))] == 0
    assert samples[("slurm_geo_sync_unsafe_files_skipped_total", ())] == 0
    assert "run-a" not in text  # unauthenticated: no run is named (docs/checkpoint-sync.md)
    assert samples[("slurm_geo_sync_transferred_bytes_total",
                    (("destination", "offsite"), ("direction", "upload")))] > 0
    assert samples[("slurm_geo_sync_destination_up", offsite)] == 1
    docs = (ROOT / "docs" / "checkpoint-sync.md").read_text()
    assert all(name in docs for name in METRIC_NAMES)


def _scrape(port: int) -> str | None:
    try:
        return requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.RequestException:
        return None


@pytest.mark.parametrize("mutate, code, message", [
    (lambda text: text.replace("[sync]", "[sink]"), 3, "unknown key(s) sink"),
    (lambda text: text.split("[sync]")[0], 3, "has no [sync] table"),
    (lambda text: text.replace('"destination": "offsite"', '"destination": "tape"')
     .replace('destination = "offsite"', 'destination = "tape"'), 3,
     "destination 'tape' is not one of [stores]"),
])
def test_a_config_mistake_is_one_line_and_a_stable_exit_code(setup, mutate, code, message):
    tmp_path, _trainer, config = setup
    config.write_text(mutate(config.read_text()))
    result = subprocess.run([sys.executable, "-m", "slurm_geo.sync.entry",
                             "--config", str(config), "--once"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == code
    assert message in result.stderr and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_a_key_file_open_to_others_is_refused(setup):
    tmp_path, _trainer, config = setup
    os.chmod(tmp_path / "master.key", 0o644)
    result = subprocess.run([sys.executable, "-m", "slurm_geo.sync.entry",
                             "--config", str(config), "--once"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 28 and "chmod 600" in result.stderr


@pytest.mark.parametrize("policy, expected", [("idle", 5), ("batch", 3), ("normal", 0)])
def test_priority_is_lowered_for_the_threads_started_after(policy, expected):
    code = ("import os, threading, psutil\n"
            "from slurm_geo.daemon.process import apply_priority\n"
            f"apply_priority(15, 'idle', {policy!r})\n"
            "seen = []\n"
            "t = threading.Thread(target=lambda: seen.append((os.getpriority(os.PRIO_PROCESS, 0),"
            " os.sched_getscheduler(0))))\n"
            "t.start(); t.join()\n"
            "print(seen[0][0], seen[0][1], int(psutil.Process().ionice().ioclass))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["15", str(expected), "3"]  # 3: IOPRIO_CLASS_IDLE


def test_the_running_daemon_scrubs_finds_a_flipped_replica_and_repairs_it(setup):
    tmp_path, trainer, config = setup
    trainer.train(3)
    step = trainer.save()
    site_config(config, {"pfs": tmp_path / "root"}, f"file://{tmp_path / 'offsite'}",
                key_file=tmp_path / "master.key", state=tmp_path / "state.db",
                scrub_interval_s=0, scrub_at="here")
    proc = start_daemon(config, log=tmp_path / "log")
    try:
        state = tmp_path / "state.db"
        wait_for(lambda: all_verified(state, {("run-a", step)}), 30, "verified")
        wait_for(lambda: rows(state, "SELECT scrubbed_at FROM replicas WHERE scrubbed_at "
                                     "IS NOT NULL"), 30, "scrubbed once")
        [pack] = pack_files(tmp_path / "offsite")
        damaged = bytearray(pack.read_bytes())
        damaged[len(damaged) // 2] ^= 0x01
        pack.write_bytes(bytes(damaged))
        wait_for(lambda: rows(state, "SELECT * FROM replicas WHERE repairs = 1 AND "
                                     "status = 'verified'"), 30, "repaired")
    finally:
        assert stop(proc) == 0
    log = (tmp_path / "log").read_text()
    assert f"event=scrub_corrupted run=run-a step={step}" in log
    assert "event=repairing" in log and "Traceback" not in log
    restored = restore(tmp_path / "offsite", trainer.repository.master_keys, "run-a", step)
    assert [bytes(t.data) for t in restored.tensors] == [bytes(t.data)
                                                        for t in trainer.tensors()]


def test_the_running_daemon_repairs_what_scrub_here_finds_at_the_destination(setup):
    """scrub_at = "destination" (the default): scrub-here, run beside the destination with
    no key, names the flipped pack in scrub/report; the daemon reads that report, not the
    replica, and repairs."""
    tmp_path, trainer, config = setup
    trainer.train(3)
    step = trainer.save()
    site_config(config, {"pfs": tmp_path / "root"}, f"file://{tmp_path / 'offsite'}",
                key_file=tmp_path / "master.key", state=tmp_path / "state.db",
                scrub_interval_s=0, retry_base_s=1)
    proc = start_daemon(config, log=tmp_path / "log")
    try:
        state = tmp_path / "state.db"
        wait_for(lambda: all_verified(state, {("run-a", step)}), 30, "verified")
        [pack] = pack_files(tmp_path / "offsite")
        damaged = bytearray(pack.read_bytes())
        damaged[len(damaged) // 2] ^= 0x01
        flipped = pack.with_name(".flipped")  # in one step: no scrub turn sees it short
        flipped.write_bytes(bytes(damaged))
        flipped.replace(pack)
        here = subprocess.run([sys.executable, "-m", "slurm_geo", "sync", "scrub-here",
                               "--store", f"file://{tmp_path / 'offsite'}"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "SLURM_GEO_KEY_FILE": "/nonexistent"})
        assert here.returncode == 1 and pack.name in here.stdout, (here.stdout, here.stderr)
        wait_for(lambda: rows(state, "SELECT * FROM replicas WHERE repairs = 1 AND "
                                     "status = 'verified'"), 30, "repaired")
    finally:
        assert stop(proc) == 0
    log = (tmp_path / "log").read_text()
    assert f"event=scrub_corrupted run=run-a step={step}" in log and "Traceback" not in log
    scrubbed = rows(state, "SELECT SUM(scrubbed_bytes) AS n FROM replicas")[0]["n"]
    assert 0 < scrubbed < pack.stat().st_size  # KB: the report, key, manifest; not the pack
    restored = restore(tmp_path / "offsite", trainer.repository.master_keys, "run-a", step)
    assert [bytes(t.data) for t in restored.tensors] == [bytes(t.data)
                                                        for t in trainer.tensors()]
