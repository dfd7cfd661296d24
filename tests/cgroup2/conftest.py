"""tests/cgroup2: cgroup v2 on a real kernel, in a guest (see test_in_guest.py).

``guest/`` holds the tests that run inside the guest; the host never collects them.
"""

collect_ignore = ["guest"]
