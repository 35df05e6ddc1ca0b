#!/usr/bin/env bash
# Regenerates cross/hot-text.ld: runs the x86_64 release binary (unstripped, same flags as
# cross/build.sh) under callgrind through the benches that start and idle it, and writes the
# functions that ran into the linker script (see cross/hot_text.py for why).
#
# Run after a change that moves what runs at idle (a new timer, a new dependency on the idle
# path), then `bash cross/build.sh` and `cargo bench --bench footprint` to see the effect.
# A stale script costs memory, never correctness: what it does not name lands in .text.
# Needs root, valgrind and the containerd test stack (`bash scripts/cri-stack.sh start`).
#
#   bash cross/profile-hot.sh
set -euo pipefail
cd "$(dirname "$0")/.."
log() { printf '==> %s\n' "$*"; }
command -v valgrind >/dev/null 2>&1 || { log "apt-get install valgrind"; apt-get install -y -qq valgrind >/dev/null; }

t=x86_64-unknown-linux-musl
log "building $t"
TARGETS=$t bash cross/build.sh >/dev/null
# The unstripped link cross/build.sh keeps: the same code, with its names.
bin=$PWD/target/$t/release/edgehub.sym
dir=$PWD/target/hot-profile

out=$dir/callgrind
rm -rf "$out" && mkdir -p "$out"
wrap=$dir/edgehub-under-callgrind
cat >"$wrap" <<EOF
#!/bin/sh
exec valgrind -q --tool=callgrind --dump-instr=no --compress-strings=no --compress-pos=no --demangle=no --callgrind-out-file=$out/%p.out $bin "\$@"
EOF
chmod +x "$wrap"

# What an idle device runs, one process per case (hot_text.py counts how many ran each
# function): started online with 0, 100 and 1000 pods and no runtime, then 330 s of quiet
# (lease renewals, the rendered list's sweep, the 300 s periodic report: a profile of 90 s
# left the report's code out, and the 100-pod process grew from 5.9 to 7.0 MiB when it ran);
# the online run that fills a data dir and one offline start with the runtime (the footprint
# bench's cold start); online with the runtime and two probed pods for 330 s (CRI status,
# exec probes, the statuses it reports). Timers of an hour or more are not covered.
log "profiling: footprint (idle with 0, 100 and 1000 pods for 330 s; an offline start)"
EDGEHUB_BENCH_BIN=$wrap EDGEHUB_FOOTPRINT_IDLE_SECS=330 EDGEHUB_FOOTPRINT_ROUNDS=1 \
    cargo bench --quiet --bench footprint >"$out/footprint.log" 2>&1
log "profiling: idle, two probed pods, 5.5 minutes"
EDGEHUB_BENCH_BIN=$wrap EDGEHUB_IDLE_WINDOWS=6 \
    cargo bench --quiet --bench idle >"$out/idle.log" 2>&1
ls "$out"/*.out >/dev/null 2>&1 || { echo "error: no callgrind output in $out" >&2; exit 1; }
python3 cross/hot_text.py "$bin" cross/hot-text.ld "$out"/*.out
