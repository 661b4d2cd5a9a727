#!/bin/sh
# Runs a command as PID 1 of fresh mount + PID namespaces, chrooted into a throwaway root:
# an overlay whose lower layer is the host's / by default (read-only in effect: writes land on a
# tmpfs) with its own /etc/passwd (root + `user`, uid 1000), an empty /home and /tmp (with
# --upper, /home, /tmp and /root are the host's under the upper layer). Everything it
# mounts vanishes with the namespaces, so a crashed test cannot leak mounts or processes.
#
#   throwaway_root.sh [--private-dev] [--lower DIR] [--upper DIR] [--ro-bind SRC DST]... \
#       SCRATCH_DIR BIND_PATH... \
#       -- COMMAND...
#
# BIND_PATHs (e.g. the project and its Python) are bind-mounted at the same place in the root,
# in case they live on another filesystem than /. --lower replaces the host's / as the overlay's
# lower layer (e.g. a debootstrapped tree, which stays unmodified); --upper keeps the writes in
# DIR/upper (work dir DIR/work) instead of a tmpfs, so they outlive the root; --ro-bind mounts
# SRC read-only at DST in the root (e.g. the envd bundle at /opt/aenv, as a guest mounts it).
# --private-dev gives the root its own /dev (a few bound device nodes, its own ptys and /dev/shm)
# instead of the host's: fuzzed file operations must not reach the host's device nodes or shm.
set -eu
lower=/ upper="" robinds="" privdev=""
while :; do
  case "$1" in
    --private-dev) privdev=1; shift ;;
    --lower) lower=$2; shift 2 ;;
    --upper) upper=$2; shift 2 ;;
    --ro-bind) robinds="$robinds $2:$3"; shift 3 ;;
    *) break ;;
  esac
done
scratch=$1; shift
binds=""
while [ "$1" != "--" ]; do binds="$binds $1"; shift; done
shift

exec unshare --mount --pid --fork --kill-child --propagation private -- /bin/sh -eu -c '
scratch=$1; binds=$2; lower=$3; robinds=$4; upper=$5; privdev=$6; shift 6
root=$scratch/root layer=${upper:-$scratch/layer}
mkdir -p "$root" "$layer"
[ -n "$upper" ] || mount -t tmpfs -o mode=0755 aenv-test-layer "$layer"
mkdir -p "$layer/upper" "$layer/work"
mount -t overlay aenv-test-root -o "lowerdir=$lower,upperdir=$layer/upper,workdir=$layer/work" "$root"
mount -t proc proc "$root/proc"
if [ -n "$privdev" ]; then
  mount -t tmpfs -o mode=0755,nosuid aenv-test-dev "$root/dev"
  for d in null zero full random urandom tty; do
    touch "$root/dev/$d"; mount --bind "/dev/$d" "$root/dev/$d"
  done
  mkdir "$root/dev/pts" "$root/dev/shm"
  mount -t devpts -o newinstance,ptmxmode=0666,mode=0620 devpts "$root/dev/pts"
  ln -s pts/ptmx "$root/dev/ptmx"
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
  ln -s /proc/self/fd "$root/dev/fd"
else
  mount --rbind /dev "$root/dev"
fi
mount --rbind -o ro /sys "$root/sys" 2>/dev/null || mount --rbind /sys "$root/sys"
if [ -z "$upper" ]; then  # else they belong to the upper layer, like the rest of the root
  mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
  mount -t tmpfs -o mode=0755 tmpfs "$root/home"
  mount -t tmpfs -o mode=0700 tmpfs "$root/root"
fi
for p in $binds; do mkdir -p "$root$p"; mount --rbind "$p" "$root$p"; done
for b in $robinds; do mkdir -p "$root${b#*:}"; mount --bind -o ro "${b%%:*}" "$root${b#*:}"; done
grep -v -e "^user:" -e "^[^:]*:[^:]*:1000:" "$root/etc/passwd" > "$root/etc/passwd.new"
echo "user:x:1000:1000:Sandbox user:/home/user:/bin/bash" >> "$root/etc/passwd.new"
mv "$root/etc/passwd.new" "$root/etc/passwd"
grep -v -e "^user:" -e "^[^:]*:[^:]*:1000:" "$root/etc/group" > "$root/etc/group.new"
echo "user:x:1000:" >> "$root/etc/group.new"
mv "$root/etc/group.new" "$root/etc/group"
mkdir -p "$root/home/user" && chown 1000:1000 "$root/home/user"
exec chroot "$root" "$@"
' throwaway-root "$scratch" "$binds" "$lower" "$robinds" "$upper" "$privdev" "$@"
