"""The cluster's admin commands find their kubeconfig as kubectl does; the agent never.

`fusuma cluster install --apply | join | leave | rotate-certs`, like `fusuma host ...`,
take --kubeconfig, else $KUBECONFIG, else ~/.kube/config, and without any of them say so
in one sentence (before, each required --kubeconfig while `fusuma host` did not). The
agent runs as its host's own identity and must be given it: found by default it could
be an admin's."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fusuma.cluster import ClusterError, command

ADMIN = [["install", "--apply"], ["join", "h0"], ["leave", "h0"], ["rotate-certs"]]


@pytest.mark.parametrize("args", ADMIN, ids=lambda a: a[0])
def test_no_kubeconfig_anywhere_is_one_sentence(args: list[str], tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    r = CliRunner().invoke(command.cluster, args)
    assert isinstance(r.exception, ClusterError), r.output
    assert str(r.exception) == ("no cluster configured: pass --kubeconfig FILE "
                                "(credentials that may change FusumaHosts, e.g. an "
                                "admin's), or set KUBECONFIG.")


@pytest.mark.parametrize("args", ADMIN, ids=lambda a: a[0])
def test_the_kubeconfig_of_the_environment_is_the_one_read(
        args: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "admin.conf"
    conf.write_text("not: a kubeconfig\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", f"/nonexistent/k:{conf}")
    read: list[Path] = []

    def load(path: Path) -> object:
        read.append(Path(path))
        raise ClusterError("stop here")
    monkeypatch.setattr("fusuma.cluster.kube.KubeConfig.load", staticmethod(load))
    r = CliRunner().invoke(command.cluster, args)
    assert str(r.exception) == "stop here", r.output
    assert read == [conf]


def test_the_agent_must_be_given_its_own_identity(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "admin.conf"
    conf.write_text("x")
    monkeypatch.setenv("KUBECONFIG", str(conf))
    r = CliRunner().invoke(command.agent, [])
    assert r.exit_code == 2 and "Missing option '--kubeconfig'" in r.output
