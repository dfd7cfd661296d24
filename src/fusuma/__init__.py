"""fusuma: one Linux host divided into independent hypervisor partitions."""

__version__ = "0.1.0"
