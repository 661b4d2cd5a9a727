#!/bin/sh
# Debian/Ubuntu packages the project needs on the host (run as root). Idempotent and quiet when
# everything is already installed.
#   install-system-deps.sh        what a node needs (`make run`): VMs, network slots, guest
#                                 images, the envd bundle, npm for the dashboard's assets
#   install-system-deps.sh test   that and what only the tests need (`make test`): the servers
#                                 tests start (Redis, an OCI registry, a SOCKS5 proxy), the JS
#                                 SDKs' runtime, the code interpreter's host kernels (R, Java),
#                                 the browser the dashboard's tests drive
set -eu
NODE_PKGS="python3 python3-venv python3-dev gcc make git iproute2 nftables e2fsprogs \
  qemu-system-x86 qemu-utils busybox-static debootstrap cpio zstd patchelf util-linux binutils \
  debian-archive-keyring musl-tools nodejs npm"
TEST_PKGS="docker-registry skopeo umoci apache2-utils redis-server \
  r-base-core r-cran-irkernel openjdk-17-jdk-headless microsocks chromium"
case "${1:-node}" in
  node) PKGS=$NODE_PKGS ;;
  test) PKGS="$NODE_PKGS $TEST_PKGS" ;;
  *) echo "usage: $0 [node|test]" >&2; exit 2 ;;
esac
missing=""
for p in $PKGS; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# nodejs/npm may come from elsewhere (nodesource, nvm): a working `npm` is enough.
if command -v npm >/dev/null 2>&1; then
  missing=$(echo "$missing" | tr ' ' '\n' | grep -v -x -e nodejs -e npm | tr '\n' ' ')
fi
missing=$(echo "$missing" | xargs)
[ -z "$missing" ] && exit 0
echo "installing system packages: $missing"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# shellcheck disable=SC2086
apt-get install -y -q --no-install-recommends $missing
