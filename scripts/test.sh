#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this). Run as root on Debian 12.
# Every step is idempotent and quiet when its tool is already present.
#   1. format and lints, and a build with no protoc anywhere;
#   2. unit and integration tests (native), the demo's run among them (tests/demo.rs);
#   3. static musl release builds for aarch64 and x86_64, with a size report;
#   4. the aarch64 binary and tests under qemu.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

log() { printf '==> %s\n' "$*"; }

# The packages, the Rust toolchain's version and components: the same script the demo uses.
bash scripts/setup.sh test

results=$(mktemp)
no_protoc=$(mktemp -d)
# The CRI integration tests start an isolated containerd (scripts/cri-stack.sh); stop it at the
# end, unless it was already running before (a developer's, say).
stack_was_running=false
bash scripts/cri-stack.sh status && stack_was_running=true
trap 'rm -rf "$results" "$no_protoc" target/no-protoc; $stack_was_running || bash scripts/cri-stack.sh stop >/dev/null 2>&1 || true' EXIT
log "CRI test stack (containerd, runc, local registry, test images)"
bash scripts/cri-stack.sh start >/dev/null

log "cargo fmt --check"
cargo fmt --all --check
log "cargo clippy"
cargo clippy --workspace --all-targets --locked --quiet -- -D warnings
# Rust alone builds edgehub: a scratch target dir, PROTOC pointing nowhere, and a `protoc` on
# PATH that fails the build if anything runs it.
log "cargo build with no protoc (scratch target dir)"
printf '#!/bin/sh\necho "protoc must not be needed to build edgehub" >&2\nexit 1\n' >"$no_protoc/protoc"
chmod +x "$no_protoc/protoc"
PROTOC=/nonexistent/protoc PATH="$no_protoc:$PATH" \
    cargo build --locked --quiet -p edgehub --bin edgehub --target-dir target/no-protoc
rm -rf target/no-protoc
log "cargo test"
cargo test --workspace --locked 2>&1 | tee -a "$results"
log "static musl builds"
bash cross/build.sh
log "aarch64 under qemu"
bash cross/qemu-check.sh 2>&1 | tee -a "$results"

# One closing line for the whole run (cargo and libtest print one per test binary).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$results"
