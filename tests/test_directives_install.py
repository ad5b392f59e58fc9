"""Installing the --geo-* integration: config tables, rendered files, the CLI, the docs.
No Slurm needed."""

from __future__ import annotations

import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from slurm_geo.cli import main
from slurm_geo.config import parse_config
from slurm_geo.errors import ConfigError
from slurm_geo.policy.directives import directives_table
from slurm_geo.policy.geo import rules_for
from slurm_geo.sandbox import geo, render
from slurm_geo.sandbox.layout import SandboxLayout
from slurm_geo.site import plan as site_plan

REPO = Path(__file__).resolve().parents[1]
LAYOUT = SandboxLayout(Path("/srv/box"), 20000)
SITE = parse_config(tomllib.loads(render.site_config(LAYOUT)), source="sandbox.toml")


def test_sandbox_config_carries_a_policy_and_a_registry():
    assert SITE.policy.require_cost_center is True
    assert SITE.policy.data_classes == {"restricted": ("home",)}
    assert SITE.policy.budgets == {"ml-research": 500.0, "ops": 50.0}
    assert SITE.registry_path == Path("/srv/box/registry/registry.db")
    assert rules_for(SITE).cluster_regions == {"onprem": "home", "rented": "remote"}


@pytest.mark.parametrize(("table", "message"), [
    ({"policy": {"max_restarts": "many"}},
     "sandbox.toml [policy]: max_restarts must be a whole number"),
    ({"policy": {"data_classes": {"restricted": ["atlantis"]}}},
     "restricted names unknown region(s) atlantis (regions of [clusters]: home, remote)"),
    ({"registry": {"path": "relative.db"}}, "[registry]: path must be an absolute path"),
    ({"registry": {"file": "/x"}}, "[registry]: unknown key(s) file; allowed: path"),
])
def test_policy_and_registry_mistakes_name_their_table(table, message):
    raw = {**tomllib.loads(render.site_config(LAYOUT)), **table}
    with pytest.raises(ConfigError) as caught:
        parse_config(raw, source="sandbox.toml")
    assert message in str(caught.value)


def test_both_clusters_get_plugin_lua_and_hooks():
    for cluster in LAYOUT.clusters:
        conf = dict(line.split("=", 1) for line in render.slurm_conf(LAYOUT, cluster, "h")
                    .splitlines() if not line.startswith(("NodeName", "PartitionName")))
        etc = f"/srv/box/{cluster.name}/etc"
        assert conf["PlugStackConfig"] == f"{etc}/plugstack.conf"
        assert conf["JobSubmitPlugins"] == "lua"
        assert conf["CliFilterPlugins"] == "cli_filter/lua"
        assert conf["Prolog"] == f"{etc}/geo-prolog"
        assert conf["EpilogSlurmctld"] == f"{etc}/geo-epilog_slurmctld"
        assert conf["AuthInfo"].endswith(",cred_expire=10")
        assert render.plugstack_conf(LAYOUT, cluster).split() == [
            "required", "/srv/box/lib/geo_directives.so",
            f"validator={etc}/geo-check_directives", "config=/srv/box/slurm-geo.toml",
            f"cluster={cluster.name}"]


def test_hook_wrapper_quotes_what_it_runs():
    text = render.hook_wrapper(LAYOUT, LAYOUT.onprem, "/opt/my python/bin/python3",
                               Path("/src/it's here/prolog.py"))
    last = text.splitlines()[-1]
    assert shlex.split(last) == ["exec", "/opt/my python/bin/python3",
                                 "/src/it's here/prolog.py", "$@"]
    assert "SLURM_GEO_CONFIG=/srv/box/slurm-geo.toml" in text
    assert "AWS_ACCESS_KEY_ID" not in text  # no key unless one is given


def test_no_hook_wrapper_carries_a_key():
    """Slurm's hooks (node and controller) open neither the master key nor a store's
    credentials (docs/security.md, "Where each secret lives"): their wrappers name
    neither, and the sandbox's daemons' S3 key file is sourced by none."""
    for python, script in ((sys.executable, Path("/p/prolog.py")),
                           ("/site/python", Path("/etc/check_directives.py"))):
        text = render.hook_wrapper(LAYOUT, LAYOUT.onprem, python, script, Path("/src"))
        for secret in ("SLURM_GEO_KEY_FILE", str(LAYOUT.master_key), "AWS_",
                       str(LAYOUT.s3_daemon_credentials), ". "):
            assert secret not in text, (secret, text)


@pytest.mark.parametrize(("old", "new", "restart"), [
    ("A=1\nAuthInfo=socket=/s\n", "A=1\nAuthInfo=socket=/s,cred_expire=10\n", True),
    ("A=1\nProlog=/x\n", "A=1\nProlog=/y\nJobSubmitPlugins=lua\n", False),
    ("A=1\n", "A=1\n", False),
])
def test_only_settings_read_at_start_restart_the_daemons(old, new, restart):
    assert geo.needs_restart(old, new) is restart


