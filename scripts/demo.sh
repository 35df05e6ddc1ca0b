#!/usr/bin/env bash
# The main job end to end on an embedded default:
#   1. its own containerd, local registry and images (scripts/cri-stack.sh), and the project's
#      test apiserver (TLS, seeded with the recorded cluster: node edge-1, two DaemonSet pods,
#      their DaemonSets and revisions);
#   2. edgehub registers the node, syncs the cluster into SQLite and runs the node's pods in
#      containerd;
#   3. the operator rolls the OTA DaemonSet `telemetry` to a new image;
#   4. the link to the cloud goes down; the OTA manager asks edgehub, over OpenYurt's local
#      API, which pods need an upgrade, and triggers one, all offline;
#   5. edgehub upgrades the pod offline, in place, and shows the journal's steps, the new
#      image and the new container's output;
#   6. edgehub restarts with the link still down and serves and runs from its cache;
#   7. the link returns: edgehub reports what the device runs. It deletes the old pod object
#      (a node may), the DaemonSet controller replaces it at the new revision, and the
#      replacement adopts the running container: the cloud shows the new revision, the new
#      image in the status and the upgrade's Events, and nothing restarted.
# Run as root on Debian 12; scripts/setup.sh installs what is missing (the same script
# scripts/test.sh uses). Everything lives under ./.demo and target/cri-stack and is stopped
# on exit; a CRI stack that was already running is left running, with the demo's two pods.
# tests/demo.rs runs this script and checks its key lines.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '\n==> %s\n' "$*"; }

# The packages, the Rust version and the CRI stack's tools, as scripts/test.sh gets them.
bash scripts/setup.sh demo

# EDGEHUB_DEMO_PROFILE=dev builds the debug profile (what the test suite's run of this demo
# uses: it is already built); EDGEHUB_DEMO_DIR moves the work directory.
profile=${EDGEHUB_DEMO_PROFILE:-release}
case "$profile" in
    release) build_flags=(--release) ;;
    dev) build_flags=() ;;
    *) echo "error: EDGEHUB_DEMO_PROFILE is release or dev, not $profile" >&2; exit 2 ;;
esac
bin=${CARGO_TARGET_DIR:-target}/$([ "$profile" = dev ] && echo debug || echo release)
log "building edgehub and the test apiserver ($profile)"
# EDGEHUB_CARGO_FEATURES: the cargo features scripts/test.sh builds with, so the suite's run of
# this demo reuses its build instead of building edgehub again with other features.
cargo build "${build_flags[@]}" --locked --quiet -p edgehub -p edgehub-testsupport \
    --bin edgehub --bin fake-apiserver ${EDGEHUB_CARGO_FEATURES:+--features "$EDGEHUB_CARGO_FEATURES"}

work=$(realpath -m "${EDGEHUB_DEMO_DIR:-.demo}")
[ "$work" != / ] || { echo "error: EDGEHUB_DEMO_DIR is /" >&2; exit 2; }
rm -rf "$work" && mkdir -p "$work"
# A stack that was already running (the test suite's, say) is left running.
stack_was_running=false
bash scripts/cri-stack.sh status && stack_was_running=true
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    $stack_was_running || bash scripts/cri-stack.sh stop >/dev/null 2>&1 || true
}
trap cleanup EXIT
api=127.0.0.1:10267

log "starting containerd, a local registry and test images (scripts/cri-stack.sh)"
cri=$(bash scripts/cri-stack.sh start)
echo "CRI socket: $cri"
# The report waits a random part of reconnect_jitter_secs after the link returns (a fleet
# must not report at once); 2 s keeps the demo short.
printf '[report]\nreconnect_jitter_secs = 2\n' >"$work/config.toml"
EH=("$bin/edgehub" --config "$work/config.toml" --node-name edge-1 --data-dir "$work/data"
    --kubeconfig "$work/kube/kubeconfig" --api-addr "$api" --cri-socket "$cri")
eh() { "${EH[@]}" "$@"; }
run_edgehub() {
    # Another process answering on the port would make this demo talk to it instead.
    if curl -sf "http://$api/v1/healthz" >/dev/null 2>&1; then
        echo "error: something already answers on $api; stop it first" >&2; exit 1
    fi
    # A simple command, not the eh function: $! must be edgehub itself, not a subshell, so
    # that stopping it stops edgehub.
    "${EH[@]}" run >>"$work/edgehub.log" 2>&1 &
    pids+=($!)
    edgehub_pid=$!
    for _ in $(seq 100); do
        # Our process, not another one on the same port, must be the one answering.
        kill -0 "$edgehub_pid" 2>/dev/null || { tail -n 3 "$work/edgehub.log" >&2; echo "error: edgehub exited" >&2; exit 1; }
        curl -sf "http://$api/v1/healthz" >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "edgehub did not come up; see $work/edgehub.log" >&2; exit 1
}

log "starting the test apiserver on 127.0.0.1:16443 (it rolls telemetry after 6 s)"
"$bin/fake-apiserver" --listen 127.0.0.1:16443 --kubeconfig-dir "$work/kube" \
    --roll-telemetry-after 6 >"$work/apiserver.log" 2>&1 &
apiserver_pid=$!
pids+=($apiserver_pid)
for _ in $(seq 100); do [ -f "$work/kube/kubeconfig" ] && break; sleep 0.1; done
head -n 1 "$work/apiserver.log"

log "edgehub run: node registration, list + watch into $work/data/edgehub.db, pods in containerd"
run_edgehub
sleep 2
sqlite3 -column -header "$work/data/edgehub.db" \
    "SELECT kind, namespace, name, resource_version AS rv, revision_hash AS hash, revision FROM objects ORDER BY kind, name;"
