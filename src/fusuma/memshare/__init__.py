"""Memory shared between VMs, accounted honestly: where every shared MiB comes from.

``segments`` named read-only erofs images (DCSS) in host files, attached to VMs as
           virtio-pmem and mounted with DAX; ``erofs`` writes those images.
``smaps``  a process's mappings from ``/proc/PID/smaps``: resident pages by mapping
           mode (the DCSS paper's Table 4) and each shared segment's RSS and PSS.
``ksm``    the host's Kernel Samepage Merging: settings and counters in sysfs, per
           process ``/proc/PID/ksm_stat``, waiting for the scanner to settle.
``report`` per-VM host memory (PSS split, KSM, segments) and host totals with the
           savings of each mechanism.
"""
