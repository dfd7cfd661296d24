#!/bin/sh
# fusuma minimal guest: /init of the initramfs (busybox sh, PID 1).
# Mounts the kernel filesystems, loads the modules listed in /etc/fusuma/modules,
# starts qemu-ga on the virtio-serial port named org.qemu.guest_agent.0, says
# "fusuma-guest: ready" on the console and keeps a shell running there.
# Disks are left unmounted: whoever uses the VM decides what to do with them.

export PATH=/sbin:/bin:/usr/sbin:/usr/bin
export HOME=/root
export PS1='\h:\w\$ '
AGENT_PORT=org.qemu.guest_agent.0

mount -t proc -o nosuid,nodev,noexec proc /proc
mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
mkdir -p /dev/pts /dev/shm
mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /tmp

# No udev here: load what the image needs, in dependency order, by path.
kver=$(uname -r)
while read -r mod; do
    [ -n "$mod" ] || continue
    insmod "/lib/modules/$kver/$mod" ||
        echo "fusuma-guest: cannot load $mod" >&2
done < /etc/fusuma/modules

hostname fusuma
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        fusuma.name=?*) hostname "${arg#fusuma.name=}" ;;
    esac
done
ip link set lo up 2>/dev/null

# virtio-serial ports show up as /dev/vportNpM; their names are in sysfs. Ports are
# announced by the host after the driver binds, so wait briefly when a virtio console
# device exists at all (device id 3).
port_dev() {
    for p in /sys/class/virtio-ports/*; do
        [ -r "$p/name" ] && [ "$(cat "$p/name")" = "$1" ] && echo "/dev/${p##*/}" && return 0
    done
    return 1
}
has_console=
for d in /sys/bus/virtio/devices/*; do
    [ "$(cat "$d/device" 2>/dev/null)" = 0x0003 ] && has_console=1
done
agent=
if [ -n "$has_console" ]; then
    tries=0
    until agent=$(port_dev "$AGENT_PORT") || [ "$tries" -ge 100 ]; do
        tries=$((tries + 1))
        usleep 20000
    done
    mkdir -p /dev/virtio-ports
    for p in /sys/class/virtio-ports/*; do
        name=$(cat "$p/name" 2>/dev/null) && [ -n "$name" ] &&
            ln -sf "../${p##*/}" "/dev/virtio-ports/$name"
    done
fi
if [ -n "$agent" ]; then
    mkdir -p /run/qga
    qemu-ga -m virtio-serial -p "$agent" -t /run/qga -f /run/qemu-ga.pid \
        -l /run/qemu-ga.log &
else
    echo "fusuma-guest: no $AGENT_PORT port, guest agent not started" >&2
fi

echo "fusuma-guest: ready"

# The console shell: a new session with ttyS0 as its controlling tty, restarted
# whenever it exits so `fusuma vm console` always finds a prompt.
while :; do
    setsid cttyhack sh
    sleep 1
done
