#!/usr/bin/env bash
# A real, isolated CRI stack for the integration tests and the demo: containerd (with runc)
# under its own root/state/sockets, a plain-http docker-registry on 127.0.0.1:5000, and
# locally built images pushed to it:
#   127.0.0.1:5000/busybox:1.0 and :2.0   print "hello from 1.0" / "hello from 2.0" every second
#   127.0.0.1:5000/busybox:3.0-crash      prints once and exits 3 (rollback tests)
#   127.0.0.1:5000/web:1.0 and :2.0       as busybox 1.0 / 2.0 ("hello from 2.0 (web)"), and
#                                         serve HTTP on port 8080 (httpGet probes, pod network)
#   127.0.0.1:5000/pause:1.0              the sandbox image
#   127.0.0.1:5001/private/busybox:1.0    behind a password (imagePullSecrets tests)
# Pods without hostNetwork get an address on the bridge eh-test0 (10.88.42.0/24) through CNI.
# Everything lives under $EDGEHUB_STACK_DIR (default target/cri-stack in the repo).
#
#   scripts/cri-stack.sh start    # idempotent; prints the CRI socket path last
#   scripts/cri-stack.sh stop     # stops containers, containerd and the registry by PID
#   scripts/cri-stack.sh socket   # prints the CRI socket path
#   scripts/cri-stack.sh status   # exit 0 when this stack's containerd is running
#
# Needs root (containerd, runc). Facts this follows: ../shared/notes/cri-stack.md.
set -euo pipefail
cd "$(dirname "$0")/.."
D=${EDGEHUB_STACK_DIR:-$PWD/target/cri-stack}
SOCK=$D/containerd.sock
REG=127.0.0.1:5000
AUTH_REG=127.0.0.1:5001
BRIDGE=eh-test0
POD_SUBNET=10.88.42.0/24
log() { printf '==> %s\n' "$*" >&2; }

need_root() {
    if [ "$(id -u)" != 0 ]; then
        echo "error: the CRI stack needs root (containerd and runc); run as root" >&2
        exit 1
    fi
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

sha() { sha256sum "$1" | cut -d' ' -f1; }

# mk_image REPO TAG CMD_JSON [WWW]: an OCI layout of busybox-static with CMD, pushed to the
# registry; with WWW, /www/index.html holds that text (for busybox httpd).
mk_image() {
    local repo=$1 tag=$2 cmd=$3 www=${4:-} w arch
    w=$D/images/$repo-$tag
    arch=$(dpkg --print-architecture)
    rm -rf "$w" && mkdir -p "$w/rootfs/bin" "$w/oci/blobs/sha256"
    cp /bin/busybox "$w/rootfs/bin/busybox"
    for a in sh echo sleep true false cat ls ps date env hostname id; do ln -s busybox "$w/rootfs/bin/$a"; done
    if [ -n "$www" ]; then
        ln -s busybox "$w/rootfs/bin/httpd"
        mkdir -p "$w/rootfs/www" && printf '%s\n' "$www" >"$w/rootfs/www/index.html"
    fi
    mkdir -p "$w/rootfs/tmp" "$w/rootfs/etc" "$w/rootfs/proc" "$w/rootfs/sys" "$w/rootfs/dev"
    tar -C "$w/rootfs" --sort=name --mtime=@0 --numeric-owner --owner=0 --group=0 -cf "$w/layer.tar" .
    gzip -n -c "$w/layer.tar" >"$w/layer.tar.gz"
    local diff_id layer lsize config csize manifest msize
    diff_id=$(sha "$w/layer.tar")
    layer=$(sha "$w/layer.tar.gz"); lsize=$(stat -c %s "$w/layer.tar.gz")
    cp "$w/layer.tar.gz" "$w/oci/blobs/sha256/$layer"
    printf '{"architecture":"%s","os":"linux","config":{"Env":["PATH=/bin"],"Cmd":%s},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]}}' \
        "$arch" "$cmd" "$diff_id" >"$w/config.json"
    config=$(sha "$w/config.json"); csize=$(stat -c %s "$w/config.json")
    cp "$w/config.json" "$w/oci/blobs/sha256/$config"
    printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%d},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%d}]}' \
        "$config" "$csize" "$layer" "$lsize" >"$w/manifest.json"
    manifest=$(sha "$w/manifest.json"); msize=$(stat -c %s "$w/manifest.json")
    cp "$w/manifest.json" "$w/oci/blobs/sha256/$manifest"
    printf '{"imageLayoutVersion":"1.0.0"}' >"$w/oci/oci-layout"
    printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%d,"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}' \
        "$manifest" "$msize" "$tag" >"$w/oci/index.json"
    skopeo copy -q --dest-tls-verify=false "oci:$w/oci:$tag" "docker://$REG/$repo:$tag"
}

