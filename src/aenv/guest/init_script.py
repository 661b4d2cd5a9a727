"""Our PID 1, as two busybox-sh scripts (kept here as text so they ship inside the package).

Stage 1 (`/init` of the initramfs) loads modules, assembles the root filesystem as an overlay of
the read-only template base and the sandbox's writable layer, configures the network, mounts the
envd bundle, then `switch_root`s to stage 2, which it leaves on a tmpfs at `/run/aenv` together
with busybox and `aenv-init`: the template image need not contain a shell. In the real root PID
1 is `aenv-init` (`aenv.guest.pid1`), because busybox sh does not reap orphans re-parented to it
(checked: they stay zombies); it runs stage 2, which mounts the API filesystems and starts envd,
restarting it if it dies.
"""

from __future__ import annotations

from aenv.envd import ENVD_PORT
from aenv.guest.cmdline import ENVD_LABEL, READY_MARKER, ROOT_LABEL, UPPER_LABEL

STAGE1 = f"""#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t devtmpfs devtmpfs /dev
exec </dev/console >/dev/console 2>&1
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# PID 1 exiting panics the kernel; with panic=-1 and no-reboot the VMM exits and the host sees it.
fail() {{ echo "aenv-init: FATAL: $*"; exit 1; }}

for m in $(cat /modules.order); do insmod "/modules/$m" || fail "insmod $m"; done

for w in $(cat /proc/cmdline); do
  case "$w" in
    aenv.ip=*) AENV_IP="${{w#*=}}" ;;
    aenv.gw=*) AENV_GW="${{w#*=}}" ;;
    aenv.dns=*) AENV_DNS="${{w#*=}}" ;;
  esac
done

# virtio probes run asynchronously after insmod: wait for the root label to appear.
n=0
until base=$(findfs LABEL={ROOT_LABEL} 2>/dev/null); do
  n=$((n + 1)); [ $n -gt 100 ] && fail "no disk labelled {ROOT_LABEL}"; sleep 0.1
done
mkdir -p /layers/base /layers/rw /newroot
mount -t ext4 -o ro "$base" /layers/base || fail "mount base"
if upper=$(findfs LABEL={UPPER_LABEL} 2>/dev/null); then
  # discard: space a guest frees is given back to the host at once (QEMU passes it through
  # to its writable qcow2 top; a device without discard, such as Firecracker's, ignores it).
  mount -t ext4 -o rw,noatime,discard "$upper" /layers/rw || fail "mount upper"
else
  mount -t tmpfs -o mode=0755 tmpfs /layers/rw
fi
mkdir -p /layers/rw/upper /layers/rw/work
mount -t overlay overlay \\
  -o lowerdir=/layers/base,upperdir=/layers/rw/upper,workdir=/layers/rw/work /newroot \\
  || fail "mount overlay"

if bundle=$(findfs LABEL={ENVD_LABEL} 2>/dev/null); then
  mkdir -p /newroot/opt/aenv
  mount -t ext4 -o ro "$bundle" /newroot/opt/aenv || fail "mount envd bundle"
fi

ip link set lo up
if [ -n "$AENV_IP" ]; then
  ip link set eth0 up && ip addr add "$AENV_IP" dev eth0 || fail "eth0 $AENV_IP"
  [ -n "$AENV_GW" ] && ip route add default via "$AENV_GW"
fi
if [ -n "$AENV_DNS" ]; then
  rm -f /newroot/etc/resolv.conf; echo "nameserver $AENV_DNS" > /newroot/etc/resolv.conf
fi

mkdir -p /newroot/run /newroot/dev /newroot/proc /newroot/sys
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run
mkdir -p /newroot/run/aenv
cp /bin/busybox /bin/aenv-init /stage2 /newroot/run/aenv/
umount /proc /sys
mount --move /dev /newroot/dev
exec switch_root /newroot /run/aenv/aenv-init -- /run/aenv/busybox sh /run/aenv/stage2
"""

STAGE2 = f"""BB=/run/aenv/busybox
$BB mount -t proc proc /proc
$BB mount -t sysfs sysfs /sys
$BB mkdir -p /dev/pts /dev/shm /tmp
$BB mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /dev/pts
$BB mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm
$BB chmod 1777 /tmp
# An idle guest must not wake itself: proactive compaction (for huge pages, which guests do not
# use) wakes kcompactd twice a second, each wakeup emulated on the host (bench/idle.py).
echo 0 > /proc/sys/vm/compaction_proactiveness
# Likewise (bench/wakeups.py): each neighbour table (ARP, ND) runs its "managed" probe work every
# 5 s even with no managed entry (Linux 6.1), and vmstat folds per-CPU counters every second
# when the CPU is awake anyway. Neither is needed that often in a sandbox.
for t in ipv4 ipv6; do echo 3600000 > /proc/sys/net/$t/neigh/default/interval_probe_time_ms; done
echo 10 > /proc/sys/vm/stat_interval
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8
for w in $($BB cat /proc/cmdline); do
  case "$w" in aenv.hostname=*) $BB hostname "${{w#*=}}" ;; esac
done
if [ -x /opt/aenv/aenv-envd ]; then
  (while :; do
     # envd logs warnings only: the serial console (a file on the host) is the place for them.
     /opt/aenv/aenv-envd --port {ENVD_PORT} >/dev/console 2>&1
     echo "aenv-init: envd exited with status $?" >/dev/console
     $BB sleep 1
   done) &
fi
echo "{READY_MARKER}"
while :; do $BB sleep 3600; done
"""
