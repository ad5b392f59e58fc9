"""Every way the config file can be wrong is one line naming it (load_config): missing,
unreadable, a directory, not UTF-8, not TOML, nested too deep, a table where a value goes
(or a value where a table goes), hostile keys, huge values, and no NaN or inf anywhere."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from slurm_geo.config import load_config
from slurm_geo.config.model import MAX_DEPTH
from slurm_geo.errors import ConfigError

GOOD = """
[site]
home_cluster = "onprem"
[clusters.onprem]
region = "home"
access = "cli"
slurm_conf = "/etc/slurm/slurm.conf"
"""


def refusal(path: Path) -> str:
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert "\n" not in message and "\r" not in message, message
    assert len(message) < 400, message
    assert caught.value.exit_code == 3
    return message


def config(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "site.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return path


class Unreadable(type(Path())):  # what a file root may not read (NFS root squash) gives
    def read_bytes(self) -> bytes:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))


class Failing(type(Path())):
    def read_bytes(self) -> bytes:
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(self))


def test_the_good_config_loads(tmp_path):
    assert load_config(config(tmp_path, GOOD)).home_cluster == "onprem"


@pytest.mark.parametrize("make, expected", [
    (lambda d: d / "absent.toml", "absent.toml does not exist; set SLURM_GEO_CONFIG"),
    (lambda d: d, "is a directory; SLURM_GEO_CONFIG must name the file itself"),
    (lambda d: Unreadable(d / "site.toml"), "site.toml cannot be read by this user"),
    (lambda d: Failing(d / "site.toml"), "site.toml cannot be read: Input/output error"),
], ids=["missing", "directory", "permission", "io-error"])
def test_a_file_that_cannot_be_read_is_one_line(tmp_path, make, expected):
    assert expected in refusal(make(tmp_path))


@pytest.mark.parametrize("text, expected", [
    (b"[site]\nhome_cluster = \"\xff\xfe\"\n", "is not UTF-8 text (byte 23)"),
    (b"\xef\xbb\xbf\x00\x00", "is not valid TOML"),
    ("[site\n", "is not valid TOML"),
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", "nests values too deeply to read"),
    ("a = " + "{b = " * 3000 + "1" + "}" * 3000 + "\n", "nests values too deeply to read"),
    ("[site]\nx = " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n",
     f"site.toml [site]: values nested more than {MAX_DEPTH} deep"),
    ("[clusters.onprem.prices.a.b.c.d.e.f.g]\n",
     f"[clusters]: values nested more than {MAX_DEPTH} deep"),
], ids=["latin1", "nul", "toml", "deep-list", "deep-inline-table", "over-max-depth",
        "deep-tables"])
def test_a_file_that_does_not_parse_is_one_line(tmp_path, text, expected):
    assert expected in refusal(config(tmp_path, text))


CLUSTER = {"region": '"home"', "access": '"cli"', "slurm_conf": '"/etc/slurm/slurm.conf"'}
WRONG = [  # (key, TOML value, what the message says; None: accepted)
    ("region", '{nested = "table"}', "region must be 1-64 letters"),
    ("region", "[1, 2]", "region must be 1-64 letters"),
    ("timeout_s", "{s = 1}", "timeout_s must be a number of seconds > 0, got {'s': 1}"),
    ("timeout_s", "nan", "timeout_s must be a number of seconds > 0, got nan"),
    ("timeout_s", "inf", "timeout_s must be a number of seconds > 0, got inf"),
    ("timeout_s", "-inf", "got -inf"),
    ("prices", "5", "[clusters.onprem].prices must be a table"),
    ("prices", "{gpu_hour = nan}", "gpu_hour must be a number >= 0, got nan"),
    ("partitions", "[[1]]", "partitions must be a list of names"),
    ("slurm_conf", '"/x' + "y" * 5000 + '"', None),  # a long path is still a path
    ("region", '"' + "y" * 5000 + '"', "got 'yyyyyyyyyy"),  # the value is cut short
    ('"a\\nb"', "1", "unknown key(s) a?b; allowed"),
    ('"\\u001b[31mred"', "1", "unknown key(s) ?[31mred"),
]


def cluster_with(key: str, value: str) -> str:
    table = {**CLUSTER, key: value}
    return GOOD.split("[clusters.onprem]")[0] + "[clusters.onprem]\n" + "".join(
        f"{k} = {v}\n" for k, v in table.items())


@pytest.mark.parametrize("key, value, expected", WRONG, ids=[f"{k}-{i}" for i, (k, _, _)
                                                              in enumerate(WRONG)])
def test_a_wrong_value_is_one_short_line(tmp_path, key, value, expected):
    path = config(tmp_path, cluster_with(key, value))
    if expected is None:
        load_config(path)
        return
    assert expected in refusal(path)


def test_a_value_where_a_table_goes_is_one_line(tmp_path):
    assert "[clusters] must be a table" in refusal(config(tmp_path, "clusters = 5\n"))
    assert "[clusters.onprem] must be a table" in refusal(
        config(tmp_path, "[clusters]\nonprem = 5\n"))


def test_a_path_with_control_characters_is_named_on_one_line(tmp_path):
    odd = tmp_path / "a\nb"
    odd.mkdir()
    assert "a?b" in refusal(odd / "site.toml")
