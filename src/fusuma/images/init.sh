#!/bin/sh
# fusuma minimal guest: /init of the initramfs (busybox sh, PID 1).
# Mounts the kernel filesystems, loads the modules listed in /etc/fusuma/modules,
# starts qemu-ga on the virtio-serial port named org.qemu.guest_agent.0, says
# "fusuma-guest: ready" on the console and keeps a shell running there.
# Segments (fusuma.seg=NAME:DIR) are mounted read-only with DAX; disks are left
# unmounted: whoever uses the VM decides what to do with them.

export PATH=/sbin:/bin:/usr/sbin:/usr/bin
export HOME=/root
export PS1='\h:\w\$ '
AGENT_PORT=org.qemu.guest_agent.0

. /fusuma/lib.sh
mount_kernel_fs
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp

# No udev here: load what the image needs, in dependency order, by path.
kver=$(uname -r)
while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/lib/modules/$kver/$mod" ||
        echo "fusuma-guest: cannot load $mod" >&2
done < /etc/fusuma/modules
tune_page_reporting

set_hostname
mount_segments
net_up
start_agent qemu-ga

echo "fusuma-guest: ready"

# The console shell: a new session with ttyS0 as its controlling tty, restarted
# whenever it exits so `fusuma vm console` always finds a prompt.
while :; do
    setsid cttyhack sh
    sleep 1
done
