#!/usr/bin/env bash
# Installs what the real-kernel VM tier (tests/vm) needs, all from Debian's packages: QEMU and a static
# busybox (installed), and the current stock kernel, linux-image-<abi>-amd64, fetched with
# `apt-get download` and unpacked with `dpkg -x` into a cache directory (not installed: the machine's
# own kernel and boot setup stay untouched). Idempotent: a kernel already unpacked is not fetched again.
#
#   scripts/vm-setup.sh            # as root; .ci/run calls it
#
# The tests find the kernel at $MIXED_CPU_VM_KERNEL_DIR, by default
# ${XDG_CACHE_HOME:-$HOME/.cache}/mixed-cpu-nri-plugin/vm-kernel/current (a symlink made here).
set -euo pipefail

cache="${XDG_CACHE_HOME:-$HOME/.cache}/mixed-cpu-nri-plugin/vm-kernel"
export DEBIAN_FRONTEND=noninteractive

apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends qemu-system-x86 busybox-static >/dev/null

# The ABI package the metapackage points at now (e.g. linux-image-6.1.0-56-amd64), at its candidate version.
package="$(apt-cache depends linux-image-amd64 | awk '$1 == "Depends:" && $2 ~ /^linux-image-/ { print $2; exit }')"
version="$(apt-cache policy "$package" | awk '$1 == "Candidate:" { print $2 }')"
if [ -z "$package" ] || [ -z "$version" ] || [ "$version" = "(none)" ]; then
  echo "vm-setup: cannot resolve the kernel package behind linux-image-amd64" >&2
  exit 1
fi
mkdir -p "$cache"
target="$cache/${package}_${version}"
if [ ! -d "$target/boot" ]; then
  download="$(mktemp -d)"
  trap 'rm -rf "$download" "$target.partial"' EXIT
  (cd "$download" && apt-get download -q -o APT::Sandbox::User=root "$package=$version" >/dev/null)
  rm -rf "$target.partial"
  dpkg -x "$download"/*.deb "$target.partial"
  mv "$target.partial" "$target"
fi
ln -sfn "$(basename "$target")" "$cache/current"
# Kernels the metapackage no longer points at (~400 MB each unpacked).
for old in "$cache"/linux-image-*; do
  if [ "$old" != "$target" ]; then
    rm -rf "$old"
  fi
done
qemu="$(dpkg-query -W -f '${Version}' qemu-system-x86)"
busybox="$(dpkg-query -W -f '${Version}' busybox-static)"
echo "vm-setup: qemu-system-x86 $qemu, busybox-static $busybox, $package $version in $target"
