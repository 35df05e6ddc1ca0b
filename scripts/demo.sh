#!/usr/bin/env bash
# The main job end to end on an embedded default: the project's test apiserver (seeded with
# the recorded cluster: node edge-1, two DaemonSet pods, their DaemonSets and revisions), then
# edgehub syncing it into SQLite, a change in the cloud, and a restart that resumes the watch.
# Run as root on Debian 12. Everything lives under ./.demo and is stopped on exit.
#
# Container runtime steps (containerd, registry, images) join this script with the pod
# runtime; today it stops at the cache.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\n==> %s\n' "$*"; }

need=()
for p in sqlite3 curl gcc libc6-dev; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || need+=("$p")
done
if ((${#need[@]})); then
    log "installing ${need[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v cargo >/dev/null || { echo "error: cargo not found; install Rust >= 1.89 with rustup" >&2; exit 1; }

log "building edgehub and the test apiserver (release)"
cargo build --release --locked --quiet --bin edgehub -p edgehub
cargo build --release --locked --quiet --bin fake-apiserver -p edgehub-testsupport

work=.demo
rm -rf "$work" && mkdir -p "$work"
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT

log "starting the test apiserver on 127.0.0.1:16443"
target/release/fake-apiserver --listen 127.0.0.1:16443 --kubeconfig-dir "$work/kube" >"$work/apiserver.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do [ -f "$work/kube/kubeconfig" ] && break; sleep 0.1; done
cat "$work/apiserver.log"

run_edgehub() {
    target/release/edgehub --node-name edge-1 --data-dir "$PWD/$work/data" \
        --kubeconfig "$PWD/$work/kube/kubeconfig" run >>"$work/edgehub.log" 2>&1 &
    pids+=($!)
    edgehub_pid=$!
}
show_cache() {
    sqlite3 -column -header "$work/data/edgehub.db" \
        "SELECT kind, namespace, name, resource_version AS rv, revision_hash AS hash, revision FROM objects ORDER BY kind, name;"
}

log "edgehub run: list + watch into $work/data/edgehub.db"
run_edgehub
for _ in $(seq 100); do grep -q 'resource=pods.*listed' "$work/edgehub.log" 2>/dev/null && break; sleep 0.1; done
sleep 0.5
show_cache

log "the operator deletes pod vehicle/gateway-v9hb2 in the cloud"
curl -sS --cacert "$work/kube/ca.crt" -H 'Authorization: Bearer admin-token' -X DELETE \
    -H 'Content-Type: application/json' -d '{"gracePeriodSeconds":0}' \
    https://127.0.0.1:16443/api/v1/namespaces/vehicle/pods/gateway-v9hb2 -o /dev/null -w 'HTTP %{http_code}\n'
sleep 1
show_cache

log "SIGTERM edgehub, start it again: it resumes the watch from the stored resourceVersion"
kill -TERM "$edgehub_pid"; wait "$edgehub_pid" || true
run_edgehub
sleep 1
grep -E 'resuming watch|listed' "$work/edgehub.log" | sed 's/^.*Z //' | tail -n 8
log "done; logs and database are in $work/"
