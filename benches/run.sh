#!/usr/bin/env bash
# Every measurement of DESIGN §10 in one go: builds the static musl binaries the devices run
# (cross/build.sh), runs each benchmark, collects their `METRIC key value unit` lines, and
# prints one table of medians beside each budget or reference (OVER where one is missed).
# Writes target/bench/numbers.json (and the raw lines to target/bench/metrics.txt, each
# bench's output to target/bench/logs/).
#
#   bash benches/run.sh                 # everything: about 25 minutes on an idle 2-core
#                                       # machine after the builds (flash's window alone is
#                                       # 10 minutes)
#   bash benches/run.sh --readme        # the same, then regenerate README's numbers table
#   bash benches/run.sh --readme-only   # only regenerate README's table from numbers.json
#
# Needs root and the containerd test stack (scripts/cri-stack.sh; started when absent).
# Knobs:
#   RUNS=3                       runs of the quick benches (sync, api, footprint); the
#                                others run once and take their own medians over rounds
#   NO_BUILD=1                   measure the binaries already built
#   EDGEHUB_FLASH_WINDOW_SECS    the flash window (600: the cursor checkpoint interval)
#   EDGEHUB_FLEET_DEVICES        devices per fleet (50)
#   EDGEHUB_FLEET_OFFLINE_SECS   the link cut (120)
#   ONLY="api footprint"         run only these benches (the JSON then holds only theirs)
set -euo pipefail
cd "$(dirname "$0")/.."

out=target/bench
readme=0
for a in "$@"; do
    case "$a" in
        --readme) readme=1 ;;
        --readme-only) exec python3 benches/report.py --readme "$out/numbers.json" ;;
        *) echo "unknown argument: $a" >&2; exit 2 ;;
    esac
done
runs=${RUNS:-3}
export EDGEHUB_FLASH_WINDOW_SECS=${EDGEHUB_FLASH_WINDOW_SECS:-600}
benches=${ONLY:-"sync api runtime runtime_behaviour upgrade outbox footprint flash fleet"}
log() { printf '==> %s\n' "$*" >&2; }
wanted() { [[ " $benches " == *" $1 "* ]]; }

mkdir -p "$out/logs"
: >"$out/metrics.txt"
started=$(date +%s)

if [ "${NO_BUILD:-0}" != 1 ]; then
    log "static musl binaries (cross/build.sh)"
    bash cross/build.sh >&2
fi
for t in aarch64 x86_64; do
    bin=target/$t-unknown-linux-musl/release/edgehub
    if [ -f "$bin" ]; then
        echo "METRIC binary_bytes_$t $(stat -c %s "$bin") B" >>"$out/metrics.txt"
    fi
done
# The benches that run `edgehub` measure this one (see benches/support/mod.rs).
export EDGEHUB_BENCH_BIN=${EDGEHUB_BENCH_BIN:-$PWD/target/x86_64-unknown-linux-musl/release/edgehub}

log "building the benches"
cargo bench --no-run --quiet $(for b in $benches; do printf -- '--bench %s ' "$b"; done) >&2

# One bench run: its output to a log, its METRIC lines collected.
bench() {
    local name=$1 tag=$2
    log "cargo bench --bench $name ($tag)"
    if ! cargo bench --quiet --bench "$name" >"$out/logs/$name-$tag.log" 2>&1; then
        log "bench $name failed: see $out/logs/$name-$tag.log"
    fi
    grep '^METRIC ' "$out/logs/$name-$tag.log" >>"$out/metrics.txt" || true
    grep -v '^METRIC ' "$out/logs/$name-$tag.log" | grep -v '^$' | sed "s/^/    [$name] /" >&2 || true
}

# Latency and memory first, one at a time, on a quiet machine.
for name in sync api footprint; do
    wanted "$name" || continue
    for r in $(seq 1 "$runs"); do bench "$name" "run$r"; done
done
for name in runtime runtime_behaviour upgrade outbox; do
    wanted "$name" && bench "$name" run1
done
# Then the two long windows side by side: flash counts one process's writes, the fleet counts
# requests at its own apiservers; neither is a latency the other's load would skew much.
pids=()
for name in flash fleet; do
    if wanted "$name"; then
        bench "$name" run1 &
        pids+=($!)
    fi
done
for p in "${pids[@]}"; do wait "$p"; done

log "done in $(( $(date +%s) - started )) s"
python3 benches/report.py --json "$out/numbers.json" "$out/metrics.txt"
if [ "$readme" = 1 ]; then
    python3 benches/report.py --readme "$out/numbers.json"
fi
