# fusuma guest: shell functions shared by the minimal and the Debian /init.

mount_kernel_fs() {
    mount -t proc -o nosuid,nodev,noexec proc /proc
    mount -t sysfs -o nosuid,nodev,noexec sysfs /sys
    mount -t devtmpfs -o nosuid,mode=0755 devtmpfs /dev
    mkdir -p /dev/pts /dev/shm
    mount -t devpts -o nosuid,noexec,gid=5,mode=0620,ptmxmode=0666 devpts /dev/pts
    mount -t tmpfs -o nosuid,nodev,mode=1777 tmpfs /dev/shm
    mount -t tmpfs -o nosuid,nodev,mode=0755 tmpfs /run
}

# Segments: the kernel command line names them in virtio-pmem order,
# fusuma.seg=NAME:MOUNTPOINT (pmem device N = the N-th fusuma.seg). Each is an erofs
# image mounted read-only with DAX, so its pages are the host's shared copy.
mount_segments() {
    n=0
    for arg in $(cat /proc/cmdline); do
        case "$arg" in
            fusuma.seg=?*:/*) ;;
            *) continue ;;
        esac
        spec=${arg#fusuma.seg=}
        name=${spec%%:*}
        dir=${spec#*:}
        dev=/dev/pmem$n
        n=$((n + 1))
        tries=0
        while [ ! -b "$dev" ] && [ "$tries" -lt 100 ]; do
            tries=$((tries + 1))
            usleep 20000
        done
        mkdir -p "$dir"
        if mount -t erofs -o ro,dax=always "$dev" "$dir"; then
            echo "fusuma-guest: segment $name on $dir (dax)"
        elif mount -t erofs -o ro "$dev" "$dir"; then
            echo "fusuma-guest: segment $name on $dir WITHOUT dax" >&2
        else
            echo "fusuma-guest: cannot mount segment $name ($dev) on $dir" >&2
        fi
    done
}

# The block device whose virtio serial is $1 (fusuma passes serial=<disk name>).
disk_by_serial() {
    for b in /sys/block/vd*; do
        [ -r "$b/serial" ] && [ "$(cat "$b/serial")" = "$1" ] && echo "/dev/${b##*/}" &&
            return 0
    done
    return 1
}

set_hostname() {
    hostname fusuma
    for arg in $(cat /proc/cmdline); do
        case "$arg" in
            fusuma.name=?*) hostname "${arg#fusuma.name=}" ;;
        esac
    done
    ip link set lo up 2>/dev/null
}

# QEMU user networking: the guest is 10.0.2.15, the host's gateway 10.0.2.2.
net_up() {
    [ -e /sys/class/net/eth0 ] || return 0
    ip link set eth0 up &&
        ip addr add 10.0.2.15/24 dev eth0 &&
        ip route add default via 10.0.2.2 ||
        echo "fusuma-guest: cannot configure eth0" >&2
}

# virtio-serial ports show up as /dev/vportNpM; their names are in sysfs. Ports are
# announced by the host after the driver binds, so wait briefly when a virtio console
# device exists at all (device id 3). $1: the qemu-ga binary.
port_dev() {
    for p in /sys/class/virtio-ports/*; do
        [ -r "$p/name" ] && [ "$(cat "$p/name")" = "$1" ] && echo "/dev/${p##*/}" && return 0
    done
    return 1
}

start_agent() {
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
        "$1" -m virtio-serial -p "$agent" -t /run/qga -f /run/qemu-ga.pid \
            -l /run/qemu-ga.log &
    else
        echo "fusuma-guest: no $AGENT_PORT port, guest agent not started" >&2
    fi
}
