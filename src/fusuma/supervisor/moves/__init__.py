"""The supervisor's sides of a move (the orchestration is ``fusuma.migration``'s):
the destination's prepare, finish and commit (``dest``), the source's perform and
confirm (``source``: release or resume), QEMU's cpr-transfer in place (``cpr``) and
the destination of a move from another host (``remote``)."""
