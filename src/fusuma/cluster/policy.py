"""What a host's identity may write, field by field: a ValidatingAdmissionPolicy (CEL,
Kubernetes >= 1.30) that the API server enforces for every host identity.

Kubernetes keeps kubelets apart the same way: RBAC (the Node authorizer) says which
kinds a node may touch, the NodeRestriction admission plugin says which objects (its own
Node, the pods bound to it). RBAC cannot filter by a field, so the per-host roles
(``fusuma.cluster.identity``) grant the verbs and this policy checks, with the
requesting user's host name (``fusuma:host:NAME``, or the ServiceAccount
``fusuma-system/fusuma-host-NAME``), the old and new object:

- **its own objects**: its FusumaHost (name), its heartbeat Lease (and, as their
  holder, the placement Lease and the room ledger, ``fusuma.cluster.room``), the FusumaPartitions
  whose ``spec.host`` it is, the FusumaVMs *placed on it*: ``status.host`` is it, or the
  VM is on no host (or Lost) and ``spec.host`` (else ``status.placement.host``) is it;
  its own entry of a FusumaSegment's or a FusumaNetwork's ``status.hosts``;
- **its side of a move between hosts** while ``status.move`` names it: the destination
  writes only its fields of the record (``uri``, ``tls``, ``channels``, ``destPid``,
  ``prepareMs``, ``resumeTs``, the phase, the decision) and, at the switch, the VM's
  ``host`` (itself), ``partition``, ``pid``, ``state`` (Running, or Failed if the
  guest was lost there); the source, once the guest runs
  at the destination, only its fields and the end of the record (``lastMove``). Nobody
  rewrites the move's identity or its record (the source's device set) as a peer, and a
  recorded decision is never changed;
- **the addresses it holds** (FusumaAddress, a second policy: ``address_policy``):
  taken only in its own name, handed on or freed only by their holder;
- **the placement controller's writes** (it runs in every agent; one acts): a VM's
  placement while it has none (or is Lost), its conditions, ``state`` Placed, Pending
  or Lost, ``lostAt``/``lostFrom``, and clearing its host; another FusumaHost's
  conditions (Ready=False when its Lease expired); the fusuma finalizer of a deleted VM.
  It cannot set another host's status fields, a VM's host, a move or its record.

A host never changes a spec, labels, annotations, owner references, or finalizers other
than fusuma's own. Every refusal is a 403 (``reason: Forbidden``) with one sentence.
"""

from __future__ import annotations

from fusuma.cluster import FINALIZER, GROUP, SYSTEM_NAMESPACE
from fusuma.cluster.addresses import HOST_LABEL, NETWORK_LABEL, VM_UID_LABEL
from fusuma.cluster.crds import HOST_STATUS, VM_STATUS, Obj
from fusuma.cluster.identity import HOST_USER_PREFIX, SA_USER_PREFIX
from fusuma.cluster.kube import ADDRESS
from fusuma.cluster.lease import PLACEMENT_LEASE, ROOM_LEASE, host_lease_name

POLICY = "fusuma-host-restriction"
ADMISSION = "admissionregistration.k8s.io/v1"

# Who writes which field of a move's record (hostmove): the source starts it (its
# identity and the record it carries) and streams; the destination prepares and
# switches; either may write the phase, the decision (once) and a message.
MOVE_IDENTITY = ("id", "kind", "mode", "from", "to", "fromHost", "toHost", "record",
                 "startedAt")
MOVE_SOURCE = (*MOVE_IDENTITY, "bytesSent", "paused", "qemuDowntimeMs", "result",
               "finishedAt", "downtimeMs", "totalMs", "wallMs", "steps")
MOVE_DEST = ("uri", "destPid", "prepareMs", "resumeTs", "tls", "channels", "nbd",
             "sharedStorage")
MOVE_EITHER = ("phase", "decision", "decidedBy", "message")

# The VM status fields each kind of writer may change (every other one must stay).
DEST_SWITCH = ("move", "host", "partition", "pid", "state", "message", "ownerUID")
SOURCE_END = ("move", "lastMove")
CONTROLLER = ("placement", "conditions", "state", "message", "lostAt", "lostFrom", "pid",
              "host", "partition")


def _same(new: str, old: str, field: str) -> str:
    """CEL: ``field`` of the objects ``new`` and ``old`` is the same (both absent, or
    equal)."""
    return f"({new}.?{field} == {old}.?{field})"


