"""fusuma.cluster without an API server: CRDs, placement, kubeconfig, conditions."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from fusuma.cluster import ClusterError
from fusuma.cluster.crds import crds, render_yaml
from fusuma.cluster.hostmove import RECORD_FAILED, RECORD_PHASE, at, called_off
from fusuma.cluster.install import manifests
from fusuma.cluster.kube import VM, KubeConfig
from fusuma.cluster.owners import Owner, Owners
from fusuma.cluster.placement import Choice, HostView, choose, load
from fusuma.cluster.resources import VmView, same_conditions, set_condition
from fusuma.state import Decision, MovePhase


def walk(schema: dict[str, Any], path: str = "") -> list[str]:
    """Properties without a description (kubectl explain would show nothing)."""
    out = []
    for name, sub in (schema.get("properties") or {}).items():
        here = f"{path}.{name}"
        if name not in ("metadata", "apiVersion", "kind") and not sub.get("description"):
            out.append(here)
        out += walk(sub, here)
        if sub.get("type") == "array":
            out += walk(sub["items"], here + "[]")
    return out


def test_every_crd_has_status_columns_and_described_fields() -> None:
    kinds = {c["spec"]["names"]["kind"]: c for c in crds()}
    assert set(kinds) == {"FusumaHost", "FusumaPartition", "FusumaVM", "FusumaSegment",
                          "FusumaNetwork", "FusumaAddress"}
    for kind, crd in kinds.items():
        v = crd["spec"]["versions"][0]
        assert v["subresources"] == {"status": {}}, kind
        cols = [c["name"] for c in v["additionalPrinterColumns"]]
        assert "Age" in cols and len(cols) >= 3, kind
        assert walk(v["schema"]["openAPIV3Schema"]) == [], kind
        assert crd["spec"]["names"]["categories"] == ["fusuma"]
    vm = kinds["FusumaVM"]["spec"]
    assert vm["scope"] == "Namespaced" and kinds["FusumaHost"]["spec"]["scope"] == "Cluster"
    props = vm["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    # What the agents write must survive structural pruning.
    move = props["status"]["properties"]["move"]["properties"]
    for f in ("id", "fromHost", "toHost", "decision", "uri", "resumeTs", "record"):
        assert f in move, f


def test_a_move_between_hosts_shows_every_phase_by_its_users_name() -> None:
    # status.move.phase is read by users and scripts: the names never change, and every
    # phase a move records in its job has one.
    assert RECORD_PHASE == {
        MovePhase.PREPARE: "Preparing", MovePhase.PREPARED: "Prepared",
        MovePhase.STREAMING: "Streaming", MovePhase.STREAMED: "Streamed",
        MovePhase.SWITCHED: "Switched", MovePhase.RELEASED: "Done"}
    assert set(RECORD_PHASE) == set(MovePhase) and RECORD_FAILED == "Failed"
    assert at({"phase": "Prepared"}, MovePhase.PREPARED)
    assert not at({"phase": "Prepared"}, MovePhase.PREPARE) and not at({}, MovePhase.PREPARE)
    assert called_off({"phase": "Failed"}) and called_off({"decision": Decision.BACK})
    assert not called_off({"phase": "Streamed", "decision": "forward"})


def test_install_yaml_is_one_document_per_object() -> None:
    docs = [d for d in yaml.safe_load_all(render_yaml(manifests())) if d]
    assert docs == manifests()
    # No identity that every agent shares: each host joins with its own.
    assert not [d for d in docs if d["kind"] in ("ClusterRoleBinding", "ServiceAccount")]
    # The objects' policy and the addresses' policy, each with its binding.
    for policy, binding in (docs[-4:-2], docs[-2:]):
        assert (policy["kind"], binding["kind"]) == ("ValidatingAdmissionPolicy",
                                                     "ValidatingAdmissionPolicyBinding")
        assert binding["spec"] == {"policyName": policy["metadata"]["name"],
                                   "validationActions": ["Deny"]}
        assert policy["spec"]["failurePolicy"] == "Fail"
        # Every refusal is a 403 with a sentence naming the host.
        for v in policy["spec"]["validations"]:
            assert v["reason"] == "Forbidden"
            assert v["messageExpression"].startswith("'host ' + variables.me + ' ' + '")


def test_the_policy_knows_who_writes_every_field_of_a_move() -> None:
    from fusuma.cluster.crds import MOVE
    from fusuma.cluster.policy import MOVE_DEST, MOVE_EITHER, MOVE_SOURCE

    fields = MOVE_SOURCE + MOVE_DEST + MOVE_EITHER
    assert sorted(fields) == sorted(MOVE["properties"]) and len(set(fields)) == len(fields)


def test_a_host_identity_is_its_own_account_and_roles_by_name() -> None:
    from fusuma.cluster.identity import check_host_name, host_objects, host_of

    objs = {o["kind"]: o for o in host_objects("h0")}
    assert set(objs) == {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                         "RoleBinding"}
    assert {o["metadata"]["name"] for o in objs.values()} == {"fusuma-host-h0"}
    subjects = [{"kind": "ServiceAccount", "name": "fusuma-host-h0",
                 "namespace": "fusuma-system"},
                {"kind": "User", "apiGroup": "rbac.authorization.k8s.io",
                 "name": "fusuma:host:h0"}]
    assert objs["ClusterRoleBinding"]["subjects"] == subjects
    assert objs["RoleBinding"]["subjects"] == subjects
    named = {(r["resources"][0], tuple(r["resourceNames"]))
             for r in objs["Role"]["rules"] if "resourceNames" in r}
    assert named == {("leases", ("fusuma-host-h0", "fusuma-placement", "fusuma-room")),
                     ("secrets", ("fusuma-host-h0",))}
    # Nothing that deletes but addresses (the policy: only those it holds), and no
    # Secret of anyone else.
    for rule in objs["ClusterRole"]["rules"] + objs["Role"]["rules"]:
        assert "*" not in rule["verbs"]
        assert "delete" not in rule["verbs"] or rule["resources"] == ["fusumaaddresses"]
        assert "secrets" not in rule["resources"] or rule.get("resourceNames")
    assert host_of("fusuma:host:h0") == "h0"
    assert host_of("system:serviceaccount:fusuma-system:fusuma-host-h1") == "h1"
    assert host_of("system:serviceaccount:default:fusuma-host-h1") is None
    assert host_of("admin") is None
    for bad in ("H0", "h_0", "-h", "x" * 52, "a/b"):
        with pytest.raises(ClusterError, match="is not allowed"):
            check_host_name(bad)


def vm(name: str, mem: int = 128, ns: str = "default", **spec: Any) -> VmView:
    return VmView({"metadata": {"name": name, "namespace": ns, "uid": name},
                   "spec": {"memoryMiB": mem, **spec}, "status": {}})


def hostview(name: str, avail: int = 4000, parts: int = 2, mem: int = 1024) -> HostView:
    obj = {"metadata": {"name": name}, "status": {
        "availableMiB": avail, "accelerator": "tcg",
        "partitions": [{"name": f"p{i}", "cpus": [i], "memoryMiB": mem}
                       for i in range(parts)]}}
    return HostView.from_obj(obj, ready=True)


def test_placement_spreads_and_counts_assigned_vms() -> None:
    hosts = {h: hostview(h) for h in ("a", "b")}
    placed = [vm("x", host="a", partition="p0"), vm("y", host="a", partition="p1")]
    load(hosts, placed)
    got = choose(vm("z"), hosts)
    assert isinstance(got, Choice) and got.host == "b"


def test_placement_refuses_with_the_sums() -> None:
    hosts = {"a": hostview("a", parts=1, mem=256)}
    got = choose(vm("big", mem=200, sharedRam=False), hosts)
    assert isinstance(got, str)
    assert "no host has room for 'big'" in got and "> 256" in got
    # Shared RAM counts host-wide, not in the partition.
    assert isinstance(choose(vm("ok", mem=200), hosts), Choice)
    assert "a: 4" in str(choose(vm("huge", mem=400000), hosts))


def test_placement_skips_lost_unschedulable_and_taken_names() -> None:
    hosts = {h: hostview(h) for h in ("a", "b", "c")}
    hosts["c"].schedulable = False
    got = choose(vm("n"), hosts, exclude={"a"}, taken_names={"b": {"n"}})
    assert isinstance(got, str)
    assert "a: lost" in got and "already there" in got and "unschedulable" in got


def test_vm_view_prefers_spec_over_placement() -> None:
    v = VmView({"metadata": {"name": "v", "namespace": "d", "uid": "u", "generation": 3},
                "spec": {"partition": "p1"},
                "status": {"placement": {"host": "a", "partition": "p0"}}})
    assert (v.want_host, v.want_partition, v.running, v.restartable) == ("a", "p1", True,
                                                                          False)
    assert v.vm_spec_fields("p1")["memory_mib"] == 256


def test_conditions_keep_their_transition_time() -> None:
    c1 = set_condition([], "Ready", True, "Running", "ok")
    c1[0]["lastTransitionTime"] = "2020-01-01T00:00:00Z"
    c2 = set_condition(c1, "Ready", True, "Running", "still ok")
    assert c2[0]["lastTransitionTime"] == "2020-01-01T00:00:00Z"
    c3 = set_condition(c2, "Ready", False, "Failed", "no")
    assert c3[0]["lastTransitionTime"] != "2020-01-01T00:00:00Z"
    assert same_conditions(c1, [dict(c1[0], lastTransitionTime="x")])


def test_kubeconfig_token_and_ca(tmp_path: Path) -> None:
    from tests.unit.test_cluster_pki import ca_pem

    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "k", "cluster": {
               "server": "https://10.0.0.1:6443/",
               "certificate-authority-data": base64.b64encode(ca_pem()).decode()}}],
           "users": [{"name": "u", "user": {"token": "abc"}}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u",
                                                   "namespace": "ns1"}}]}
    p = tmp_path / "kc"
    p.write_text(json.dumps(cfg))
    kc = KubeConfig.load(p)
    assert (kc.server, kc.token, kc.namespace) == ("https://10.0.0.1:6443", "abc", "ns1")
    assert VM.path("ns1", "v", "status") == \
        "/apis/fusuma.io/v1alpha1/namespaces/ns1/fusumavms/v/status"
    cfg["current-context"] = "nope"
    p.write_text(json.dumps(cfg))
    with pytest.raises(ClusterError, match="no context named 'nope'"):
        KubeConfig.load(p)


def test_an_inline_client_key_passes_through_a_private_directory_and_is_gone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datetime
    import os
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    from fusuma.cluster import kube
    from tests.unit.test_cluster_pki import ca_pem

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fusuma:host:h0")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(1).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    key_pem = key.private_bytes(serialization.Encoding.PEM,
                                serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    cfg = {"apiVersion": "v1", "kind": "Config", "current-context": "c",
           "clusters": [{"name": "k", "cluster": {
               "server": "https://10.0.0.1:6443",
               "certificate-authority-data": base64.b64encode(ca_pem()).decode()}}],
           "users": [{"name": "u", "user": {
               "client-certificate-data": base64.b64encode(
                   cert.public_bytes(serialization.Encoding.PEM)).decode(),
               "client-key-data": base64.b64encode(key_pem).decode()}}],
           "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}]}
    p = tmp_path / "kc"
    p.write_text(json.dumps(cfg))
    base = tmp_path / "shm"
    base.mkdir()
    monkeypatch.setattr(kube, "INLINE_KEY_DIR", base)
    seen: list[tuple[int, bytes]] = []
    real = ssl.SSLContext.load_cert_chain

    def spy(self: ssl.SSLContext, certfile: str, keyfile: str) -> None:
        d = Path(keyfile).parent
        assert d.parent == base and d.name.startswith("fusuma-kube-")
        seen.append((os.stat(d).st_mode & 0o777, Path(keyfile).read_bytes()))
        assert os.stat(keyfile).st_mode & 0o777 == 0o600
        real(self, certfile, keyfile)

    monkeypatch.setattr(ssl.SSLContext, "load_cert_chain", spy)
    kc = KubeConfig.load(p)
    assert seen == [(0o700, key_pem)] and kc.cert is None
    assert list(base.iterdir()) == [], "the client key was left behind"


def test_join_writes_a_private_kubeconfig_of_the_admins_cluster(tmp_path: Path) -> None:
    import ssl

    from fusuma.cluster import identity
    from tests.unit.test_cluster_pki import ca_pem

    ca = ca_pem().decode()
    admin = KubeConfig("https://10.0.0.1:6443", ssl.create_default_context(), "admintok",
                       ca_pem=ca)
    out = tmp_path / "h0.kubeconfig"
    (tmp_path / "elsewhere").write_text("untouched")
    out.symlink_to(tmp_path / "elsewhere")     # replaced, never written through
    identity.write_private(out, identity.kubeconfig(admin, "h0", "hosttok",
                                                    server="https://10.0.0.2:6443"))
    assert not out.is_symlink() and out.stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "elsewhere").read_text() == "untouched"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    kc = KubeConfig.load(out)
    assert (kc.server, kc.token, kc.ca_pem) == ("https://10.0.0.2:6443", "hosttok", ca)


def test_owners_survive_a_new_instance(tmp_path: Path) -> None:
    o = Owners(tmp_path)
    o.set("vms", "v", Owner("uid1", "ns", "v"))
    assert Owners(tmp_path).get("vms", "v") == Owner("uid1", "ns", "v")
    o.remove("vms", "v")
    assert Owners(tmp_path).get("vms", "v") is None and o.all("partitions") == {}


def test_the_crd_names_every_phase_a_move_record_shows() -> None:
    vm = next(c for c in crds() if c["spec"]["names"]["kind"] == "FusumaVM")
    props = vm["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    text = props["status"]["properties"]["move"]["properties"]["phase"]["description"]
    listed = [p.strip(" .") for p in text.split(":", 1)[1].split(",")]
    assert listed == [*RECORD_PHASE.values(), RECORD_FAILED]


def test_last_move_keeps_every_step_of_the_downtime() -> None:
    # What the agent writes in lastMove.steps must survive structural pruning: a field
    # per step of fusuma.migration.DOWNTIME_STEPS, each described.
    from fusuma.cluster.crds import MOVE_STEPS
    from fusuma.migration import DOWNTIME_STEPS

    assert list(MOVE_STEPS) == list(DOWNTIME_STEPS.values())
    vm = next(c for c in crds() if c["spec"]["names"]["kind"] == "FusumaVM")
    props = vm["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
    last = props["status"]["properties"]["lastMove"]["properties"]
    steps = last["steps"]["properties"]
    assert list(steps) == [field for field, _ in MOVE_STEPS.values()]
    assert {s["type"] for s in steps.values()} == {"number"}
    assert last["prepareMs"]["type"] == "number"
