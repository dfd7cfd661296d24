"""The host machine as fusuma sees it: cgroups (v1 and v2 behind one interface), CPU and
memory topology, and the choice of accelerator (KVM or TCG)."""