log "the pods run in containerd; their logs (edgehub logs, read from the CRI log files):"
for p in telemetry-sv74m gateway-v9hb2; do
    # A container that has not written yet has no log: wait for its first line.
    for _ in $(seq 100); do [ -n "$(eh logs "vehicle/$p" -c app --tail 1 2>/dev/null)" ] && break; sleep 0.1; done
    printf 'vehicle/%s app: %s\n' "$p" "$(eh logs "vehicle/$p" -c app --tail 1)"
done
log "their ConfigMap and service-account token volumes, fetched once and cached for offline starts:"
for f in "$work"/data/pods/*/volumes/configmap/*/* "$work"/data/pods/*/volumes/projected/*/{token,namespace}; do
    [ -f "$f" ] && printf '%s: %s\n' "${f#"$work"/data/pods/}" "$(head -c 60 "$f" | tr '\n' ' ')"
done

log "waiting for the operator to roll the telemetry DaemonSet"
for _ in $(seq 100); do grep -q rolled "$work/apiserver.log" && break; sleep 0.1; done
tail -n 1 "$work/apiserver.log"
sleep 1
eh pods

log "the link to the cloud goes down (the apiserver stops answering)"
kill -USR1 "$apiserver_pid"
for _ in $(seq 100); do grep -q "link cut" "$work/apiserver.log" && break; sleep 0.1; done
sleep 1

log "OTA manager: curl http://$api/pods (PodNeedUpgrade of telemetry-sv74m)"
curl -s "http://$api/pods" | grep -o '{"type":"PodNeedUpgrade"[^}]*}'

log "edgehub logs works offline too (the field engineer's first question)"
eh logs vehicle/telemetry-sv74m -c app --tail 2

log "OTA manager: curl -X POST http://$api/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade"
curl -s -w '  (HTTP %{http_code})\n' -X POST "http://$api/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade"
curl -s -w '  (HTTP %{http_code})\n' -X POST "http://$api/openyurt.io/v1/namespaces/vehicle/pods/gateway-v9hb2/upgrade"

log "the upgrade runs offline, in place; its journal in edgehub's database"
up="http://$api/openyurt.io/v1/namespaces/vehicle/pods/telemetry-sv74m/upgrade"
for _ in $(seq 300); do
    state=$(curl -s "$up" | grep -o '"state":"[A-Za-z]*"' || true)
    case "$state" in *Done*|*RolledBack*|*Failed*) break ;; esac
    sleep 0.2
done
echo "$state"
sqlite3 -column -header "$work/data/edgehub.db" \
    "SELECT r.id AS upgrade, l.state, strftime('%H:%M:%f', l.at_ms / 1000.0, 'unixepoch') AS at, COALESCE(l.detail, '') AS detail
     FROM request_log l JOIN requests r ON r.id = l.request_id WHERE r.kind = 'upgrade' ORDER BY l.request_id, l.seq;"

log "after the upgrade: edgehub pods, the images GET /pods shows, the new container's output"
# The container statuses GET /pods serves, one line per container.
statuses() {
    curl -s "http://$api/pods" | python3 -c '
import json, sys
for p in json.load(sys.stdin)["items"]:
    for c in p["status"].get("containerStatuses", []):
        print(p["metadata"]["name"], c["name"], c["image"], "running" if "running" in c.get("state", {}) else "",
              c.get("containerID", "").split("//")[-1][:12])'
}
# The runtime reports the new container's status a moment after the commit.
for _ in $(seq 50); do
    statuses | grep -q "telemetry-sv74m app 127.0.0.1:5000/busybox:2.0" && break
    sleep 0.2
done
eh pods
statuses
eh logs vehicle/telemetry-sv74m -c app --tail 2
eh status

log "edgehub restarts with the link still down: it serves from its cache at once"
kill -TERM "$edgehub_pid"; wait "$edgehub_pid" || true
run_edgehub
eh pods
eh status
log "the link returns: edgehub reports what the device runs"
kill -USR2 "$apiserver_pid"
# The cluster as an operator sees it, through the test apiserver's admin token.
cloud() {
    curl -s --cacert "$work/kube/ca.crt" -H "Authorization: Bearer $(cat "$work/kube/admin-token")" \
        "https://127.0.0.1:16443/api/v1/namespaces/vehicle/$1"
}
# Telemetry pods in the cloud: name, revision label, and the app container's reported image,
# readiness and container id.
cloud_pods() {
    cloud pods | python3 -c '
import json, sys
for p in json.load(sys.stdin)["items"]:
    if not p["metadata"]["name"].startswith("telemetry-"):
        continue
    app = [c for c in p["status"].get("containerStatuses", []) if c["name"] == "app"]
    app = app[0] if app else {}
    print(p["metadata"]["name"], "revision", p["metadata"]["labels"].get("controller-revision-hash"),
          "app", app.get("image", "-"), "ready" if app.get("ready") else "not-ready",
          app.get("containerID", "").split("//")[-1][:12])'
}
for _ in $(seq 300); do
    cloud_pods | grep -q "revision 55778fbb9f app 127.0.0.1:5000/busybox:2.0 ready" && break
    sleep 0.2
done
grep "DaemonSet controller" "$work/apiserver.log" | tail -n 1
echo "the cloud's telemetry pod (kubectl get pod, as the operator sees it):"
cloud_pods
echo "the Events edgehub delivered:"
cloud events | python3 -c '
import json, sys
for e in json.load(sys.stdin)["items"]:
    if e["reason"].startswith("Upgrade"):
        print(e["involvedObject"]["name"], e["reason"], "count", e.get("count"), "-", e["message"])'
echo "on the device, the same container runs on (same id, not restarted):"
statuses | grep "^telemetry-.* app "
eh status

log "done; logs and database are in $work/"