def _same_all(new: str, old: str, fields: list[str]) -> str:
    return " && ".join(_same(new, old, f) for f in fields) or "true"


def _status_same_except(props: Obj, allowed: tuple[str, ...]) -> str:
    keep = [f for f in props["properties"] if f not in allowed]
    return _same_all("object.?status", "oldObject.?status", keep)


def _move_same(fields: tuple[str, ...]) -> str:
    return _same_all("object.?status.?move", "oldObject.?status.?move", list(fields))


def _str(path: str) -> str:
    """CEL: the string at the optional chain ``path``, '' when absent."""
    return f"{path}.orValue('')"


def _one_of(value: str, *words: str) -> str:
    """CEL: ``value`` is one of ``words`` (the objects are dyn: no list literal)."""
    return "(" + " || ".join(f"{value} == '{w}'" for w in words) + ")"


def _want_host(o: str) -> str:
    return (f"({_str(f'{o}.?spec.?host')} != '' ? {o}.spec.host : "
            f"{_str(f'{o}.?status.?placement.?host')})")


def _want_partition(o: str) -> str:
    return (f"({_str(f'{o}.?spec.?partition')} != '' ? {o}.spec.partition : "
            f"{_str(f'{o}.?status.?placement.?partition')})")


def _placed_on_me(o: str) -> str:
    """CEL: VM ``o`` is placed on the requesting host."""
    host, state = _str(f"{o}.?status.?host"), _str(f"{o}.?status.?state")
    return (f"({host} == variables.me || (({host} == '' || {state} == 'Lost') && "
            f"{_want_host(o)} == variables.me))")


def _meta_same() -> str:
    """CEL: an update that changes no spec, label, annotation or owner reference, and
    no finalizer but fusuma's own."""
    fin = (f"object.metadata.?finalizers.orValue([]).filter(f, f != '{FINALIZER}') == "
           f"oldObject.metadata.?finalizers.orValue([]).filter(f, f != '{FINALIZER}')")
    return " && ".join([
        _same("object", "oldObject", "spec"),
        _same("object.metadata", "oldObject.metadata", "labels"),
        _same("object.metadata", "oldObject.metadata", "annotations"),
        _same("object.metadata", "oldObject.metadata", "ownerReferences"),
        fin])


def _variables() -> list[Obj]:
    user = "request.userInfo.username"
    state_old = _str("oldObject.?status.?state")
    exprs = {
        "me": f"{user}.startsWith('{HOST_USER_PREFIX}') ? "
              f"{user}.substring({len(HOST_USER_PREFIX)}) : "
              f"{user}.substring({len(SA_USER_PREFIX)})",
        "res": "request.resource.resource",
        "status": f"{_str('request.?subResource')} == 'status'",
        "update": "request.operation == 'UPDATE'",
        "vm": "variables.res == 'fusumavms' && variables.update",
        "ownsOld": f"variables.vm && {_placed_on_me('oldObject')}",
        "moveTo": f"variables.vm && {_str('oldObject.?status.?move.?toHost')} == "
                  "variables.me",
        "moveFrom": f"variables.vm && {_str('oldObject.?status.?move.?fromHost')} == "
                    "variables.me",
        "placeable": f"variables.vm && ({_want_host('oldObject')} == '' || "
                     f"{_want_partition('oldObject')} == '' || {state_old} == 'Lost')",
        "destSide": " && ".join([
            "object.?status.?move.hasValue()",
            _move_same(MOVE_SOURCE),
            _status_same_except(VM_STATUS, DEST_SWITCH),
            f"({_same('object.?status', 'oldObject.?status', 'host')} || "
            f"{_str('object.?status.?host')} == variables.me)",
            # Running, or Failed: the guest was lost here after "forward"
            # (hostmove.HostMoveDest.bury).
            f"({_same('object.?status', 'oldObject.?status', 'state')} || "
            f"{_one_of(_str('object.?status.?state'), 'Running', 'Failed')})",
            f"({_same('object.?status', 'oldObject.?status', 'ownerUID')} || "
            f"{_str('object.?status.?ownerUID')} == object.metadata.uid)"]),
        "sourceSide": " && ".join([
            _status_same_except(VM_STATUS, SOURCE_END),
            f"(!object.?status.?move.hasValue() || ({_move_same(MOVE_IDENTITY)} && "
            f"{_move_same(MOVE_DEST)}))"]),
        "controller": " && ".join([
            _status_same_except(VM_STATUS, CONTROLLER),
            *(f"(!object.?status.?{f}.hasValue() || "
              f"{_same('object.?status', 'oldObject.?status', f)})"
              for f in ("host", "partition", "pid")),
            f"({_same('object.?status', 'oldObject.?status', 'state')} || "
            f"{_one_of(_str('object.?status.?state'), 'Placed', 'Pending', 'Lost')})",
            # Placing a VM that has no place (or was lost), or marking one lost.
            f"(variables.placeable || {_str('object.?status.?state')} == 'Lost')",
            f"({_same('object.?status', 'oldObject.?status', 'placement')} || "
            "variables.placeable)",
            f"({_str('object.?spec.?host')} == '' || "
            f"{_str('object.?status.?placement.?host')} == '' || "
            f"{_str('object.?status.?placement.?host')} == object.spec.host)"]),
    }
    return [{"name": k, "expression": v} for k, v in exprs.items()]


