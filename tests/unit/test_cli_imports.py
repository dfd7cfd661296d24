"""The CLI imports only what a command runs (issue 17).

Each command runs in a fresh interpreter (a subprocess, in a scratch namespace); what
it left in ``sys.modules`` must not include the heavy libraries it does not use. The
lazy command table must agree with the commands themselves, so `fusuma --help` can list
them without importing them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fusuma.cli import main as cli_main
from tests.unit.test_cli_plugins import declared_entry_points, install_entry_points

REPO = Path(__file__).resolve().parents[2]

# Never imported by a command that does not need them: plotting, an API server, a
# Kubernetes client or operator framework.
HEAVY = ("matplotlib", "fastapi", "uvicorn", "kubernetes", "kopf")
# Also kept out of the commands scripts call in loops (and of help texts): pydantic
# (fusuma.spec), the benchmarks, image building, the supervisor's QMP/asyncio stack.
# The supervisor's own modules (its client and protocol are light: commands that ask a
# supervisor something import those).
SUPERVISOR = ("fusuma.supervisor.daemon", "fusuma.supervisor.host", "fusuma.supervisor.vms",
              "fusuma.supervisor.moves", "fusuma.qemu.instance")
READ_ONLY = (*HEAVY, "pydantic", "fusuma.spec", "fusuma_bench", "fusuma.images",
             "fusuma.supervisor", "fusuma.partition.manager", "qemu", "asyncio")
# `fusuma --help` lists the commands packages add, from their own help: it imports
# their command modules (`bench`'s group), and nothing of the benchmarks behind them.
LISTED = ("fusuma_bench", "fusuma_bench.cli", "fusuma_bench.report")

PROBE = """
import json, sys
out, args = sys.argv[1], json.loads(sys.argv[2])
sys.argv = ["fusuma", *args]
from fusuma.cli.main import main
try:
    main()
except SystemExit:
    pass
with open(out, "w") as f:
    json.dump(sorted(sys.modules), f)
