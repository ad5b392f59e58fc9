"""A moved incarnation's log and outputs shipped home (slurm_geo.stage.outputs, format.md
§11.9; issue 31 item 6): a round trip, incremental calls that send what changed only, a
tampered object refused, another run's key refused, and the owner's fetch that never
replaces a newer file."""

from __future__ import annotations

import os
import random

import pytest

from slurm_geo.ckpt.errors import CorruptObject, UnsafeObjectName, WrongKey
from slurm_geo.ckpt.format.keys import RunKeyRing
from slurm_geo.stage import outputs as out
from slurm_geo.stage.outputs_fetch import fetch_outputs, shipped_indexes
from tests.helpers import eventually
from tests.kit.trees import CountingStore

RUN, INC = "run-a", "rented-42"


@pytest.fixture
def site(tmp_path):
    (tmp_path / "store").mkdir()
    job = tmp_path / "job"
    (job / "results" / "sub").mkdir(parents=True)
    (job / "results" / "metrics.json").write_text('{"loss": 1.5}\n')
    (job / "results" / "sub" / "weights.bin").write_bytes(random.Random(0).randbytes(300_000))
    (job / "slurm-42.out").write_text("epoch 1\n")
    return CountingStore(tmp_path / "store"), RunKeyRing.of(os.urandom(32)), job


def ship(store, ring, job, final=False, home="/home/alice/results"):
    return out.ship(store, ring, RUN, INC, job / "slurm-42.out", {home: job / "results"},
                    final=final)


def test_a_round_trip_writes_the_outputs_at_their_home_paths(site, tmp_path):
    store, ring, job = site
    report = ship(store, ring, job)
    assert report.index == 1 and report.files_read == 3 and report.parts_sent == 3
    assert out.read_log(store, ring, RUN, INC) == b"epoch 1\n"
    fetched = fetch_outputs(store, ring, RUN, to=tmp_path / "home")
    home = tmp_path / "home" / "home" / "alice" / "results"
    assert (home / "metrics.json").read_text() == '{"loss": 1.5}\n'
    assert (home / "sub" / "weights.bin").read_bytes() == \
        (job / "results" / "sub" / "weights.bin").read_bytes()
    assert os.stat(home / "metrics.json").st_mtime_ns == \
        os.stat(job / "results" / "metrics.json").st_mtime_ns
    assert len(fetched.written) == 2 and fetched.incarnations == [INC]
    again = fetch_outputs(store, ring, RUN, to=tmp_path / "home")
    assert again.written == [] and len(again.unchanged) == 2


def test_a_periodic_call_sends_what_changed_only(site):
    store, ring, job = site
    ship(store, ring, job)
    store.puts.clear()
    assert ship(store, ring, job).index is None and store.puts == {}  # nothing changed
    with open(job / "slurm-42.out", "a") as log:
        log.write("epoch 2\n")
    (job / "results" / "metrics.json").write_text('{"loss": 0.9}\n')
    report = ship(store, ring, job)
    assert report.index == 2 and report.files_read == 2  # the log and metrics, not weights
    assert report.parts_sent == 2 and len(store.puts) == 3  # two parts and the index
    final = ship(store, ring, job, final=True)
    assert final.index == 3 and final.parts_sent == 0  # the final mark, no new part
    assert out.read_log(store, ring, RUN, INC) == b"epoch 1\nepoch 2\n"
    [index] = shipped_indexes(store, ring, RUN)
    assert index.final and index.number == 3


def test_a_log_that_grows_past_a_part_resends_only_its_tail(site, monkeypatch):
    store, ring, job = site
    monkeypatch.setattr(out, "PART_SIZE", 1024)
    (job / "slurm-42.out").write_bytes(b"x" * 3000)
    ship(store, ring, job)
    with open(job / "slurm-42.out", "ab") as log:
        log.write(b"y" * 2000)
    report = ship(store, ring, job)
    assert report.files_read == 1 and report.parts_sent == 3  # from offset 2048 on
    assert out.read_log(store, ring, RUN, INC) == b"x" * 3000 + b"y" * 2000


