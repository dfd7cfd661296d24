"""Partitions: a cgroup with exclusive cores plus its own supervisor process.

The supervisor (``supervisor.py``) is the partition's hypervisor instance: it starts,
watches and stops the QEMU processes of its VMs and serves a UNIX socket
(``protocol.py``). ``client.py`` is the CLI's side of that socket, ``manager.py`` the
CLI's operations on partitions (create, resize, restart, delete), ``files.py`` what
a partition keeps in its directory (removed with it).
"""
