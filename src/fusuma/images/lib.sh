# fusuma guest: shell functions shared by the minimal and the Debian /init.

# Free page reporting: the Debian 6.1 kernel ignores page_reporting.page_reporting_order
# on its command line (the balloon driver's registration overwrites it with the
# pageblock order, 2 MiB), but the parameter is writable: set it from the command line
# once the driver has loaded, before boot frees much more.
tune_page_reporting() {
    f=/sys/module/page_reporting/parameters/page_reporting_order
    [ -w "$f" ] || return 0
    for arg in $(cat /proc/cmdline); do
        case "$arg" in
            page_reporting.page_reporting_order=?*)
                echo "${arg#*=}" > "$f" 2>/dev/null ||
                    echo "fusuma-guest: cannot set the page reporting order" >&2 ;;
        esac
    done
}

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
# fusuma.seg=NAME:MOUNTPOINT (pmem device N = the N-th fusuma.seg). Prints one line
# "NAME MOUNTPOINT /dev/pmemN" per segment.
segments() {
    n=0
    for arg in $(cat /proc/cmdline); do
        case "$arg" in
            fusuma.seg=?*:/*) ;;
            *) continue ;;
        esac
        spec=${arg#fusuma.seg=}
        echo "${spec%%:*} ${spec#*:} /dev/pmem$n"
        n=$((n + 1))
    done
}

# Wait up to 5 s for block device $1 (virtio devices are probed as their drivers load,
# pmem regions and disk partitions a little later).
wait_block() {
    tries=0
    while [ ! -b "$1" ] && [ "$tries" -lt 250 ]; do
        tries=$((tries + 1))
        usleep 20000
    done
    [ -b "$1" ]
}

# Mount segment $1 (device $2) on $3: an erofs image, read-only, with DAX, so its pages
# are the host's shared copy; without DAX (said on the console) if the guest cannot.
mount_segment() {
    if mount -t erofs -o ro,dax=always "$2" "$3"; then
        echo "fusuma-guest: segment $1 on $3 (dax)"
    elif mount -t erofs -o ro "$2" "$3"; then
        echo "fusuma-guest: segment $1 on $3 WITHOUT dax" >&2
    else
        echo "fusuma-guest: cannot mount segment $1 ($2) on $3" >&2
        return 1
    fi
}

# Every segment but one at / (the Debian image's root, mounted by its stage-1 /init).
mount_segments() {
    segments | while read -r name dir dev; do
        [ "$dir" = / ] && continue
        wait_block "$dev"
        mkdir -p "$dir"
        mount_segment "$name" "$dev" "$dir"
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

# NICs on fusuma's networks (fusuma.net=dhcp on the command line): every ethN asks
# DHCP (busybox udhcpc; the managed network's dnsmasq gives the address fusuma
# recorded), in the background once it has a lease or has tried for a few seconds.
# It asks for the interface MTU too (option 26: a network spanning hosts has the
# VXLAN's 50 bytes less than 1500) and applies it. Without fusuma.net=dhcp, eth0 is
# QEMU's user-mode NIC, whose address is always the same.
UDHCPC_SCRIPT=/run/fusuma-udhcpc.sh

write_udhcpc_script() {
    mkdir -p /run
    cat > "$UDHCPC_SCRIPT" <<'EOS'
#!/bin/sh
# udhcpc's events: $interface, $ip, $mask (prefix length), $router, $dns, $domain,
# $mtu (when the server sends option 26).
case "$1" in
    deconfig)
        ip -4 addr flush dev "$interface"
        ip link set "$interface" up ;;
    bound|renew)
        if [ -n "$mtu" ]; then
            ip link set dev "$interface" mtu "$mtu"
        fi
        ip addr replace "$ip/${mask:-24}" dev "$interface"
        if [ -n "$router" ] && ! ip route | grep -q '^default'; then
            ip route add default via "${router%% *}" dev "$interface"
        fi
        if [ -n "$dns" ] && [ "$interface" = eth0 ]; then
            { [ -n "$domain" ] && echo "search $domain"
              for d in $dns; do echo "nameserver $d"; done; } > /etc/resolv.conf
        fi ;;
esac
exit 0
EOS
    chmod 0755 "$UDHCPC_SCRIPT"
}

dhcp_up() {
    write_udhcpc_script
    for d in /sys/class/net/eth*; do
        [ -e "$d" ] || continue
        ifc=${d##*/}
        ip link set "$ifc" up
        udhcpc -i "$ifc" -s "$UDHCPC_SCRIPT" -b -t 5 -T 1 -A 1 -O mtu \
            -x "hostname:$(hostname)" >/dev/null 2>&1 ||
            echo "fusuma-guest: no DHCP on $ifc" >&2
    done
}

# QEMU user networking: the guest is 10.0.2.15, the host's gateway 10.0.2.2.
net_up() {
    if grep -q 'fusuma.net=dhcp' /proc/cmdline; then
        dhcp_up
        return 0
    fi
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
