#!/fusuma/bin/sh
# fusuma Debian guest: its init (busybox sh from /fusuma/bin, PID 1), in two stages.
#
# Stage 1 is the initramfs's /init. The initramfs holds only busybox, the kernel
# modules and these scripts; Debian's whole root is the image's root.erofs, mounted
# read-only from one of:
#   a segment   fusuma.seg=NAME:/, a virtio-pmem device mounted with DAX (executed in
#               place from the host's one copy: the DCSS layout)
#   the disk    root.erofs on a read-only virtio-blk disk with serial fusuma-root
#               (read through this guest's page cache: a copy per VM)
# An overlayfs on top of it, its upper layer a small tmpfs (fusuma.overlay_size=SIZE,
# default 64m), makes /etc, /var, /tmp and /root writable and private to the VM. /proc,
# /sys, /dev and /run (which holds the two layers' mounts) move into it and
# switch_root starts stage 2 there. A root that cannot be mounted is said in one line
# on the console and the VM powers off.
#
# Stage 2 (/fusuma/init --root, from Debian's root) mounts the other segments, brings
# up the network (QEMU user networking), starts Debian's qemu-ga and apache2, says
# "fusuma-guest: ready" and keeps a Debian shell on the console.

export PATH=/fusuma/bin
export HOME=/root
AGENT_PORT=org.qemu.guest_agent.0
LOWER=/run/fusuma/lower     # root.erofs
RW=/run/fusuma/rw           # the overlay's tmpfs: upper/ and work/
NEWROOT=/newroot

. /fusuma/lib.sh

# The one line a guest without a root says, then power off (QEMU exits). Should
# poweroff fail, PID 1 exits: the kernel panics, and panic=-1 with QEMU's -no-reboot
# ends the VM too.
no_root() {
    echo "fusuma-guest: cannot mount the root filesystem: $*; powering off" >/dev/console
    poweroff -f
    sleep 5
    exit 1
}

stage1() {
    mount_kernel_fs
    while read -r mod; do
        [ -n "$mod" ] || continue
        insmod "/fusuma/modules/$mod" || echo "fusuma-guest: cannot load $mod" >&2
    done < /fusuma/modules.list
    tune_page_reporting
    mkdir -p "$LOWER" "$RW" "$NEWROOT"

    seg=$(segments | while read -r name dir dev; do
        [ "$dir" = / ] && echo "$name $dev" && break
    done)
    if [ -n "$seg" ]; then
        name=${seg% *}
        dev=${seg#* }
        wait_block "$dev" || no_root "segment $name ($dev) did not appear"
        mount_segment "$name" "$dev" "$LOWER" ||
            no_root "segment $name is not an erofs image"
    else
        tries=0
        until disk=$(disk_by_serial fusuma-root) || [ "$tries" -ge 250 ]; do
            tries=$((tries + 1))
            usleep 20000
        done
        [ -n "$disk" ] || no_root "no segment at / and no root disk (serial fusuma-root)"
        mount -t erofs -o ro "$disk" "$LOWER" ||
            no_root "the root disk $disk is not an erofs image"
    fi

    size=64m
    for arg in $(cat /proc/cmdline); do
        case "$arg" in
            fusuma.overlay_size=?*) size=${arg#fusuma.overlay_size=} ;;
        esac
    done
    mount -t tmpfs -o "mode=0755,size=$size" tmpfs "$RW" ||
        no_root "cannot mount a tmpfs of size $size for its writable layer"
    mkdir -p "$RW/upper" "$RW/work"
    mount -t overlay -o "lowerdir=$LOWER,upperdir=$RW/upper,workdir=$RW/work" \
        overlay "$NEWROOT" || no_root "cannot mount the overlay"
    [ -x "$NEWROOT/fusuma/init" ] ||
        no_root "it has no /fusuma/init (not the root of a fusuma Debian image)"
    for d in /dev /proc /sys /run; do
        mount --move "$d" "$NEWROOT$d" || no_root "cannot move $d into it"
    done
    exec switch_root "$NEWROOT" /fusuma/init --root
}

stage2() {
    mkdir -p /run/lock
    mount_segments
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
}

if [ "$1" = --root ]; then
    stage2
else
    stage1
fi
