#!/bin/sh
# fusuma minimal guest: /sbin/shutdown for qemu-ga's guest-shutdown, which runs
# `shutdown -h|-P|-r +0 ...`. Busybox has no shutdown applet and there is no init
# system to ask, so sync and power off (or reboot) at once.
sync
for arg in "$@"; do
    [ "$arg" = -r ] && exec reboot -f
done
exec poweroff -f
