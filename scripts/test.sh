#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this). Run as root on Debian 12.
# Every step is idempotent and quiet when its tool is already present.
#   1. format and lints;
#   2. unit and integration tests (native);
#   3. static musl release builds for aarch64 and x86_64, with a size report;
#   4. the aarch64 binary and tests under qemu.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

log() { printf '==> %s\n' "$*"; }

# Debian packages the build and the tests need.
apt_packages=(gcc libc6-dev curl file systemd qemu-user-static protobuf-compiler python3 python3-pip)
missing=()
for p in "${apt_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# A python3 and pip outside Debian's packages (pyenv, say) serve as well.
if command -v python3 >/dev/null 2>&1 && python3 -m pip --version >/dev/null 2>&1; then
    missing=("${missing[@]/python3-pip}")
    missing=("${missing[@]/python3}")
fi
missing=($(printf '%s\n' "${missing[@]}" | grep -v '^$' || true))
if ((${#missing[@]})); then
    log "installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# Rust: Debian 12's packaged cargo is too old for this crate; rustup's toolchain is expected.
if ! command -v cargo >/dev/null 2>&1; then
    echo "error: cargo not found. Install a Rust toolchain >= 1.89 with rustup, then rerun." >&2
    exit 1
fi
if command -v rustup >/dev/null 2>&1; then
    for c in rustfmt clippy; do
        rustup component list --installed 2>/dev/null | grep -q "^$c" || { log "adding rustup component $c"; rustup component add "$c" >/dev/null; }
    done
fi

results=$(mktemp)
# The CRI integration tests start an isolated containerd (scripts/cri-stack.sh); stop it at the end.
trap 'rm -f "$results"; bash scripts/cri-stack.sh stop >/dev/null 2>&1 || true' EXIT
log "CRI test stack (containerd, runc, local registry, test images)"
bash scripts/cri-stack.sh start >/dev/null

log "cargo fmt --check"
cargo fmt --all --check
log "cargo clippy"
cargo clippy --workspace --all-targets --locked --quiet -- -D warnings
log "cargo test"
cargo test --workspace --locked 2>&1 | tee -a "$results"
log "static musl builds"
bash cross/build.sh
log "aarch64 under qemu"
bash cross/qemu-check.sh 2>&1 | tee -a "$results"

# One closing line for the whole run (cargo and libtest print one per test binary).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$results"