def _check(expression: str, message: str) -> Obj:
    """A validation: ``expression`` must hold; ``message`` is a CEL string expression
    that ends the sentence "host NAME ..."."""
    return {"expression": expression, "reason": "Forbidden",
            "messageExpression": f"'host ' + variables.me + ' ' + {message}"}


def _validations() -> list[Obj]:
    decided = _str("oldObject.?status.?move.?decision")
    name = "object.metadata.name"
    return [
        _check("variables.res != 'leases' || ("
               f"request.namespace == '{SYSTEM_NAMESPACE}' && "
               f"({name} == '{host_lease_name('')}' + variables.me || "
               f"{name} == '{PLACEMENT_LEASE}' || {name} == '{ROOM_LEASE}') && "
               f"{_str('object.?spec.?holderIdentity')} == variables.me)",
               "'may write only its own heartbeat Lease, the placement Lease and the room "
               "ledger, as their holder.'"),
        _check(f"variables.res != 'fusumahosts' || variables.status || {name} == "
               "variables.me",
               f"'may register only itself, not FusumaHost ' + {name} + '.'"),
        _check("variables.res != 'fusumahosts' || !variables.status || "
               f"{name} == variables.me || "
               f"{_status_same_except(HOST_STATUS, ('conditions',))}",
               f"'may change only the conditions of FusumaHost ' + {name} + ' (another "
               "host).'"),
        _check("variables.status || !variables.update || variables.res == 'leases' || "
               f"variables.res == 'fusumahosts' || ({_meta_same()})",
               f"'may change only the fusuma finalizer of ' + {name} + ', never its "
               "spec, labels, annotations, owners or other finalizers.'"),
        _check("variables.res != 'fusumapartitions' || !variables.update || "
               "oldObject.spec.host == variables.me",
               f"'may write only its own partitions, not ' + {name} + ' of host ' + "
               "oldObject.spec.host + '.'"),
        _check("(variables.res != 'fusumasegments' && variables.res != 'fusumanetworks') "
               "|| !variables.status || ("
               "object.?status.?hosts.orValue([]).filter(h, h.host != variables.me) == "
               "oldObject.?status.?hosts.orValue([]).filter(h, h.host != variables.me) && "
               "object.?status.?hosts.orValue([]).filter(h, h.host == variables.me)"
               ".size() <= 1)",
               f"'may write only its own entry of the status of ' + {name} + '.'"),
        _check("!variables.vm || variables.status || variables.ownsOld || "
               "variables.moveTo || variables.moveFrom || "
               "has(oldObject.metadata.deletionTimestamp)",
               f"'may change the finalizer only of VMs placed on it, moving to or from "
               f"it, or deleted; ' + {name} + ' is none of those.'"),
        _check("!variables.vm || !variables.status || variables.ownsOld || "
               "(variables.moveTo && variables.destSide) || "
               "(variables.moveFrom && variables.sourceSide) || variables.controller",
               f"'may not make this change to the status of FusumaVM ' + "
               f"object.metadata.namespace + '/' + {name} + ': the VM is not placed on "
               "it, and the change is neither its side of a move nor a placement.'"),
        _check(f"!variables.vm || !variables.status || {decided} == '' || "
               f"{_str('object.?status.?move.?id')} != oldObject.status.move.id || "
               f"{_str('object.?status.?move.?decision')} == "
               "oldObject.status.move.decision",
               f"'may not change the recorded decision of the move of ' + {name} + '.'"),
    ]


