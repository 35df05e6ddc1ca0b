#!/usr/bin/env bash
# Runs the static aarch64 binary under qemu-aarch64-static (Debian's qemu-user-static):
#   1. `edgehub version`;
#   2. `edgehub check-config` on the shipped default config (yocto layer), with a kubeconfig
#      for the project's test apiserver;
#   3. a short `edgehub run` on a fresh database: /v1/healthz answers and the cache fills;
#   4. the library's unit tests and the integration tests that do not spawn the binary,
#      built for aarch64 musl and run under qemu.
# Expects cross/build.sh to have built the aarch64 binary. Installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '==> %s\n' "$*"; }
t=aarch64-unknown-linux-musl
bin=target/$t/release/edgehub
qemu=qemu-aarch64-static

need=()
for p in qemu-user-static curl python3; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
[ -x "$bin" ] || { echo "error: $bin missing; run cross/build.sh first" >&2; exit 1; }

work=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

log "qemu: edgehub version"
$qemu "$bin" version

log "test apiserver (native) for a kubeconfig"
cargo build --locked --quiet -p edgehub-testsupport --bin fake-apiserver
apiport=$(free_port)
target/debug/fake-apiserver --listen "127.0.0.1:$apiport" --kubeconfig-dir "$work/kube" >"$work/apiserver.log" 2>&1 &
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
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_MUSL_RUNNER=$qemu
# The library's unit tests and the integration tests, except those that spawn the edgehub
# binary (tests/cli.rs, tests/yocto.rs, tests/logs.rs, tests/upgrade.rs, tests/report.rs, and
# tests/demo.rs through the demo): an aarch64 child process needs binfmt_misc, which these
# machines do not register.
cargo zigbuild --locked --quiet -p edgehub --target "$t" --tests --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    if m["target"]["kind"] == ["bin"] or m["target"]["name"] in ("cli", "yocto", "logs", "demo", "upgrade", "report"):
        continue
    print(m["executable"])
' >"$work/tests"
[ -s "$work/tests" ] || { echo "error: no aarch64 test binaries were built" >&2; exit 1; }
while read -r exe; do
    log "qemu: $(basename "$exe")"
    $qemu "$exe" --quiet
done <"$work/tests"
