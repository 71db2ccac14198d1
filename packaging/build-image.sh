#!/usr/bin/env bash
# Build the daemon's image from packaging/Dockerfile with buildah, with no registry and no network
# inside the build, and smoke-test it. docs/deploy.md ("Building the image offline") explains it.
#
#   packaging/build-image.sh [all]    wheelhouse, bases, build, smoke (what .ci/run calls)
#   packaging/build-image.sh lock     re-resolve packaging/image.lock on PyPI (pins and sha256s)
#   packaging/build-image.sh wheelhouse | bases | build | smoke    one step
#
# * wheelhouse: the project's wheel (built here) and every dependency pinned in packaging/image.lock,
#   downloaded with their sha256s checked, into packaging/wheelhouse/ (what the Dockerfile installs
#   from, with pip --no-index; a docker/BuildKit build needs this step first too).
# * bases: the build stage's base (debootstrap --variant=minbase with Debian's python3.13 and its venv
#   module) and the runtime base (exactly the Debian packages gcr.io/distroless/python3-debian13 is
#   made of, unpacked without maintainer scripts: no shell, no package manager), each a tarball cached
#   under ${XDG_CACHE_HOME:-~/.cache}/mixed-cpu-nri-plugin/image/, named by a key of what it is made of
#   (this script's sha256 and the Debian package index or package versions it used) and checked
#   against the sha256 recorded when it was made; committed to buildah's store with `buildah from
#   scratch` + `buildah commit`.
# * build: `buildah bud --isolation chroot --network none` of packaging/Dockerfile against those bases.
# * smoke: the image's own commands run inside it (`buildah run --isolation chroot`): version,
#   check --help, demo, demo --dra, status.
#
# Needs root, buildah and debootstrap (Debian packages), and for wheelhouse/lock, PyPI.
# Environment: IMAGE (default localhost/mixed-cpu-nri-plugin:dev), DEBIAN_MIRROR,
# DEBIAN_SECURITY_MIRROR, XDG_CACHE_HOME.
set -euo pipefail
cd "$(dirname "$0")/.."

SUITE=trixie
PYTHON=python3.13
PY_TAG=cp313
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SECURITY_MIRROR=${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg
IMAGE=${IMAGE:-localhost/mixed-cpu-nri-plugin:dev}
LOCK=packaging/image.lock
WHEELHOUSE=packaging/wheelhouse
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/mixed-cpu-nri-plugin/image"
ARCH=$(dpkg --print-architecture)
# The lock pins one set of versions with the sha256 of each wheel for both architectures the
# distroless Python image is published for (BuildKit users build arm64 too).
LOCK_PLATFORMS=(x86_64 aarch64)
case "$ARCH" in
  amd64) PIP_ARCH=x86_64 ;;
  arm64) PIP_ARCH=aarch64 ;;
  *) echo "error: no wheels are locked for $ARCH (only amd64 and arm64)" >&2; exit 1 ;;
esac
# What gcr.io/distroless/python3-debian13 is made of, package for package: its static layer (files
# every image has), its base and cc layers (the C and C++ runtimes), and its Python layer.
RUNTIME_PACKAGES=(
  base-files netbase tzdata tzdata-legacy media-types ca-certificates
  libc6 libssl3t64 libzstd1 zlib1g
  libgomp1 libstdc++6 libgcc-s1 gcc-14-base
  libbz2-1.0 libdb5.3t64 libexpat1 liblzma5 libsqlite3-0 libuuid1 libncursesw6 libtinfo6
  libcom-err2 libcrypt1 libc-bin libgssapi-krb5-2 libk5crypto3 libkeyutils1 libkrb5-3
  libkrb5support0 libnsl2 libreadline8t64 libtirpc3t64 libffi8
  libpython3.13-minimal libpython3.13-stdlib python3.13-minimal python3.13-venv
)
BUILD_PACKAGES=python3.13,python3.13-venv

script_sha=$(sha256sum "$0" | cut -c1-64)
log() { printf '== %s: %s\n' "$(date -u +%H:%M:%S)" "$*"; }

