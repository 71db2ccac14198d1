#!/bin/busybox sh
# /init of the test VM's initramfs (built by vm_support.py), and the busybox-mode stages after it.
#
# Stage `initramfs` (PID 1 from the initramfs): load the modules, mount the host's root (9p,
# read-only) under a tmpfs overlay, prepare the new root, switch to it. Then, by /vm.conf's MODE:
#   busybox: busybox init runs stage `v2` (cgroup v2 with +cpu +cpuset) and stage `agent`;
#   systemd: systemd is PID 1, and a unit of ours starts the agent.
# The agent (guest_agent.py, run by the host's python through the 9p root) serves the host's
# requests on the virtio port `agent`. Anything that fails here powers the VM off, so the host sees
# QEMU exit (and the console log) instead of waiting for its boot timeout.
set -u
BB=/bin/busybox

fail() {
    echo "vm-init: $*" >&2
    $BB sync
    $BB poweroff -f
    exit 1
}

stage_initramfs() {
    $BB mkdir -p /proc /sys /dev /lower /rw /newroot
    $BB mount -t proc proc /proc || fail "mount proc"
    $BB mount -t sysfs sysfs /sys || fail "mount sysfs"
    $BB mount -t devtmpfs devtmpfs /dev || fail "mount devtmpfs"
    . /vm.conf
    for module in $MODULES; do
        $BB insmod "/modules/$module.ko" || fail "insmod $module"
    done
    $BB mount -t 9p -o "trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000" hostroot /lower \
        || fail "mount the host's root over 9p"
    $BB mount -t tmpfs -o mode=0755 rw /rw || fail "mount the overlay's tmpfs"
    $BB mkdir -p /rw/upper /rw/work
    $BB mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot \
        || fail "mount the overlay root"
    # The host's /tmp and /var/tmp are not ours (sockets, other users' files): fresh ones.
    $BB mount -t tmpfs -o mode=1777 tmp /newroot/tmp || fail "mount /tmp"
    $BB mount -t tmpfs -o mode=1777 vartmp /newroot/var/tmp || fail "mount /var/tmp"
    # ... but a checkout under one of them must stay visible (and writable, in the guest only).
    case "$CHECKOUT" in
    /tmp/* | /var/tmp/*)
        $BB mkdir -p /rw/checkout/upper /rw/checkout/work "/newroot$CHECKOUT"
        $BB mount -t overlay \
            -o "lowerdir=/lower$CHECKOUT,upperdir=/rw/checkout/upper,workdir=/rw/checkout/work" \
            overlay "/newroot$CHECKOUT" || fail "mount the checkout $CHECKOUT"
        ;;
    esac
    # The host may be a container: systemd would then ignore the kernel command line.
    $BB rm -f /newroot/.dockerenv
    $BB mkdir -p /newroot/.vm
    $BB cp /bin/busybox /init /vm.conf /newroot/.vm/ || fail "copy the stages into the new root"
    for fs in dev proc sys; do
        $BB mount --move "/$fs" "/newroot/$fs" || fail "move /$fs"
    done
    case "$MODE" in
    busybox)
        printf '%s\n' "::sysinit:/.vm/busybox sh /.vm/init v2" "::once:/.vm/busybox sh /.vm/init agent" \
            > /newroot/etc/inittab
        exec $BB switch_root /newroot /.vm/busybox init
        ;;
    systemd)
        write_units
        exec $BB switch_root /newroot /lib/systemd/systemd
        ;;
    esac
    fail "unknown MODE $MODE"
}

# systemd mode: the agent as a service, in a target of its own (the kernel command line names it).
write_units() {
    units=/newroot/etc/systemd/system
    $BB mkdir -p "$units"
    printf '%s\n' "[Unit]" "Description=the test VM: basic system, D-Bus, and the agent" \
        "Requires=basic.target vm-agent.service" "Wants=dbus.socket" "After=basic.target" \
        "AllowIsolate=yes" > "$units/vm-test.target"
    printf '%s\n' "[Unit]" "Description=the test VM's agent" "After=basic.target dbus.socket" \
        "[Service]" "ExecStart=$AGENT_PYTHON $AGENT_SCRIPT" "ExecStopPost=/.vm/busybox poweroff -f" \
        "StandardOutput=journal+console" "StandardError=journal+console" "Environment=VM_MODE=systemd" \
        > "$units/vm-agent.service"
}

# busybox mode, from inittab: the cgroup v2 hierarchy with cpu and cpuset for children.
stage_v2() {
    $BB mount -t tmpfs -o mode=0755 run /run
    $BB mount -t cgroup2 cgroup2 /sys/fs/cgroup || fail "mount cgroup2"
    echo "+cpu +cpuset" > /sys/fs/cgroup/cgroup.subtree_control || fail "enable +cpu +cpuset"
    $BB ip link set lo up
    $BB hostname vm
}

stage_agent() {
    . /.vm/vm.conf
    VM_MODE=busybox "$AGENT_PYTHON" "$AGENT_SCRIPT"
    echo "vm-init: the agent exited ($?)" >&2
    $BB sync
    $BB poweroff -f
}

case "${1:-initramfs}" in
initramfs) stage_initramfs ;;
v2) stage_v2 ;;
agent) stage_agent ;;
*) fail "unknown stage $1" ;;
esac
