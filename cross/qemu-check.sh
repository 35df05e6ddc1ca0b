#!/usr/bin/env bash
# Runs the static aarch64 binary under qemu-aarch64-static (Debian's qemu-user-static):
#   1. `edgehub version`;
#   2. `edgehub check-config` on the shipped default config (yocto layer), with a kubeconfig
#      for the project's test apiserver;
#   3. a short `edgehub run` on a fresh database: /v1/healthz answers and the cache fills;
#   4. the library's unit tests and the integration tests that do not spawn the binary,
#      built for aarch64 musl and run under qemu.
# Expects cross/build.sh to have built the aarch64 binary. Installs what is missing.
#
#   bash cross/qemu-check.sh         # build the aarch64 tests, then all of the above
#   bash cross/qemu-check.sh build   # only build the aarch64 test binaries (no qemu needed)
#   bash cross/qemu-check.sh run     # only run; the test binaries must be built
#
# The aarch64 tests build in their own target dir (target/qemu; QEMU_TARGET_DIR moves it):
# scripts/test.sh builds them in the background while the native tests run, and cargo locks
# a target dir's host profile for as long as `cargo test` runs.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '==> %s\n' "$*"; }
t=aarch64-unknown-linux-musl
# Cargo puts its output under CARGO_TARGET_DIR when that is set, not under target/.
td=${CARGO_TARGET_DIR:-target}
bin=$td/$t/release/edgehub
qemu=qemu-aarch64-static
phase=${1:-all}
case "$phase" in all | build | run) ;; *) echo "usage: $0 [all|build|run]" >&2; exit 2 ;; esac
tdir=${QEMU_TARGET_DIR:-target/qemu}
list=$tdir/qemu-tests.txt

# The test binaries built for aarch64, except those that spawn the edgehub binary (any whose
# source or #[path] module names CARGO_BIN_EXE_, found by cargo-executables.py, and
# tests/demo.rs, which spawns it through the demo script): an aarch64 child process needs
# binfmt_misc, which these machines do not register. Their paths go to $list for the run phase.
build_tests() {
    log "building the aarch64 tests"
    mkdir -p "$tdir"
    cargo zigbuild --locked --quiet -p edgehub --target "$t" --tests --target-dir "$tdir" \
        --message-format=json 2>"$tdir/build.log" |
        python3 scripts/cargo-executables.py --test --exclude demo --exclude-spawning \
            >"$list.tmp" || { cat "$tdir/build.log" >&2; echo "error: the aarch64 tests did not build" >&2; exit 1; }
    [ -s "$list.tmp" ] || { cat "$tdir/build.log" >&2; echo "error: no aarch64 test binaries were built" >&2; exit 1; }
    mv "$list.tmp" "$list"
}

if [ "$phase" != run ]; then
    build_tests
fi
[ "$phase" = build ] && exit 0

need=()
for p in qemu-user-static curl python3; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x "$bin" ] || { echo "error: $bin missing; run cross/build.sh first" >&2; exit 1; }
[ -s "$list" ] || { echo "error: $list missing; run \`bash cross/qemu-check.sh build\` first" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

log "qemu: edgehub version"
$qemu "$bin" version

log "test apiserver (native) for a kubeconfig"
# The demo's build command, features and all, so what the suite built is reused.
cargo build --locked --quiet -p edgehub -p edgehub-testsupport --bin edgehub --bin fake-apiserver \
    ${EDGEHUB_CARGO_FEATURES:+--features "$EDGEHUB_CARGO_FEATURES"}
apiport=$(free_port)
"$td"/debug/fake-apiserver --listen "127.0.0.1:$apiport" --kubeconfig-dir "$work/kube" >"$work/apiserver.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -f "$work/kube/kubeconfig" ] && break; sleep 0.1; done

config=yocto/meta-edgehub/recipes-core/edgehub/files/config.toml
common=(--config "$config" --node-name edge-1 --kubeconfig "$work/kube/kubeconfig")
log "qemu: edgehub check-config on the shipped default config"
$qemu "$bin" "${common[@]}" check-config

log "qemu: edgehub run on a fresh database"
port=$(free_port)
$qemu "$bin" "${common[@]}" --data-dir "$work/data" --api-addr "127.0.0.1:$port" run >"$work/edgehub.log" 2>&1 &
pid=$!
pids+=($pid)
ok=
for _ in $(seq 200); do
    if [ "$(curl -sf "http://127.0.0.1:$port/v1/healthz" 2>/dev/null)" = ok ] &&
        curl -sf "http://127.0.0.1:$port/pods" | grep -q telemetry-sv74m; then
        ok=1; break
    fi
    sleep 0.1
done
[ -n "$ok" ] || { cat "$work/edgehub.log" >&2; echo "error: edgehub under qemu did not serve /v1/healthz and the cached pods" >&2; exit 1; }
echo "healthz ok; /pods serves the synced pods"
kill -TERM "$pid"; wait "$pid"
echo "clean shutdown"

log "aarch64 tests under qemu"
while read -r exe; do
    log "qemu: $(basename "$exe")"
    $qemu "$exe" --quiet
done <"$list"
