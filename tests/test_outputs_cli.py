"""`slurm-geo logs` and `slurm-geo outputs fetch` read what a moved incarnation shipped home
(docs/format.md §11.9; issue 31 item 6) from the home store under the run's key; each
mistake is one line and an exit code."""

from __future__ import annotations

import json
import os

from slurm_geo.ckpt.format.keys import KeyFile
from slurm_geo.ckpt.repo.runkey import unwrap_run_keys
from slurm_geo.ckpt.stores.store import LocalDirStore
from slurm_geo.stage.outputs import ship
from tests.kit.cli import on_call_site, slurm_geo


def shipped_site(tmp_path):
    """onprem-7 (run-7) moved to rented:3, which shipped its log and results/ home."""
    config, _ = on_call_site(tmp_path)
    store = LocalDirStore(tmp_path / "pfs")
    ring = unwrap_run_keys(store, KeyFile(bytes(range(32))), "run-7", create=True)
    job = tmp_path / "rented-job"
    (job / "results").mkdir(parents=True)
    (job / "results" / "metrics.json").write_text('{"loss": 0.5}\n')
    (job / "out-3.txt").write_text("resumed at step 40\nstep 50\n")
    home = tmp_path / "alice" / "results"
    ship(store, ring, "run-7", "rented-3", job / "out-3.txt", {str(home): job / "results"},
         final=True)
    return config, home


def test_logs_shows_a_moved_incarnations_log_from_the_home_store(tmp_path):
    config, _ = shipped_site(tmp_path)
    (tmp_path / "out-7.txt").write_text("step 10\n")
    result = slurm_geo("logs", "onprem-7", config=config)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"==> onprem:7 generation 0: {tmp_path}/out-7.txt <==", "step 10",
        f"==> rented:3 generation 1: {tmp_path}/out-3.txt <==",
        "resumed at step 40", "step 50"]


def test_outputs_fetch_writes_the_outputs_where_the_job_named_them(tmp_path):
    config, home = shipped_site(tmp_path)
    result = slurm_geo("outputs", "fetch", "onprem-7", config=config)
    assert result.returncode == 0, result.stderr
    assert (home / "metrics.json").read_text() == '{"loss": 0.5}\n'
    assert result.stdout.splitlines() == [f"written    {home / 'metrics.json'}"]
    again = slurm_geo("outputs", "fetch", "onprem-7", "--json", config=config)
    assert json.loads(again.stdout)["unchanged"] == [str(home / "metrics.json")]
    elsewhere = slurm_geo("outputs", "fetch", "onprem-7", "--to", str(tmp_path / "copy"),
                          config=config)
    assert elsewhere.returncode == 0, elsewhere.stderr
    assert (tmp_path / "copy" / str(home).lstrip("/") / "metrics.json").exists()


def test_a_newer_file_at_home_is_kept_with_one_warning_and_exit_1(tmp_path):
    config, home = shipped_site(tmp_path)
    home.mkdir(parents=True)
    (home / "metrics.json").write_text("mine, newer\n")
    result = slurm_geo("outputs", "fetch", "onprem-7", config=config)
    assert result.returncode == 1
    assert (home / "metrics.json").read_text() == "mine, newer\n"
    assert result.stderr.splitlines() == [
        "slurm-geo: warning: 1 file(s) kept as they are here; fetch with --to DIR to see "
        "the shipped copies"]


def test_fetch_mistakes_are_one_line(tmp_path):
    config, _ = shipped_site(tmp_path)
    unknown = slurm_geo("outputs", "fetch", "onprem-404", config=config)
    assert (unknown.returncode, len(unknown.stderr.splitlines())) == (12, 1)
    assert "no logical job 'onprem-404'" in unknown.stderr
    (tmp_path / "a-file").write_text("")
    to_file = slurm_geo("outputs", "fetch", "onprem-7", "--to", str(tmp_path / "a-file"),
                        config=config)
    assert to_file.returncode != 0 and len(to_file.stderr.splitlines()) == 1
    assert "is not a directory" in to_file.stderr
    nothing = slurm_geo("outputs", "fetch", "onprem-9", config=config)
    assert nothing.returncode == 0
    assert nothing.stdout.strip() == "onprem-9: no moved incarnation shipped outputs"
    os.chmod(tmp_path / "master.key", 0o644)  # a key file open to others is refused
    bad_key = slurm_geo("outputs", "fetch", "onprem-7", config=config)
    assert bad_key.returncode != 0 and len(bad_key.stderr.splitlines()) == 1
    assert "Traceback" not in bad_key.stderr


def test_fetch_reads_another_store_when_told(tmp_path):
    config, home = shipped_site(tmp_path)
    other = tmp_path / "offsite"
    other.mkdir()
    pfs, away = LocalDirStore(tmp_path / "pfs"), LocalDirStore(other)
    for name in pfs.list("keys/") + pfs.list("outputs/"):  # as checkpoint-sync carries them
        away.put(name, pfs.get(name))
        if name.startswith("outputs/"):
            pfs.delete(name)
    at_home = slurm_geo("outputs", "fetch", "onprem-7", config=config)
    assert at_home.stdout.strip() == "onprem-7: no moved incarnation shipped outputs"
    told = slurm_geo("outputs", "fetch", "onprem-7", "--store", f"file://{other}",
                     config=config)
    assert told.returncode == 0, told.stderr
    assert (home / "metrics.json").exists()
    unknown = slurm_geo("outputs", "fetch", "onprem-7", "--store", "nowhere", config=config)
    assert unknown.returncode != 0 and len(unknown.stderr.splitlines()) == 1
    assert "store 'nowhere'" in unknown.stderr


def test_a_followed_log_fetches_only_its_new_parts(tmp_path, monkeypatch):
    from slurm_geo.cli.shipped import shipped_logs
    from slurm_geo.config.model import load_config
    from slurm_geo.federation.model import Incarnation
    from slurm_geo.federation.state.sqlite import FederationState
    from slurm_geo.stage import outputs

    config, home = shipped_site(tmp_path)
    state = FederationState(tmp_path / "fed.db", readonly=True)
    job = state.job("onprem-7")
    moved = next(i for i in state.incarnations("onprem-7") if i.cluster == "rented")
    state.close()
    assert isinstance(moved, Incarnation)
    read: list[str] = []
    real = outputs.read_part
    monkeypatch.setattr(outputs, "read_part", lambda *a: read.append(a[-1][0]) or real(*a))
    log_of = shipped_logs(load_config(config), job)
    assert log_of(moved) == b"resumed at step 40\nstep 50\n" and len(read) == 1
    job_dir = tmp_path / "rented-job"
    with open(job_dir / "out-3.txt", "a") as log:
        log.write("step 60\n")
    store = LocalDirStore(tmp_path / "pfs")
    ring = unwrap_run_keys(store, KeyFile(bytes(range(32))), "run-7")
    ship(store, ring, "run-7", "rented-3", job_dir / "out-3.txt",
         {str(home): job_dir / "results"})
    assert log_of(moved) == b"resumed at step 40\nstep 50\nstep 60\n"
    assert len(read) == 2  # the one part that changed, not the log again
