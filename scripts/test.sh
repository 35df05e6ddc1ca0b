#!/usr/bin/env bash
# The whole test suite, exactly as CI runs it (.ci/run calls this). Run as root on Debian 12.
# Every step is idempotent and quiet when its tool is already present.
#   1. format and lints (the device code and the cloud-side controller);
#   2. unit and integration tests (native, with the `controller` feature, so the controller's
#      tests run too), the demo's run among them (tests/demo.rs);
#   3. static musl release builds for aarch64 and x86_64, with a size report;
#   4. the aarch64 binary and tests under qemu.
# Steps 3 and 4 build in the background, at the lowest CPU priority, while step 2 runs: the
# native tests mostly wait on containerd and timers, and two cores have room for a compiler.
#
# Rust alone builds edgehub: every cargo command here runs with PROTOC pointing nowhere and a
# `protoc` first on PATH that fails whatever runs it. On CI's clean clone the target dir is
# empty, so every crate's build script runs under that; elsewhere, any change that brought
# protoc back would rebuild the crate it touched, and fail.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never

log() { printf '==> %s\n' "$*"; }

# The packages, the Rust toolchain's version and components: the same script the demo uses.
bash scripts/setup.sh test

results=$(mktemp)
no_protoc=$(mktemp -d)
background=$(mktemp)
bg=
# The CRI integration tests start an isolated containerd (scripts/cri-stack.sh); stop it at the
# end, unless it was already running before (a developer's, say).
stack_was_running=false
bash scripts/cri-stack.sh status && stack_was_running=true
cleanup() {
    [ -z "$bg" ] || kill -- -"$bg" 2>/dev/null || kill "$bg" 2>/dev/null || true
    rm -rf "$results" "$no_protoc" "$background"
    $stack_was_running || bash scripts/cri-stack.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
log "CRI test stack (containerd, runc, local registry, test images)"
bash scripts/cri-stack.sh start >/dev/null

printf '#!/bin/sh\necho "protoc must not be needed to build edgehub" >&2\nexit 1\n' >"$no_protoc/protoc"
chmod +x "$no_protoc/protoc"
export PROTOC=/nonexistent/protoc PATH="$no_protoc:$PATH"
# The demo's build (tests/demo.rs) and qemu-check's use the same features, so they reuse
# this build instead of making another.
export EDGEHUB_CARGO_FEATURES=edgehub/controller

log "cargo fmt --check"
cargo fmt --all --check
log "cargo clippy (no protoc)"
cargo clippy --workspace --all-targets --features "$EDGEHUB_CARGO_FEATURES" --locked --quiet -- -D warnings

log "static musl builds and the aarch64 tests: building in the background"
# Its own process group, so cleanup can stop the whole of it.
set -m
nice -n 19 bash -c 'bash cross/build.sh && bash cross/qemu-check.sh build' >"$background" 2>&1 &
bg=$!
set +m

log "cargo test (no protoc)"
cargo test --workspace --features "$EDGEHUB_CARGO_FEATURES" --locked 2>&1 | tee -a "$results"

log "static musl builds (waiting for the background build)"
bg_status=0
wait "$bg" || bg_status=$?
bg=
cat "$background"
[ "$bg_status" = 0 ] || { echo "error: the musl builds or the aarch64 test build failed" >&2; exit "$bg_status"; }
log "aarch64 under qemu"
bash cross/qemu-check.sh run 2>&1 | tee -a "$results"

# One closing line for the whole run (cargo and libtest print one per test binary).
awk '/^test result:/ { p += $4; f += $6 } END { printf "tests: %d passed, %d failed\n", p, f }' "$results"
