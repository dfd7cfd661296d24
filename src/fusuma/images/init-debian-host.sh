#!/fusuma/bin/sh
# fusuma "debian-host" guest: /init of the initramfs, which hands PID 1 to systemd.
#
# A stock-host stand-in: Debian with systemd as init (cgroup2 unified hierarchy, as a
# Debian 12 host has it), udev, qemu-ga and QEMU, for running fusuma itself inside the
# guest. The root directory minus /usr is the initramfs (private, in guest RAM); /usr
# is that of the image's root.erofs, on the virtio-blk disk with serial fusuma-root
# (mounted aside, its /usr bound on /usr and the rest unmounted). This script loads
# the image's modules, mounts /usr, names the host and execs systemd, which mounts
# /sys/fs/cgroup and starts qemu-ga when udev announces its port.

export PATH=/fusuma/bin
. /fusuma/lib.sh
mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev

while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/fusuma/modules/$mod" || echo "fusuma-guest: cannot load $mod" >&2
done < /fusuma/modules.list

root=
tries=0
until root=$(disk_by_serial fusuma-root) || [ "$tries" -ge 100 ]; do
    tries=$((tries + 1))
    usleep 20000
done
mkdir -p /fusuma/root
if [ -z "$root" ] || ! mount -t erofs -o ro "$root" /fusuma/root ||
        ! mount --bind /fusuma/root/usr /usr; then
    echo "fusuma-guest: cannot mount /usr (no root disk?); systemd cannot start" >&2
    exec /fusuma/bin/sh
fi
umount /fusuma/root    # /usr keeps the filesystem mounted

for arg in $(cat /proc/cmdline); do
    case "$arg" in
        fusuma.name=?*) echo "${arg#fusuma.name=}" > /etc/hostname ;;
    esac
done

# systemd mounts what it needs itself; /proc, /sys and /dev stay (it takes them over).
exec /usr/lib/systemd/systemd --log-level=warning
