#!/usr/bin/env bash
# What the demo, the test suite and the CRI test stack need on Debian 12, in one place, so
# scripts/demo.sh and scripts/test.sh cannot drift apart. Run as root. Idempotent: when
# everything is there it installs nothing, runs no apt-get update and prints nothing.
#
#   bash scripts/setup.sh demo   # build edgehub, run it against the CRI stack (scripts/demo.sh)
#   bash scripts/setup.sh test   # all of demo, plus lints, musl cross builds, qemu (scripts/test.sh)
#   bash scripts/setup.sh cri    # only the CRI stack: containerd, runc, registry (scripts/cri-stack.sh)
#
# Rust itself comes from rustup (Debian 12's cargo is too old); this checks its version and,
# for `test`, adds the rustfmt and clippy components. No protoc: the CRI client is generated
# by a proto compiler written in Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-demo}
rust_min=1.89
log() { printf '==> %s\n' "$*" >&2; }

# The CRI stack: containerd and runc, a registry with locally built busybox images (skopeo
# pushes them), CNI plugins for pod networking, python3 for the registry's htpasswd.
cri=(containerd runc docker-registry skopeo busybox-static containernetworking-plugins iptables iproute2 curl python3)
# Building and running edgehub: a C compiler for the bundled SQLite; sqlite3 and curl for the
# demo's look into the cache and its OpenYurt-style calls.
demo=(gcc libc6-dev sqlite3 curl)
# The suite: `file` checks the musl binaries, systemd-analyze the unit, qemu runs aarch64,
# pip installs zig for cargo-zigbuild, libfaketime moves edgehub's wall clock (the clock-jump
# tests), chromium drives a hostile web page against the local API (tests/api.rs); the OTA
# managers the integrations are tested with (tests/mender.rs, tests/swupdate.rs): Mender's
# client and artifact tool, SWUpdate, cpio and openssl to build and sign a .swu, shellcheck for
# the integrations' POSIX sh.
test=(file systemd qemu-user-static python3-pip faketime chromium
    mender-client mender-artifact swupdate cpio openssl shellcheck)

case "$what" in
    cri) packages=("${cri[@]}") ;;
    demo) packages=("${cri[@]}" "${demo[@]}") ;;
    test) packages=("${cri[@]}" "${demo[@]}" "${test[@]}") ;;
    *) echo "usage: $0 demo|test|cri" >&2; exit 2 ;;
esac

if [ "$(id -u)" != 0 ]; then
    echo "error: run as root (apt-get, and containerd for the demo and the tests)" >&2
    exit 1
fi

missing=()
for p in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A python3 with pip from outside Debian's packages (pyenv, say) serves as well.
if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
    kept=()
    for p in "${missing[@]}"; do
        case "$p" in python3 | python3-pip) ;; *) kept+=("$p") ;; esac
    done
    missing=("${kept[@]}")
fi
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

[ "$what" = cri ] && exit 0

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        echo "error: cargo is installed but not on PATH; run \`. \"\$HOME/.cargo/env\"\` and rerun" >&2
    else
        echo "error: cargo not found. Install a Rust toolchain >= $rust_min with rustup, then rerun." >&2
    fi
    exit 1
fi
have=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n%s\n' "$rust_min" "$have" | sort -V | head -n 1)" != "$rust_min" ]; then
    echo "error: rustc $have is older than $rust_min; run \`rustup update\`" >&2
    exit 1
fi
if [ "$what" = test ] && command -v rustup >/dev/null 2>&1; then
    for c in rustfmt clippy; do
        rustup component list --installed 2>/dev/null | grep -q "^$c" || { log "adding rustup component $c"; rustup component add "$c" >/dev/null; }
    done
fi

# tests/kubectl.rs runs Debian 12's kubectl (1.20, from kubernetes-client) against the fake
# apiserver. /usr/bin/kubectl may belong to another package on a machine, so the package is
# unpacked into the repo's target/, never installed system-wide.
if [ "$what" = test ]; then
    tools=target/tools/kubernetes-client
    if [ ! -x "$tools/usr/bin/kubectl" ]; then
        log "unpacking kubernetes-client into $tools"
        tmp=$(mktemp -d)
        if ! (cd "$tmp" && apt-get download -qq kubernetes-client >/dev/null 2>&1); then
            apt-get update -qq
            (cd "$tmp" && apt-get download -qq kubernetes-client >/dev/null)
        fi
        mkdir -p "$tools"
        dpkg-deb -x "$tmp"/kubernetes-client_*.deb "$tools"
        rm -rf "$tmp"
    fi
fi