start_registry() {
    alive "$D/registry.pid" && return
    mkdir -p "$D/registry"
    cat >"$D/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $D/registry
http:
  addr: $REG
EOF
    # 9>&-: the daemons must not inherit the start lock.
    docker-registry serve "$D/registry.yml" >"$D/registry.log" 2>&1 9>&- &
    echo $! >"$D/registry.pid"
    for _ in $(seq 100); do curl -sf "http://$REG/v2/" >/dev/null 2>&1 && return; sleep 0.1; done
    echo "error: docker-registry did not start; see $D/registry.log" >&2
    exit 1
}

# Pod networking for pods without hostNetwork: a bridge with host-local addresses (state kept
# under $D) and portmap for hostPorts. Written before containerd starts; containerd also
# notices later changes to the directory.
write_cni_conf() {
    mkdir -p "$D/cni" "$D/cni-ipam"
    cat >"$D/cni/10-edgehub-test.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "edgehub-test",
  "plugins": [
    {"type": "bridge", "bridge": "$BRIDGE", "isGateway": true, "ipMasq": false, "hairpinMode": true,
     "ipam": {"type": "host-local", "dataDir": "$D/cni-ipam",
              "ranges": [[{"subnet": "$POD_SUBNET"}]], "routes": [{"dst": "0.0.0.0/0"}]}},
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
EOF
}

# A second registry that wants a password, for imagePullSecrets: user edgehub, password
# edgehub-pull (test credentials), image 127.0.0.1:5001/private/busybox:1.0.
start_auth_registry() {
    alive "$D/registry-auth.pid" && return
    mkdir -p "$D/registry-auth"
    [ -f "$D/htpasswd" ] || python3 -c 'import crypt; print("edgehub:" + crypt.crypt("edgehub-pull", crypt.mksalt(crypt.METHOD_BLOWFISH)))' 2>/dev/null >"$D/htpasswd"
    cat >"$D/registry-auth.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $D/registry-auth
auth:
  htpasswd:
    realm: edgehub-test
    path: $D/htpasswd
http:
  addr: $AUTH_REG
EOF
    docker-registry serve "$D/registry-auth.yml" >"$D/registry-auth.log" 2>&1 9>&- &
    echo $! >"$D/registry-auth.pid"
    for _ in $(seq 100); do
        # 401 without credentials: it is up.
        [ "$(curl -s -o /dev/null -w '%{http_code}' "http://$AUTH_REG/v2/")" = 401 ] && return
        sleep 0.1
    done
    echo "error: the password-protected docker-registry did not start; see $D/registry-auth.log" >&2
    exit 1
}

start_containerd() {
    write_cni_conf
    alive "$D/containerd.pid" && return
    mkdir -p "$D/root" "$D/state" "$D/opt" "$D/runc" "$D/cni"
    local r
    for r in "$REG" "$AUTH_REG"; do
        mkdir -p "$D/certs.d/$r"
        cat >"$D/certs.d/$r/hosts.toml" <<EOF
server = "http://$r"

[host."http://$r"]
  capabilities = ["pull", "resolve"]
EOF
    done
    cat >"$D/config.toml" <<EOF
version = 2
root = "$D/root"
state = "$D/state"

[grpc]
  address = "$SOCK"

[ttrpc]
  address = "$SOCK.ttrpc"

[debug]
  address = "$D/debug.sock"

[plugins."io.containerd.internal.v1.opt"]
  path = "$D/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "$REG/pause:1.0"
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        Root = "$D/runc"
  [plugins."io.containerd.grpc.v1.cri".registry]
    config_path = "$D/certs.d"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$D/cni"
EOF
    containerd --config "$D/config.toml" >"$D/containerd.log" 2>&1 9>&- &
    echo $! >"$D/containerd.pid"
    for _ in $(seq 100); do
        [ -S "$SOCK" ] && ctr --address "$SOCK" version >/dev/null 2>&1 && return
        sleep 0.1
    done
    echo "error: containerd did not start; see $D/containerd.log" >&2
    exit 1
}

start() {
    need_root
    # The packages come from the one setup script the demo and the tests share.
    bash scripts/setup.sh cri
    mkdir -p "$D"
    # Tests start the stack from several processes at once: one at a time.
    exec 9>"$D/start.lock"
    flock 9
    start_registry
    if [ ! -f "$D/images.done" ]; then
        log "building and pushing test images to $REG"
        mk_image busybox 1.0 '["sh","-c","while true; do echo hello from 1.0; sleep 1; done"]'
        mk_image busybox 2.0 '["sh","-c","while true; do echo hello from 2.0; sleep 1; done"]'
        mk_image pause 1.0 '["sh","-c","trap \"exit 0\" TERM INT; while true; do sleep 3600 & wait; done"]'
        touch "$D/images.done"
    fi
    # An image that exits at once: the upgrade engine's rollback tests.
    if [ ! -f "$D/images-crash.done" ]; then
        mk_image busybox 3.0-crash '["sh","-c","echo hello from 3.0 and goodbye; exit 3"]'
        touch "$D/images-crash.done"
    fi
    # Pods on the pod network with httpGet readiness probes: the same lines as busybox, and
    # an HTTP server on 8080 (httpd forks into the background; the shell stays PID 1).
    if [ ! -f "$D/images-web.done" ]; then
        local v
        for v in 1.0 2.0; do
            mk_image web "$v" "[\"sh\",\"-c\",\"httpd -p 8080 -h /www; while true; do echo 'hello from $v (web)'; sleep 1; done\"]" "web $v"
        done
        touch "$D/images-web.done"
    fi
    start_auth_registry
    if [ ! -f "$D/images-auth.done" ]; then
        skopeo copy -q --src-tls-verify=false --dest-tls-verify=false --dest-creds edgehub:edgehub-pull \
            "docker://$REG/busybox:1.0" "docker://$AUTH_REG/private/busybox:1.0"
        touch "$D/images-auth.done"
    fi
    start_containerd
    echo "$SOCK"
}

stop() {
    # Containers first (runc state lives under our root), then the shims that serve our
    # containerd, then the daemons; everything by PID, never by name alone.
    if [ -d "$D/runc" ]; then
        for ns in "$D"/runc/*; do
            [ -d "$ns" ] || continue
            for id in $(runc --root "$ns" list -q 2>/dev/null); do
                runc --root "$ns" kill "$id" KILL 2>/dev/null || true
                runc --root "$ns" delete --force "$id" 2>/dev/null || true
            done
        done
    fi
    local pids
    pids=$(pgrep -f -- "-address $SOCK" || true)
    [ -n "$pids" ] && kill $pids 2>/dev/null || true
    for f in containerd registry registry-auth; do
        if alive "$D/$f.pid"; then
            kill "$(cat "$D/$f.pid")" 2>/dev/null || true
            for _ in $(seq 50); do alive "$D/$f.pid" || break; sleep 0.1; done
        fi
        rm -f "$D/$f.pid"
    done
    # Network namespaces and sandbox mounts left under the state dir, and the pod bridge.
    grep -o " $D/state/[^ ]*" /proc/mounts 2>/dev/null | sort -r | while read -r m; do umount -l "$m" 2>/dev/null || true; done
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$D/cni-ipam"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    socket) echo "$SOCK" ;;
    status) alive "$D/containerd.pid" ;;
    *) echo "usage: $0 start|stop|socket|status" >&2; exit 2 ;;
esac