def test_the_plugin_builds_with_site_installs_flags(tmp_path):
    out = tmp_path / "geo_directives.so"
    argv = render.spank_build_argv("cc", geo.SPANK_SOURCE, out)
    if not (geo.SLURM_INCLUDE / "slurm" / "spank.h").exists():
        pytest.skip("no Slurm headers (apt-get install libslurm-dev)")
    subprocess.run(argv, check=True, capture_output=True)
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(out)], capture_output=True,
                             text=True, check=True).stdout
    for symbol in ("slurm_spank_init", "slurm_spank_init_post_opt", "plugin_name",
                   "plugin_type", "spank_plugin_version"):
        assert f" {symbol}\n" in symbols + "\n"
    assert argv == site_plan.spank_build_argv("cc", str(geo.SPANK_SOURCE), str(out))


def test_export_lua_writes_next_to_slurm_conf(tmp_path, monkeypatch, capsys):
    config = tmp_path / "config.toml"
    config.write_text(render.site_config(LAYOUT))
    monkeypatch.setattr("sys.argv", ["slurm-geo", "policy", "export-lua", "--config",
                                     str(config), "--cluster", "rented", "--dir",
                                     str(tmp_path / "etc")])
    main()
    assert sorted(p.name for p in (tmp_path / "etc").iterdir()) == \
        ["cli_filter.lua", "geo_policy.lua", "job_submit.lua"]
    assert 'cluster = "rented"' in (tmp_path / "etc" / "geo_policy.lua").read_text()
    assert capsys.readouterr().out.count("wrote") == 3


@pytest.mark.parametrize(("args", "code", "output"), [
    (["--geo-cost-center=ops", "--geo-residency=home"], 0, "accepted"),
    (["--geo-residency=home"], 5, "geo: this site requires --geo-cost-center=NAME"),
    (["--geo-cost-center=ops", "--geo-max-cost=60"], 6,
     "geo: --geo-max-cost=60 exceeds the budget of cost center 'ops' (50 USD)"),
    (["--geo-cost-center=ops", "--geo-max-cost=0.001"], 0, "accepted"),
    (["--geo-cost-center=ops", "--geo-clusters=rented"], 5,
     "geo: --geo-clusters: 'rented' leaves out 'onprem', the cluster this job is submitted"),
    (["--geo-cost-center=ops", "--geo-ckpt-dir=/pfs/" + "x/" * 2500], 5,
     "geo: --geo-ckpt-dir: '/pfs/x/x/"),
    (["--geo-cost-center=ops", "--geo-inputs=/pfs/ds:restricted,/home/alice/p",
      "--geo-outputs=/pfs/out"], 0, "accepted"),
    (["--geo-cost-center=ops", "--geo-inputs=/pfs/run:12"], 5,
     "geo: --geo-inputs: '/pfs/run:12' ends in ':12', not a data class"),
    (["--geo-cost-center=ops", "--geo-inputs=/pfs/ds:restricted", "--geo-failover=auto",
      "--geo-ckpt-dir=/pfs/c"], 5,
     "geo: --geo-failover=auto can never move this job: its residency (home, remote) and "
     "input '/pfs/ds' of data class 'restricted' (home) leave no cluster but 'onprem'"),
])
def test_policy_check_command(tmp_path, monkeypatch, capsys, args, code, output):
    config = tmp_path / "config.toml"
    config.write_text(render.site_config(LAYOUT))
    monkeypatch.setattr("sys.argv", ["slurm-geo", "policy", "check", "--config", str(config),
                                     "--cluster", "onprem", *args])
    with pytest.raises(SystemExit) as done:
        main()
    assert (done.value.code or 0) == code
    said = capsys.readouterr()
    if code:  # the reason, one error line on stderr; nothing on stdout
        assert said.out == "" and said.err.startswith("slurm-geo: error: ")
        printed = said.err.strip().removeprefix("slurm-geo: error: ")
        output = output.removeprefix("geo: ")
    else:
        printed = said.out.strip()
    assert printed.startswith(output)
    assert "\n" not in printed


@pytest.mark.parametrize("cluster", ["mars", "--geo-cost-center=ops"])
def test_policy_check_refuses_an_unknown_cluster(tmp_path, monkeypatch, capsys, cluster):
    """Also when --cluster was left without a value and took the next option as one."""
    config = tmp_path / "config.toml"
    config.write_text(render.site_config(LAYOUT))
    monkeypatch.setattr("sys.argv", ["slurm-geo", "policy", "check", "--config", str(config),
                                     "--cluster", cluster, "--geo-cost-center=ops"])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 3  # an unknown cluster is CONFIG in every command
    assert capsys.readouterr().err == f"slurm-geo: error: cluster '{cluster}' is not in " \
                                      f"{config} (known clusters: onprem, rented)\n"


def test_user_docs_list_every_directive():
    assert directives_table() in (REPO / "docs" / "directives.md").read_text()
