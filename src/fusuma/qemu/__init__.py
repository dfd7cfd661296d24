"""QEMU: pure command-line building, process lifecycle, QMP and guest-agent clients."""