"""


def modules_after(tmp_path: Path, *args: str) -> set[str]:
    """The modules `fusuma ARGS` imported, run as installed: with pyproject.toml's
    entry points (`fusuma bench`)."""
    out = tmp_path / "modules.json"
    site = install_entry_points(tmp_path / "site", declared_entry_points())
    env = {**os.environ, "FUSUMA_HOME": str(tmp_path / "home"),
           "FUSUMA_RUNTIME_DIR": str(tmp_path / "run"),
           "FUSUMA_SHM_DIR": str(tmp_path / "shm"),
           "FUSUMA_CGROUP_PREFIX": f"fusuma-test-imports-{os.getpid()}",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(site)])}
    p = subprocess.run([sys.executable, "-c", PROBE, str(out), json.dumps(list(args))], env=env,
                       capture_output=True, text=True, timeout=60)
    assert out.exists(), f"fusuma {' '.join(args)} did not finish: {p.stderr}"
    return set(json.loads(out.read_text()))


def offenders(mods: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(m for m in mods if any(m == b or m.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("args", [
    ("ps", "--json"),
    ("vm", "list", "--json"),
    ("--help",),
    ("vm", "exec", "--help"),
    ("vm", "--help"),
    ("partition", "list", "--json"),
])
def test_read_only_commands_stay_light(tmp_path: Path, args: tuple[str, ...]) -> None:
    mods = modules_after(tmp_path, *args)
    assert "fusuma.cli.main" in mods
    allowed = LISTED if args == ("--help",) else ()
    assert not [m for m in offenders(mods, READ_ONLY) if m not in allowed], \
        f"fusuma {' '.join(args)} imported them"


def test_down_does_not_import_pydantic(tmp_path: Path) -> None:
    """`fusuma down` (every test's teardown, and a script's) needs no spec: no pydantic
    (half its CPU when it did)."""
    mods = modules_after(tmp_path, "down")
    assert "fusuma.apply" in mods
    assert not offenders(mods, (*HEAVY, "pydantic", "fusuma.spec", "fusuma_bench"))


# What the commands tests and scripts call most (`ps --json`, `vm exec`, `down`) do not
# need: the supervisor's asyncio, the mover (only a dead move's recovery runs it), the
# image builder and its stdlib; `vm exec` only talks to a supervisor: no QEMU command
# line, no cgroup drivers or QoS, no storage.
SCRIPTED = ("asyncio", "ssl", "email", "tempfile", "ctypes", "fusuma.migration",
            "fusuma.images.builder")


def populated_home(tmp_path: Path, running: bool = True) -> None:
    """A state file with a partition and a (running) VM (no supervisor, no QEMU: a
    command that would talk to one fails after importing what it needs)."""
    from fusuma.ops.context import Ctx
    from fusuma.paths import Paths
    from fusuma.state.machine import VmState
    from fusuma.state.records import PartitionRecord, VmRecord

    db = Ctx(Paths(home=tmp_path / "home", runtime=tmp_path / "run", shm=tmp_path / "shm",
                   cache=tmp_path / "cache", cgroup_prefix="fusuma-test-imports")).db
    db.add_partition(PartitionRecord("p0", [0], 400))
    db.add_vm(VmRecord("vm0", "p0", 1, 128, overhead_mib=96))
    if running:
        db.transition("vm0", VmState.STARTING, pid=1)
        db.transition("vm0", VmState.RUNNING)
    db.close()


@pytest.mark.parametrize(("args", "banned"), [
    (("ps", "--json"), ()),
    (("down",), ("fusuma.qemu.instance", "qemu", "fusuma.images.builder", "hmac")),
    (("vm", "exec", "vm0", "--", "true"),
     ("fusuma.qemu.cmdline", "fusuma.governor.qos", "fusuma.host.cgroups",
      "fusuma.host.storage", "shutil")),
])
def test_scripted_commands_import_only_what_they_run(tmp_path: Path, args: tuple[str, ...],
                                                     banned: tuple[str, ...]) -> None:
    populated_home(tmp_path, running=args[0] != "down")   # (no wait for a QEMU's end)
    mods = modules_after(tmp_path, *args)
    assert "fusuma.state" in mods and "fusuma.cli.main" in mods
    if args[0] == "ps":
        assert "fusuma.memshare.reporting" in mods  # it did read the VM's memory
        banned += READ_ONLY
    elif args[0] == "down":
        # It did delete the VM and its files, without the QMP/asyncio stack or the
        # image builder.
        assert "fusuma.vm.shared" in mods and "fusuma.images.store" in mods
        banned += (*HEAVY, "pydantic", "fusuma.spec")
    else:
        assert "fusuma.supervisor.rpc" in mods      # it did reach for a supervisor
        banned += (*HEAVY, "pydantic", "fusuma.spec")
    assert not offenders(mods, (*SCRIPTED, *banned)), f"fusuma {' '.join(args)} imported them"


def test_a_supervisor_imports_no_builder_stdlib() -> None:
    """A partition's supervisor (started ~440 times in a suite run) imports the image
    builder's and the seed writer's modules (when it starts a VM, moves one or saves a
    template: tests/unit/test_supervisor_imports.py), not what only writing a seed
    (email) or reading a kernel module (gzip) runs."""
    p = subprocess.run([sys.executable, "-c",
                        "import json, sys\n"
                        "import fusuma.supervisor.daemon, fusuma.supervisor.host, "
                        "fusuma.supervisor.vms, fusuma.supervisor.moves.dest, "
                        "fusuma.supervisor.templates, fusuma.images.builder\n"
                        "print(json.dumps(sorted(sys.modules)))"],
                       env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                       capture_output=True, text=True, timeout=60, check=True)
    mods = set(json.loads(p.stdout))
    assert "fusuma.images.seed" in mods and "asyncio" in mods
    assert not offenders(mods, ("email", "gzip", "fusuma.migration"))


def test_a_builtin_command_does_not_read_entry_points(tmp_path: Path) -> None:
    mods = modules_after(tmp_path, "ps", "--json")
    assert "importlib.metadata" not in mods


def test_bench_runs_from_its_entry_point(tmp_path: Path) -> None:
    mods = modules_after(tmp_path, "bench", "cli", "--help")
    assert "fusuma_bench.cli" in mods and "importlib.metadata" in mods


@pytest.mark.parametrize("args", [
    ("migrate", "--help"),
    ("migrate", "no-such-vm", "--to", "no-such-partition"),
    ("bench", "--help"),
    ("bench", "cli", "--help"),
    ("top", "--help"),
    ("share", "--help"),
    ("segment", "list", "--json"),
    ("image", "--help"),
    ("up", "--help"),
    ("serve", "--help"),
    ("token", "list", "--json"),
    ("agent", "--help"),
    ("cluster", "install"),
])
def test_no_command_imports_what_it_does_not_use(tmp_path: Path,
                                                 args: tuple[str, ...]) -> None:
    mods = modules_after(tmp_path, *args)
    assert "fusuma.cli.main" in mods
    assert not offenders(mods, HEAVY), f"fusuma {' '.join(args)} imported them"


def test_help_imports_no_command_module(tmp_path: Path) -> None:
    """(fusuma.cli.common, which every command shares, comes with `bench`'s group.)"""
    mods = modules_after(tmp_path, "--help")
    cmds = sorted(m for m in mods if m.startswith("fusuma.cli.")
                  and m not in ("fusuma.cli.main", "fusuma.cli.common"))
    assert cmds == []


def test_migrate_help_does_not_import_migration(tmp_path: Path) -> None:
    mods = modules_after(tmp_path, "migrate", "--help")
    assert not offenders(mods, ("fusuma.migration", "qemu", "asyncio", "pydantic"))


def test_migrate_imports_no_qmp(tmp_path: Path) -> None:
    """QMP and asyncio are the supervisor's: the CLI side of a move only talks to
    supervisors over their socket."""
    mods = modules_after(tmp_path, "migrate", "no-such-vm", "--to", "no-such-partition")
    assert "fusuma.migration" in mods
    assert not offenders(mods, ("qemu", "asyncio", *SUPERVISOR, "fusuma_bench"))


# -- the lazy table --------------------------------------------------------------------
def test_every_summary_is_the_commands_own_short_help() -> None:
    """The listing's summaries are kept in cli/main.py so `--help` imports nothing;
    each must equal what click would show from the command's own help (its first
    sentence), so the two cannot drift."""
    for name, (_, summary) in cli_main.COMMANDS.items():
        cmd = cli_main.load_command(name)
        assert cmd.name == name
        assert summary == cmd.get_short_help_str(limit=10**6), name


def test_help_listing_equals_the_eager_one() -> None:
    """`fusuma --help` from the table is byte for byte what click prints with every
    command imported."""
    eager = click.Group(name="fusuma", help=cli_main.cli.help, epilog=cli_main.cli.epilog,
                        params=cli_main.cli.params,
                        context_settings=cli_main.cli.context_settings)
    for name in cli_main.COMMANDS:
        eager.add_command(cli_main.load_command(name), name)
    for name, ep in cli_main.plugin_commands().items():     # when fusuma is installed
        eager.add_command(ep.load(), name)
    lazy = CliRunner().invoke(cli_main.cli, ["--help"], prog_name="fusuma")
    ref = CliRunner().invoke(eager, ["--help"], prog_name="fusuma")
    assert lazy.exit_code == 0 and ref.exit_code == 0
    assert lazy.output == ref.output
    for name in cli_main.COMMANDS:
        assert f"  {name} " in lazy.output


def test_table_covers_every_command_module() -> None:
    """A command added to a cli module but not to the table would be unreachable."""
    cli_dir = Path(cli_main.__file__).parent
    listed = {ref.split(":")[0].rsplit(".", 1)[1] for ref, _ in cli_main.COMMANDS.values()}
    modules = {p.stem for p in cli_dir.glob("*.py")} - {"__init__", "main", "common"}
    # A group's subcommands kept in a module of their own: reachable through the group.
    subgroups = {"snapshot": [("vm", "snapshot")],
                 "backup": [("vm", "backup"), ("vm", "restore")]}
    assert modules - set(subgroups) <= listed
    for paths in subgroups.values():
        for path in paths:
            res = CliRunner().invoke(cli_main.cli, [*path, "--help"], prog_name="fusuma")
            assert res.exit_code == 0, res.output


def test_unknown_command_is_a_usage_error() -> None:
    res = CliRunner().invoke(cli_main.cli, ["no-such-command"])
    assert res.exit_code == 2 and "No such command" in res.output


def test_qos_choices_match_the_governor() -> None:
    from fusuma.cli.vm import QOS_CHOICES
    from fusuma.governor import QOS_NAMES

    assert tuple(QOS_CHOICES) == tuple(QOS_NAMES)
