#!/fusuma/bin/sh
# fusuma Debian guest: /init of the initramfs (busybox sh from /fusuma/bin, PID 1).
#
# The initramfs holds Debian's own root directory minus /usr: /etc, /var, /root ...
# are unpacked into guest RAM, so they are private and writable in every VM. /usr is
# mounted read-only from one of:
#   fusuma.usr=disk   the image's usr.erofs on a virtio-blk disk with serial fusuma-usr
#                     (read through this guest's page cache: a copy per VM)
#   a segment         fusuma.seg=NAME:/usr, a virtio-pmem device mounted with DAX
#                     (executed in place from the host's one copy: the DCSS layout)
# Then it loads the modules, brings up the network (QEMU user networking), starts
# Debian's qemu-ga and apache2, says "fusuma-guest: ready" and keeps a Debian shell
# on the console.

export PATH=/fusuma/bin
export HOME=/root
AGENT_PORT=org.qemu.guest_agent.0

. /fusuma/lib.sh
mount_kernel_fs
mkdir -p /run/lock

kver=$(uname -r)
while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/fusuma/modules/$mod" || echo "fusuma-guest: cannot load $mod" >&2
done < /fusuma/modules.list

mount_segments
if ! grep -q " /usr " /proc/mounts; then
    usr=$(disk_by_serial fusuma-usr)
    if [ -n "$usr" ]; then
        mount -t erofs -o ro "$usr" /usr || echo "fusuma-guest: cannot mount /usr" >&2
    else
        echo "fusuma-guest: no /usr: neither a segment at /usr nor the usr disk" >&2
    fi
fi
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/fusuma/bin

set_hostname
net_up
start_agent /usr/sbin/qemu-ga

if [ -x /usr/sbin/apache2ctl ]; then
    mkdir -p /run/apache2 /var/log/apache2
    apache2ctl start || echo "fusuma-guest: apache2 did not start" >&2
fi

echo "fusuma-guest: ready"

while :; do
    setsid cttyhack /bin/bash -l 2>/dev/null || setsid cttyhack sh
    sleep 1
done