# pip for PyPI, as a user's plain pip: this machine's own pip settings (find-links to local
# wheels, constraints) left out, its CA kept (the network's TLS may be re-signed).
host_pip() {
  local cert
  cert=${PIP_CERT:-$(python3 -m pip config get global.cert 2>/dev/null || true)}
  env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL -u PIP_CONSTRAINT -u PIP_REQUIREMENT \
    PIP_CONFIG_FILE=/dev/null ${cert:+PIP_CERT="$cert"} PIP_DISABLE_PIP_VERSION_CHECK=1 \
    python3 -m pip "$@"
}

# pip download's options for wheels that run on the image's Python on PLATFORM: every manylinux
# tag up to Debian 13's glibc 2.41 (pip takes the platforms named, not the older ones they admit).
wheel_target() {
  local minor
  echo --only-binary=:all: --implementation cp --python-version "${PY_TAG#cp}"
  for minor in $(seq 41 -1 5); do echo --platform "manylinux_2_${minor}_$1"; done
  echo --platform "manylinux2014_$1" --platform "manylinux2010_$1" --platform "manylinux1_$1"
}

project_wheel() {
  local out=$1
  rm -f "$out"/mixed_cpu_nri_plugin-*.whl
  # The wheel's zip entries dated 1980-01-01 (zip's first date), not at the build: the same sources
  # give the same wheel, and so the same image.
  SOURCE_DATE_EPOCH=315532800 host_pip wheel -q --no-deps -w "$out" . >/dev/null
  ls "$out"/mixed_cpu_nri_plugin-*.whl
}

cmd_lock() {
  local tmp wheel platform pins
  tmp="$work/lock"
  mkdir -p "$tmp"
  wheel=$(project_wheel "$tmp")
  log "lock: resolving $(basename "$wheel")[dra] for $PY_TAG on PyPI"
  # shellcheck disable=SC2046
  host_pip download -q -d "$tmp/${LOCK_PLATFORMS[0]}" $(wheel_target "${LOCK_PLATFORMS[0]}") "$wheel[dra]" \
    >/dev/null
  rm -f "$tmp/${LOCK_PLATFORMS[0]}"/mixed_cpu_nri_plugin-*.whl
  pins=$(python3 packaging/image_lock.py pins "$tmp/${LOCK_PLATFORMS[0]}")
  for platform in "${LOCK_PLATFORMS[@]:1}"; do
    # The same versions for the other platform (a version without a wheel for it fails here).
    # shellcheck disable=SC2046,SC2086
    host_pip download -q --no-deps -d "$tmp/$platform" $(wheel_target "$platform") $pins >/dev/null
  done
  python3 packaging/image_lock.py write "$LOCK" "${LOCK_PLATFORMS[@]/#/$tmp/}"
  log "lock: wrote $LOCK ($(wc -w <<<"$pins") distributions)"
}

cmd_wheelhouse() {
  log "wheelhouse: the project's wheel and $LOCK's wheels for $PIP_ARCH into $WHEELHOUSE"
  rm -rf "$WHEELHOUSE" && mkdir -p "$WHEELHOUSE"
  project_wheel "$WHEELHOUSE" >/dev/null
  # --require-hashes: a wheel whose sha256 is not the locked one fails the download.
  # shellcheck disable=SC2046
  host_pip download -q --no-deps --require-hashes -d "$WHEELHOUSE" $(wheel_target "$PIP_ARCH") -r "$LOCK" \
    >/dev/null
}

# apt over Debian SUITE (and its security updates), in a directory of its own: the host's sources
# and settings are not used.
apt_options=()
private_apt() { apt-get -q "${apt_options[@]}" "$@"; }
private_apt_cache() { apt-cache "${apt_options[@]}" "$@"; }
setup_apt() {
  local apt_dir="$work/apt"
  apt_options=(-o Dir::Etc::SourceList="$apt_dir/sources.list" -o Dir::Etc::SourceParts="$apt_dir/none"
    -o Dir::Etc::Parts="$apt_dir/none" -o Dir::Etc::PreferencesParts="$apt_dir/none"
    -o Dir::Etc::Preferences="$apt_dir/none/preferences" -o Dir::State::Lists="$apt_dir/lists"
    -o Dir::Cache="$apt_dir/cache" -o Dir::State::status="$apt_dir/status"
    -o APT::Architecture="$ARCH" -o APT::Sandbox::User=root -o Debug::NoLocking=1)
  mkdir -p "$apt_dir"/{lists/partial,cache/archives/partial,none,debs}
  : >"$apt_dir/status"
  printf 'deb [signed-by=%s] %s %s main\ndeb [signed-by=%s] %s %s-security main\n' \
    "$KEYRING" "$MIRROR" "$SUITE" "$KEYRING" "$SECURITY_MIRROR" "$SUITE" >"$apt_dir/sources.list"
  private_apt update >/dev/null
}

