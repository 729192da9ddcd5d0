#!/usr/bin/env bash
# An emulated SL2610-like board: run a command on aarch64 Linux under qemu-user on an x86-64 host.
#
# Usage:
#   sudo tools/aarch64/run.sh gemma-export generate --model DIR --prompt "The capital of France is"
#   sudo tools/aarch64/run.sh gemma-export bench --model DIR --board sl2610
#   sudo tools/aarch64/run.sh python -c "import platform; print(platform.machine())"
#   sudo tools/aarch64/run.sh shell                 # an interactive shell on the emulated board
#
# The first run builds, once, an arm64 Debian root filesystem (debootstrap) with Python and a venv
# holding the aarch64 wheels of the toolkit's runtime dependencies (from PyPI); later runs reuse it.
# Each run bind-mounts this checkout, the current directory and /tmp at the same paths inside, so
# host paths work unchanged, and runs the checkout's code (PYTHONPATH) with the venv's Python.
#
# Needs: root (chroot, mounts), qemu-user-static, debootstrap, and binfmt_misc (the script registers
# qemu-aarch64 when binfmt-support is installed):  apt-get install qemu-user-static debootstrap binfmt-support
#
# The emulated CPU (QEMU_CPU) is qemu's "max" by default: every extension, so onnxruntime takes its
# dotprod/i8mm int8 kernels. The board's Cortex-A55 has dotprod but no i8mm, and qemu 7.2 has no A55
# model (its cortex-a76, the closest, crashes Debian's Python); GX_AARCH64_CPU=cortex-a72 (ARMv8.0,
# no dotprod) exercises the plain NEON kernels instead. Run both to bracket the board.
#
# Environment: GX_AARCH64_ROOTFS (default ~/.cache/gemma-export/aarch64-rootfs),
#   GX_AARCH64_CPU (qemu CPU model, default max; cortex-a72 for the no-dotprod kernels),
#   GX_AARCH64_SUITE (Debian suite, default trixie), GX_AARCH64_MIRROR (default deb.debian.org),
#   GX_AARCH64_BIND (extra host folders to bind, colon-separated).
set -euo pipefail
if [ $# -eq 0 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"   # the comment above
  [ $# -eq 0 ] && exit 2 || exit 0
fi

ROOTFS=${GX_AARCH64_ROOTFS:-$HOME/.cache/gemma-export/aarch64-rootfs}
SUITE=${GX_AARCH64_SUITE:-trixie}
MIRROR=${GX_AARCH64_MIRROR:-http://deb.debian.org/debian}
PROJECT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=/opt/gx
CPU=${GX_AARCH64_CPU:-max}

die() { echo "error: $*" >&2; exit 2; }
say() { echo "[aarch64] $*" >&2; }

[ $# -ge 1 ] || die "no command given; e.g. tools/aarch64/run.sh gemma-export --help"
[ "$(id -u)" = 0 ] || die "tools/aarch64/run.sh needs root (chroot and bind mounts); run it with sudo"
# Each run gets its own mount namespace: its bind mounts are private and vanish with it, so runs
# side by side cannot unmount each other's folders.
if [ -z "${GX_AARCH64_NS:-}" ] && command -v unshare >/dev/null; then
  GX_AARCH64_NS=1 exec unshare --mount --propagation private "$0" "$@"
fi
[ "$(uname -m)" = x86_64 ] || [ "$(uname -m)" = aarch64 ] || die "host $(uname -m): expected x86_64 (or aarch64)"
if [ "$(uname -m)" = x86_64 ]; then
  command -v qemu-aarch64-static >/dev/null || die "qemu-aarch64-static not found; install it: apt-get install qemu-user-static binfmt-support"
  if [ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]; then
    [ -e /proc/sys/fs/binfmt_misc/register ] || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc 2>/dev/null || true
    command -v update-binfmts >/dev/null && update-binfmts --enable qemu-aarch64 >/dev/null 2>&1 || true
    [ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || die "binfmt_misc has no qemu-aarch64 entry and registering it failed; install binfmt-support or run: update-binfmts --enable qemu-aarch64"
  fi
fi

MOUNTS=()
CPUINFO=  # this run's own fake /proc/cpuinfo (system_mounts)
cleanup() {
  local i
  for ((i = ${#MOUNTS[@]} - 1; i >= 0; i--)); do umount -l "${MOUNTS[i]}" 2>/dev/null || true; done
  [ -z "$CPUINFO" ] || rm -f "$CPUINFO"
}
trap cleanup EXIT INT TERM

bind() {  # bind host folder $1 at the same path inside the root filesystem
  local src=$1 dst="$ROOTFS$1"
  [ -d "$src" ] || return 0
  mountpoint -q "$dst" 2>/dev/null && return 0
  mkdir -p "$dst"
  mount --bind "$src" "$dst"
  MOUNTS+=("$dst")
}

# qemu 7.2 passes the host's (x86) /proc/cpuinfo through, and onnxruntime's cpuinfo library crashes
# parsing it; inside the root filesystem it reads this one instead: the board's two Cortex-A55 cores,
# or two Cortex-A72 cores (no fp16 arithmetic, no dotprod) for QEMU_CPU cortex-a72. onnxruntime picks
# its kernels from these features, so they must not claim more than the emulated CPU has: A55
# features on a cortex-a72 made it run dotprod instructions and die of SIGILL.
fake_cpuinfo() {
  local n features part variant
  if [ "$CPU" = cortex-a72 ]; then
    features="fp asimd evtstrm aes pmull sha1 sha2 crc32 cpuid" part=0xd08 variant=0x0
  else
    features="fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
    part=0xd05 variant=0x2
  fi
  for n in 0 1; do
    printf 'processor\t: %s\nBogoMIPS\t: 48.00\nFeatures\t: %s\n' "$n" "$features"
    printf 'CPU implementer\t: 0x41\nCPU architecture: 8\nCPU variant\t: %s\nCPU part\t: %s\nCPU revision\t: 0\n\n' "$variant" "$part"
  done
}

system_mounts() {
  mountpoint -q "$ROOTFS/proc" || { mount -t proc proc "$ROOTFS/proc"; MOUNTS+=("$ROOTFS/proc"); }
  if [ "$(uname -m)" = x86_64 ] && [ -z "$CPUINFO" ]; then
    # a file per run, not one shared path: a run started beside this one, emulating another CPU,
    # would rewrite the features this run's processes read (an A72 run then got the A55's dotprod
    # and died of SIGILL)
    CPUINFO=$(mktemp "$ROOTFS/etc/gx-cpuinfo.XXXXXX")
    fake_cpuinfo > "$CPUINFO"
    chmod 644 "$CPUINFO"
    mount --bind "$CPUINFO" "$ROOTFS/proc/cpuinfo"
    MOUNTS+=("$ROOTFS/proc/cpuinfo")
  fi
  bind /dev
  bind /sys
  cp -L /etc/resolv.conf "$ROOTFS/etc/resolv.conf" 2>/dev/null || true
}

# Runtime dependencies of the toolkit, read from pyproject.toml (the host's Python parses it).
runtime_deps() {
  python3 - "$PROJECT/pyproject.toml" <<'EOF'
import sys, tomllib
print(" ".join(tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]))
EOF
}

build_rootfs() {
  command -v debootstrap >/dev/null || die "debootstrap not found; install it: apt-get install debootstrap"
  if [ ! -e "$ROOTFS/.gx-debootstrap-done" ]; then
    if [ -d "$ROOTFS" ] && [ -n "$(ls -A "$ROOTFS" 2>/dev/null)" ]; then
      [ -e "$ROOTFS/debootstrap" ] || die "$ROOTFS exists, is not empty and is not a half-built root filesystem; remove it or set GX_AARCH64_ROOTFS"
      grep -q " $ROOTFS/" /proc/mounts && die "$ROOTFS has mounts inside (an interrupted run?); unmount them first"
    fi
    say "building an arm64 Debian $SUITE root filesystem in $ROOTFS (once; 15-25 min)"
    rm -rf "$ROOTFS"
    mkdir -p "$(dirname "$ROOTFS")"
    debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates \
      "$SUITE" "$ROOTFS" "$MIRROR" >&2 || die "debootstrap of $SUITE from $MIRROR failed (see above)"
    touch "$ROOTFS/.gx-debootstrap-done"
  fi
  local deps
  deps=$(runtime_deps)
  if [ ! -e "$ROOTFS/.gx-ready" ] || [ "$(cat "$ROOTFS/.gx-ready")" != "$deps" ]; then
    say "installing the aarch64 wheels of: $deps"
    system_mounts
    # The host's CA bundle (it may hold a proxy's CA) and proxy settings, for pip inside.
    local ca=${PIP_CERT:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
    [ -f "$ca" ] && cp -L "$ca" "$ROOTFS/etc/ssl/certs/gx-host-ca.crt"
    # shellcheck disable=SC2086
    chroot "$ROOTFS" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root \
      ${HTTPS_PROXY:+HTTPS_PROXY=$HTTPS_PROXY} ${HTTP_PROXY:+HTTP_PROXY=$HTTP_PROXY} ${NO_PROXY:+NO_PROXY=$NO_PROXY} \
      ${https_proxy:+https_proxy=$https_proxy} ${http_proxy:+http_proxy=$http_proxy} ${no_proxy:+no_proxy=$no_proxy} \
      $( [ -f "$ROOTFS/etc/ssl/certs/gx-host-ca.crt" ] && echo PIP_CERT=/etc/ssl/certs/gx-host-ca.crt ) \
      /bin/sh -c "[ -x $VENV/bin/pip ] || python3 -m venv $VENV; $VENV/bin/pip install -q --no-compile --disable-pip-version-check --only-binary=:all: $(set -f; printf '%q ' $deps)" \
      || die "pip install of the runtime dependencies failed inside $ROOTFS (see above)"
    printf '#!/bin/sh\nexec %s/bin/python -m gemma_export.cli "$@"\n' "$VENV" > "$ROOTFS$VENV/bin/gemma-export"
    chmod +x "$ROOTFS$VENV/bin/gemma-export"
    echo "$deps" > "$ROOTFS/.gx-ready"
  fi
}

build_rootfs
system_mounts
bind "$PROJECT"
bind "$PWD"
bind /tmp
IFS=: read -r -a extra <<< "${GX_AARCH64_BIND:-}"
for d in "${extra[@]}"; do [ -n "$d" ] && bind "$(cd "$d" && pwd)"; done

if [ "$1" = shell ]; then set -- /bin/bash; fi
# pip inside (e.g. a bundle's install line) trusts what the host's pip trusts (a proxy's CA, if any)
CERT=()
[ -f "$ROOTFS/etc/ssl/certs/gx-host-ca.crt" ] && CERT=(PIP_CERT=/etc/ssl/certs/gx-host-ca.crt)
for v in HTTPS_PROXY HTTP_PROXY NO_PROXY https_proxy http_proxy no_proxy; do
  [ -n "${!v:-}" ] && CERT+=("$v=${!v}")
done
chroot "$ROOTFS" /usr/bin/env -i HOME=/root LANG=C.UTF-8 PATH="$VENV/bin:/usr/bin:/bin" QEMU_CPU="$CPU" OPENBLAS_CORETYPE=ARMV8 "${CERT[@]}" \
  PYTHONPATH="$PROJECT" /bin/sh -c 'cd "$0" && exec "$@"' "$PWD" "$@"
