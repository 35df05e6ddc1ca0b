#!/usr/bin/env bash
# Every measurement of DESIGN §10 in one go: builds the static musl binaries the devices run
# (cross/build.sh), runs each benchmark, collects their `METRIC key value unit` lines, and
# prints one table of medians beside each budget or reference (OVER where one is missed).
# Writes target/bench/numbers.json (and the raw lines to target/bench/metrics.txt, each
# bench's output to target/bench/logs/).
#
#   bash benches/run.sh                 # everything (the flash window alone is about 9
#                                       # minutes, the idle CPU minutes about 4)
#   bash benches/run.sh --readme        # the same, then regenerate the numbers tables (docs/numbers.md,
#                                       # and the budgeted rows in README.md)
#   bash benches/run.sh --readme-only   # only regenerate them from numbers.json
#
# Needs root and the containerd test stack (scripts/cri-stack.sh; started when absent).
# Knobs:
#   RUNS=3                       runs of the quick benches (sync, api, footprint); the
#                                others run once and take their own medians over rounds
#   NO_BUILD=1                   measure the binaries already built
#   EDGEHUB_FLASH_WINDOW_SECS    the longest flash window (600; it ends 30 s after the token
#                                round it waits for)
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
benches=${ONLY:-"sync api runtime runtime_behaviour startup upgrade images hostile outbox seal idle footprint flash fleet"}
log() { printf '==> %s\n' "$*" >&2; }
wanted() { [[ " $benches " == *" $1 "* ]]; }

mkdir -p "$out/logs"
: >"$out/metrics.txt"
started=$(date +%s)

# The x86_64 binary is what the benches run, so it is built first; the aarch64 one is only
# weighed, so it builds during the flash window, whose count of bytes written no compiler
# beside it can change.
if [ "${NO_BUILD:-0}" != 1 ]; then
    log "static x86_64 musl binary (cross/build.sh)"
    TARGETS=x86_64-unknown-linux-musl bash cross/build.sh >&2
fi
binary_size() {
    local bin=target/$1-unknown-linux-musl/release/edgehub
    if [ -f "$bin" ]; then
        echo "METRIC binary_bytes_$1 $(stat -c %s "$bin") B" >>"$out/metrics.txt"
    else
        log "no $bin to weigh"
    fi
}
# The benches that run `edgehub` measure this one (see benches/support/mod.rs).
export EDGEHUB_BENCH_BIN=${EDGEHUB_BENCH_BIN:-$PWD/target/x86_64-unknown-linux-musl/release/edgehub}

log "building the benches"
# Their executables are run directly, not through `cargo bench`: cargo would hold the build
# directory's lock for as long as a bench runs, and the aarch64 build beside the flash
# window needs it.
declare -A exe
while read -r name path; do
    exe[$name]=$path
done < <(cargo bench --no-run --quiet --message-format=json-render-diagnostics \
    $(for b in $benches; do printf -- '--bench %s ' "$b"; done) |
    python3 scripts/cargo-executables.py --bench)

# One bench run: its output to a log, its METRIC lines collected.
bench() {
    local name=$1 tag=$2
    log "bench $name ($tag)"
    if [ -z "${exe[$name]:-}" ]; then
        log "bench $name was not built"
        return
    fi
    if ! "${exe[$name]}" --bench >"$out/logs/$name-$tag.log" 2>&1; then
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
# idle counts CPU seconds over three idle minutes: before the flash window and the aarch64
# build beside it, whose compiler would not change edgehub's count but would slow it.
for name in runtime runtime_behaviour startup upgrade images hostile outbox seal idle; do
    wanted "$name" && bench "$name" run1
done
# Then the flash window (about 9 minutes), which counts one process's writes, whatever else
# runs: beside it the aarch64 build, then the fleet (which counts requests and their rate at
# its own apiservers, so it runs once the compiler is done).
flash_pid=
if wanted flash; then
    bench flash run1 &
    flash_pid=$!
fi
if [ "${NO_BUILD:-0}" != 1 ]; then
    log "static aarch64 musl binary (cross/build.sh), beside the flash window"
    TARGETS=aarch64-unknown-linux-musl nice -n 10 bash cross/build.sh >"$out/logs/build-aarch64.log" 2>&1 \
        || log "the aarch64 build failed: see $out/logs/build-aarch64.log"
fi
binary_size aarch64
binary_size x86_64
wanted fleet && bench fleet run1
[ -z "$flash_pid" ] || wait "$flash_pid"

log "done in $(( $(date +%s) - started )) s"
python3 benches/report.py --json "$out/numbers.json" "$out/metrics.txt"
if [ "$readme" = 1 ]; then
    python3 benches/report.py --readme "$out/numbers.json"
fi