def test_a_tampered_part_or_index_is_refused(site, tmp_path):
    store, ring, job = site
    ship(store, ring, job)
    [index] = shipped_indexes(store, ring, RUN)
    part = out.part_name(RUN, INC, index.log.parts[0][0])
    sealed = bytearray(store.get(part))
    sealed[-20] ^= 1
    store.put(part, bytes(sealed))
    with pytest.raises(CorruptObject):
        out.read_log(store, ring, RUN, INC)
    other = out.part_name(RUN, INC, index.outputs[0].entries[-1].parts[0][0])
    store.put(part, store.get(other))  # a sound part under another's name
    with pytest.raises(CorruptObject):
        out.read_log(store, ring, RUN, INC)
    name = out.index_name(RUN, INC, 1)
    store.put(out.index_name(RUN, INC, 2), store.get(name))  # an index moved
    with pytest.raises(CorruptObject):
        out.read_index(store, ring, RUN, INC, 2)
    assert not (tmp_path / "home").exists()


def test_another_runs_key_opens_nothing(site, tmp_path):
    store, ring, job = site
    ship(store, ring, job)
    stranger = RunKeyRing.of(os.urandom(32))
    with pytest.raises(WrongKey):
        out.read_log(store, stranger, RUN, INC)
    with pytest.raises(WrongKey):
        fetch_outputs(store, stranger, RUN, to=tmp_path / "home")


def test_a_newer_file_at_home_is_kept_and_reported(site, tmp_path):
    store, ring, job = site
    home = tmp_path / "home" / "alice" / "results"
    (home / "sub").mkdir(parents=True)
    (home / "metrics.json").write_text("edited at home after the move\n")
    (home / "sub" / "weights.bin").write_bytes(b"old")
    os.utime(home / "sub" / "weights.bin", ns=(1, 1))  # older than the shipped one
    ship(store, ring, job, home=str(home))
    fetched = fetch_outputs(store, ring, RUN)
    assert (home / "metrics.json").read_text() == "edited at home after the move\n"
    assert fetched.kept == [(str(home / "metrics.json"), "newer here than the shipped copy")]
    assert fetched.written == [str(home / "sub" / "weights.bin")]


def test_a_link_at_the_target_is_never_written_through(site, tmp_path):
    store, ring, job = site
    home = tmp_path / "home" / "results"
    home.mkdir(parents=True)
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    (home / "metrics.json").symlink_to(victim)
    ship(store, ring, job, home=str(home))
    fetched = fetch_outputs(store, ring, RUN)
    assert victim.read_text() == "mine\n"
    assert (str(home / "metrics.json"), "not a regular file here") in fetched.kept


def test_names_are_checked():
    with pytest.raises(UnsafeObjectName):
        out.outputs_prefix(RUN, "../x")
    assert out.incarnation_name("rented", 42) == "rented-42"


def test_links_in_an_output_directory_are_skipped(site):
    store, ring, job = site
    (job / "results" / "link").symlink_to("/etc/passwd")
    report = ship(store, ring, job)
    assert report.skipped == (str(job / "results" / "link"),)
    [index] = shipped_indexes(store, ring, RUN)
    assert "link" not in {e.path for e in index.outputs[0].entries}


def test_a_relative_home_path_is_one_clear_error(site):
    store, ring, job = site
    with pytest.raises(out.OutputsError, match="absolute"):
        ship(store, ring, job, home="results")


def test_a_periodic_shipper_ships_while_the_job_runs_and_once_more_at_stop(site):
    store, ring, job = site
    shipper = out.PeriodicShipper(store, ring, RUN, INC, job / "slurm-42.out",
                                  {"/home/alice/results": job / "results"},
                                  every_s=0.05).start()
    eventually(lambda: out.read_log(store, ring, RUN, INC), lambda log: log == b"epoch 1\n")
    with open(job / "slurm-42.out", "a") as log:
        log.write("epoch 2\n")
    eventually(lambda: out.read_log(store, ring, RUN, INC),
               lambda log: log == b"epoch 1\nepoch 2\n")
    final = shipper.stop()
    assert final.index is not None and shipper.last_error is None
    [index] = shipped_indexes(store, ring, RUN)
    assert index.final and index.number == final.index