# A cached tarball is used only if its sha256 is the one recorded when it was made.
cached_ok() {
  [ -f "$1" ] && [ -f "$1.sha256" ] && (cd "$(dirname "$1")" && sha256sum -c --status "$(basename "$1").sha256")
}
store() {  # store ROOTFS TARBALL: a deterministic tarball of ROOTFS, then its sha256
  tar --format=gnu --sort=name --numeric-owner --mtime=@0 -C "$1" -cf "$2.tmp" .
  mv "$2.tmp" "$2"
  (cd "$(dirname "$2")" && sha256sum "$(basename "$2")" >"$(basename "$2").sha256")
}
commit_base() {  # commit_base TARBALL NAME
  local ctr old
  # This base under any key (an older one, or this one again): buildah's store keeps one.
  for old in $(buildah images --noheading --format '{{.Name}}:{{.Tag}}' 2>/dev/null | grep "^${2%:*}:"); do
    buildah rmi -f "$old" >/dev/null 2>&1 || true
  done
  ctr=$(buildah from --quiet scratch)
  buildah add --quiet "$ctr" "$1" / >/dev/null
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$ctr"
  buildah commit --quiet --rm --timestamp 0 "$ctr" "$2" >/dev/null
}

# base NAME KEY MAKE: the base NAME made of what KEY names: its tarball from the cache when its
# sha256 is the one recorded when it was made, else made by the function MAKE in a fresh directory
# (and cached); then committed to buildah's store as localhost/mixed-cpu-nri-plugin/NAME:KEY.
base() {
  local name=$1 key=$2 make=$3 tarball="$CACHE/$1-$2.tar" rootfs="$work/$1-rootfs"
  if cached_ok "$tarball"; then
    log "$name: cached $tarball (sha256 checked)"
  else
    [ ! -e "$tarball" ] || echo "warning: $tarball does not match its recorded sha256: made again" >&2
    "$make" "$rootfs"
    rm -f "$CACHE/$name"-*.tar*
    store "$rootfs" "$tarball"
    rm -rf "$rootfs"
  fi
  commit_base "$tarball" "localhost/mixed-cpu-nri-plugin/$name:$key"
}

make_build_base() {  # the build stage's base: debootstrap minbase and Debian's Python with venv
  local rootfs=$1
  log "build-base: debootstrap --variant=minbase $SUITE with $BUILD_PACKAGES"
  debootstrap --variant=minbase --include="$BUILD_PACKAGES" --keyring="$KEYRING" "$SUITE" "$rootfs" \
    "$MIRROR" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; return 1; }
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*
}

