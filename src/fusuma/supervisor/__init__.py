"""A partition's supervisor: the daemon (``daemon``), the partition it serves
(``host``: its QEMUs, state and cgroups), its handlers (``vms``, ``templates``, and the
sides of a move in ``fusuma.migration``), the typed protocol (``rpc``) and the
callers' side of its socket (``client``).

Light on purpose: ``client`` and ``rpc`` are imported by every command that talks to a
supervisor."""