HOSTS = (f"request.userInfo.username.startsWith('{HOST_USER_PREFIX}') || "
         f"request.userInfo.username.startsWith('{SA_USER_PREFIX}')")
ADDRESS_POLICY = "fusuma-host-addresses"
# A dotted quad without leading zeros: one spelling per address, so one name.
DOTTED_QUAD = r"^(0|[1-9][0-9]{0,2})([.](0|[1-9][0-9]{0,2})){3}$"


def _label(o: str, label: str) -> str:
    return f"{o}.metadata.?labels[?'{label}'].orValue('')"


def _address_validations() -> list[Obj]:
    """A FusumaAddress (fusuma.cluster.addresses) names its holder host: a host creates
    addresses only in its own name, named NETWORK.ADDRESS (so one name per address) and
    labelled as its spec says (the agents find them by label); it changes only the
    holder of those it holds (handing one on after its VM moved) and deletes only
    those. So it can neither take another host's VM's address (the name exists) nor
    free it."""
    op = "request.operation"
    labels = " && ".join([
        f"{_label('object', HOST_LABEL)} == object.spec.host",
        f"{_label('object', NETWORK_LABEL)} == object.spec.network",
        f"{_label('object', VM_UID_LABEL)} == object.spec.vm.uid"])
    fixed = _same_all("object.spec", "oldObject.spec",
                      ["network", "address", "vm", "nic", "static"])
    return [
        _check(f"{op} != 'CREATE' || (object.spec.host == variables.me && "
               "!object.spec.network.contains('.') && "
               f"object.spec.address.matches('{DOTTED_QUAD}') && "
               "object.metadata.name == object.spec.network + '.' + object.spec.address)",
               "'may take an address only in its own name (spec.host), as an object "
               "named NETWORK.ADDRESS; ' + request.name + ' is not that.'"),
        _check(f"{op} == 'DELETE' || ({labels})",
               "'must label FusumaAddress ' + request.name + ' with its network, holder "
               "host and VM uid as its spec says.'"),
        _check(f"{op} == 'CREATE' || oldObject.spec.host == variables.me",
               "'may change or free only the addresses it holds; ' + request.name + "
               "' is held by host ' + oldObject.spec.host + '.'"),
        _check(f"{op} != 'UPDATE' || ({fixed})",
               "'may change only the holder host of FusumaAddress ' + request.name + "
               "', never its network, address, VM or NIC.'"),
    ]


def _policy(name: str, rules: list[Obj], variables: list[Obj],
            validations: list[Obj]) -> list[Obj]:
    """A ValidatingAdmissionPolicy for the host identities, and its binding."""
    policy = {
        "apiVersion": ADMISSION, "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": rules},
            "matchConditions": [{"name": "a-fusuma-host", "expression": HOSTS}],
            "variables": variables,
            "validations": validations,
        }}
    binding = {
        "apiVersion": ADMISSION, "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"]}}
    return [policy, binding]


def address_policy() -> list[Obj]:
    """The policy on FusumaAddresses and its binding."""
    return _policy(ADDRESS_POLICY, [
        {"apiGroups": [GROUP], "apiVersions": ["*"],
         "operations": ["CREATE", "UPDATE", "DELETE"], "resources": [ADDRESS.plural]}],
        [v for v in _variables() if v["name"] == "me"], _address_validations())


def admission_policy() -> list[Obj]:
    """The policies and their bindings (``fusuma cluster install``): the objects' and
    the addresses' (last)."""
    ours = ["fusumahosts", "fusumapartitions", "fusumavms", "fusumasegments",
            "fusumanetworks"]
    return [*_policy(POLICY, [
        {"apiGroups": [GROUP], "apiVersions": ["*"], "operations": ["CREATE", "UPDATE"],
         "resources": ours + [f"{r}/status" for r in ours]},
        {"apiGroups": ["coordination.k8s.io"], "apiVersions": ["*"],
         "operations": ["CREATE", "UPDATE"], "resources": ["leases"]}],
        _variables(), _validations()), *address_policy()]