make_runtime_base() {  # the runtime base: the distroless Python image's packages, unpacked
  local rootfs=$1 deb pkg dir
  log "runtime-base: ${#RUNTIME_PACKAGES[@]} packages of $SUITE unpacked, no maintainer scripts"
  # apt-get download checks each .deb against the signed index.
  (cd "$work/apt/debs" && private_apt download "${RUNTIME_PACKAGES[@]}" >/dev/null)
  mkdir -p "$rootfs/var/lib/dpkg/status.d"
  for deb in "$work"/apt/debs/*.deb; do
    dpkg-deb -x "$deb" "$rootfs"
    pkg=$(dpkg-deb -f "$deb" Package)
    # What image scanners read (distroless writes the same): one control file per package.
    dpkg-deb -f "$deb" >"$rootfs/var/lib/dpkg/status.d/$pkg"
  done
  # Debian 13 is merged-/usr: /bin, /sbin, /lib and /lib64 are links into /usr.
  for dir in bin sbin lib lib64; do
    if [ -d "$rootfs/$dir" ] && [ ! -L "$rootfs/$dir" ]; then
      mkdir -p "$rootfs/usr/$dir"
      cp -a "$rootfs/$dir/." "$rootfs/usr/$dir/"
      rm -rf "${rootfs:?}/$dir"
    fi
    [ -e "$rootfs/$dir" ] || ln -s "usr/$dir" "$rootfs/$dir"
  done
  # What distroless adds beside the packages: its users, the CA bundle made from the
  # ca-certificates package's certificates, a name-service config, /tmp, python and python3.
  printf 'root:x:0:0:root:/root:/sbin/nologin\nnobody:x:65534:65534:nobody:/nonexistent:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' \
    >"$rootfs/etc/passwd"
  printf 'root:x:0:\nnobody:x:65534:\nnonroot:x:65532:\n' >"$rootfs/etc/group"
  printf 'passwd: files\ngroup: files\nshadow: files\nhosts: files dns\nnetworks: files\nprotocols: files\nservices: files\n' \
    >"$rootfs/etc/nsswitch.conf"
  mkdir -p "$rootfs/etc/ssl/certs" "$rootfs/root" "$rootfs/home/nonroot" "$rootfs/tmp"
  find "$rootfs/usr/share/ca-certificates" -name '*.crt' | LC_ALL=C sort | xargs cat \
    >"$rootfs/etc/ssl/certs/ca-certificates.crt"
  chmod 1777 "$rootfs/tmp"
  chmod 700 "$rootfs/root"
  chown 65532:65532 "$rootfs/home/nonroot"
  ln -sf "$PYTHON" "$rootfs/usr/bin/python3"
  ln -sf "$PYTHON" "$rootfs/usr/bin/python"
  # The dynamic linker's cache, made by the image's own ldconfig (libc-bin) as distroless ships one.
  chroot "$rootfs" /sbin/ldconfig
  rm -f "$rootfs/var/cache/ldconfig/aux-cache"
  [ ! -e "$rootfs/bin/sh" ] || { echo "error: the runtime base has a shell" >&2; return 1; }
}

cmd_bases() {
  local key versions
  mkdir -p "$CACHE"
  setup_apt
  # The build base is keyed by the suite's package index (its sha256, from the signed InRelease):
  # debootstrap resolves the same packages from the same index.
  key=$( (echo "$script_sha $SUITE $ARCH $BUILD_PACKAGES"
    grep -E " main/binary-$ARCH/Packages$" "$work"/apt/lists/*_dists_${SUITE}_InRelease) |
    sha256sum | cut -c1-16)
  base build-base "$key" make_build_base
  BUILD_BASE="localhost/mixed-cpu-nri-plugin/build-base:$key"
  # The runtime base by each package's version and sha256, as the index gives them.
  versions=$(private_apt_cache show --no-all-versions "${RUNTIME_PACKAGES[@]}" |
    awk '/^Package:/{p=$2} /^Version:/{v=$2} /^SHA256:/{print p, v, $2}' | sort)
  [ "$(wc -l <<<"$versions")" -eq ${#RUNTIME_PACKAGES[@]} ] ||
    { echo "error: not every runtime package is in $SUITE: $versions" >&2; return 1; }
  key=$(printf '%s %s\n%s\n' "$script_sha" "$ARCH" "$versions" | sha256sum | cut -c1-16)
  base runtime-base "$key" make_runtime_base
  RUNTIME_BASE="localhost/mixed-cpu-nri-plugin/runtime-base:$key"
}

cmd_build() {
  [ -n "${BUILD_BASE:-}" ] || { echo "error: no bases (run the bases step first)" >&2; return 1; }
  local previous
  previous=$(buildah images --noheading --format '{{.ID}}' "$IMAGE" 2>/dev/null || true)
  log "build: $IMAGE from packaging/Dockerfile on $BUILD_BASE, $RUNTIME_BASE"
  # In a network namespace of its own with no interface up (chroot isolation shares the caller's
  # network): nothing in the build can reach the network. --pull-never: the bases are the local ones.
  # --timestamp 0: the image's dates and its files' mtimes are fixed, so the same inputs give the
  # same layers.
  unshare --net buildah bud --quiet --isolation chroot --pull-never --layers=false --timestamp 0 \
    --build-arg DEBIAN_IMAGE="$BUILD_BASE" --build-arg RUNTIME_IMAGE="$RUNTIME_BASE" \
    -f packaging/Dockerfile -t "$IMAGE" . >/dev/null
  # The image this one replaces, untagged now, is dropped (unless it is the same image).
  if [ -n "$previous" ] && [ "$previous" != "$(buildah images --noheading --format '{{.ID}}' "$IMAGE")" ]; then
    buildah rmi "$previous" >/dev/null 2>&1 || true
  fi
  log "image $IMAGE: ID $(buildah images --noheading --format '{{.ID}}' "$IMAGE"), $(image_size) unpacked"
}

image_size() {  # the image's unpacked size, as buildah's store counts it
  buildah images --format '{{.Size}}' --noheading "$IMAGE" 2>/dev/null | head -1
}

cmd_smoke() {
  local ctr out status=0
  ctr=$(buildah from --quiet --pull-never "$IMAGE")
  smoke_ctr=$ctr
  inside() { buildah run --isolation chroot "$ctr" -- /opt/mixed-cpu-nri-plugin/bin/python \
    /opt/mixed-cpu-nri-plugin/bin/mixed-cpu-nri-plugin "$@" 2>&1; }
  expect() {  # expect WANTED_STATUS PATTERN COMMAND...: the command's status and a line it prints
    local want=$1 pattern=$2 got=0
    shift 2
    out=$(inside "$@") || got=$?
    if [ "$got" -ne "$want" ] || ! grep -qE -- "$pattern" <<<"$out"; then
      echo "smoke: FAILED: mixed-cpu-nri-plugin $* exited $got (wanted $want), printing:" >&2
      echo "$out" | tail -20 >&2
      status=1
    else
      echo "smoke: ok: mixed-cpu-nri-plugin $* -> $(grep -E -m1 -- "$pattern" <<<"$out")"
    fi
  }
  log "smoke: the image's commands inside it (buildah run --isolation chroot)"
  expect 0 '^mixed-cpu-nri-plugin [0-9]' version
  expect 0 'usage: mixed-cpu-nri-plugin check' check --help
  expect 0 '^[0-9]+ more NRI exchange\(s\), 0 failed' demo
  expect 0 'NodeUnprepareResources -> ok' demo --dra
  # No daemon runs here: status must say so, and what to do, and exit 1: as `kubectl exec` runs it
  # (no config file: the default state dir), then with the config the DaemonSet mounts.
  expect 1 'status.sock: the daemon is not running.*start it' status
  printf 'shared_cpuset = "0-1"\nstate_dir = "/tmp/state"\n' >"$work/config.toml"
  buildah copy --quiet "$ctr" "$work/config.toml" /etc/mixed-cpu-nri/config.toml >/dev/null
  expect 1 '/tmp/state/status.sock: the daemon is not running.*start it' status
  # Nothing but the Python runtime: no shell, no package manager.
  if buildah run --isolation chroot "$ctr" -- /bin/sh -c true >/dev/null 2>&1; then
    echo "smoke: FAILED: the image has a shell" >&2
    status=1
  else
    echo "smoke: ok: no /bin/sh in the image"
  fi
  return $status
}

step=${1:-all}
work=$(mktemp -d /var/tmp/mixed-cpu-image.XXXXXX)
smoke_ctr=""
trap 'rm -rf "$work"; [ -z "$smoke_ctr" ] || buildah rm "$smoke_ctr" >/dev/null 2>&1 || true' EXIT
case "$step" in
  lock) cmd_lock ;;
  wheelhouse) cmd_wheelhouse ;;
  bases) cmd_bases ;;
  build) cmd_bases && cmd_build ;;
  smoke) cmd_smoke || { echo "error: the image's smoke test failed (above)" >&2; exit 1; } ;;
  all)
    started=$SECONDS
    cmd_wheelhouse
    t=$SECONDS; cmd_bases; bases_s=$((SECONDS - t))
    t=$SECONDS; cmd_build; build_s=$((SECONDS - t))
    t=$SECONDS
    cmd_smoke || { echo "error: the image's smoke test failed (above)" >&2; exit 1; }
    smoke_s=$((SECONDS - t))
    log "image done in $((SECONDS - started)) s (bases $bases_s s, build $build_s s, smoke $smoke_s s)"
    ;;
  *) sed -n '2,9p' "$0" >&2; exit 2 ;;
esac
