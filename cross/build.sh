#!/usr/bin/env bash
# Static release binaries of edgehub for aarch64 and x86_64 musl, built with cargo-zigbuild
# (zig supplies the C cross compiler for the bundled SQLite). Installs what is missing, each
# step quiet when the tool is already there, then checks that `file` calls each binary static
# and prints a size report against the budget.
#
#   bash cross/build.sh            # both targets
#   TARGETS=aarch64-unknown-linux-musl bash cross/build.sh
set -euo pipefail
cd "$(dirname "$0")/.."
targets=${TARGETS:-"aarch64-unknown-linux-musl x86_64-unknown-linux-musl"}
# The aarch64 budget: 5.5 MB, half a megabyte over the 4.77 MB this script built when it was
# set (issue 33), so that growth shows in CI long before the device's limit.
budget_aarch64=$((55 * 100 * 1000))
log() { printf '==> %s\n' "$*"; }

for t in $targets; do
    rustup target list --installed | grep -qx "$t" || { log "rustup target add $t"; rustup target add "$t" >/dev/null; }
done
if ! python3 -c 'import ziglang' 2>/dev/null; then
    log "pip install ziglang"
    # Debian's own python3 marks itself externally managed; a pyenv python does not.
    python3 -m pip install -q ziglang 2>/dev/null || python3 -m pip install -q --break-system-packages ziglang
fi
command -v cargo-zigbuild >/dev/null 2>&1 || { log "cargo install cargo-zigbuild"; cargo install --locked --quiet cargo-zigbuild; }
command -v file >/dev/null 2>&1 || { log "apt-get install file"; apt-get install -y -qq file >/dev/null; }

# No unwind tables: with panic=abort nothing unwinds, and they only fed a panic's backtrace,
# which a stripped binary prints as bare addresses anyway. They were 16 % of the aarch64
# binary (.eh_frame and its index: 5,695,840 B with them, 4,773,496 B without). The flag
# keeps rustc from emitting tables for our crates; the standard library and the C code
# (SQLite, ring, musl) are prebuilt or compiled with theirs, so the linker script
# (cross/no-unwind-tables.ld, added to the default script) discards the sections at link.
# A panic still prints its message and aborts; RUST_BACKTRACE then shows no frames. Given
# here, to the release builds alone: tests build with panic=unwind, which needs them (rustc
# refuses the two together), and a cargo profile cannot carry rustflags on stable.
#
# The functions edgehub runs when it starts and idles go first, in one output section
# (.text.hot, cross/hot-text.ld, written by cross/profile-hot.sh): the kernel maps code 64 KiB
# around each page touched, and spread over the whole text they kept all of it resident (issue
# 33). v0 mangling names every generic instantiation apart, so the script can name the ones
# that ran. zig's linker takes one -T script: the two are joined into the target dir, and the
# binary relinked when the joined script changes (cargo does not watch a linker script).
target_dir=$(realpath -m "${CARGO_TARGET_DIR:-target}")
mkdir -p "$target_dir"
link_script=$target_dir/release-link.ld
cat cross/no-unwind-tables.ld cross/hot-text.ld >"$link_script.new"
if ! cmp -s "$link_script.new" "$link_script"; then
    mv "$link_script.new" "$link_script"
    touch src/main.rs
else
    rm -f "$link_script.new"
fi
release_rustflags="-C force-unwind-tables=no -C symbol-mangling-version=v0 -C link-arg=-Wl,-T,$link_script"

# Stripped after the link, not by it: linked with `-s` (rustc's strip), the same objects and
# script gave a different text (8 KB less in .text.hot) that kept 1.2 MB more of it resident
# at idle (cargo bench --bench footprint: 7,908 KiB against 6,148 for the same link stripped
# after). lld's arguments differed only by `-s`; the cause was not pinned down. The
# unstripped link is kept beside it as edgehub.sym (cross/profile-hot.sh profiles that one).
host=$(rustc -vV | sed -n 's/^host: //p')
sysroot=$(rustc --print sysroot)
# rust-objcopy ships with rustc (llvm-objcopy: every target's ELF) and loads the toolchain's
# libLLVM, which rustc finds for it and a plain exec does not.
objcopy() { LD_LIBRARY_PATH=$sysroot/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} "$sysroot/lib/rustlib/$host/bin/rust-objcopy" "$@"; }

for t in $targets; do
    log "building $t (release: opt-level z, LTO, 1 codegen unit, panic=abort, no unwind tables, stripped)"
    var=CARGO_TARGET_$(echo "$t" | tr 'a-z-' 'A-Z_')_RUSTFLAGS
    env "$var=${!var:+${!var} }$release_rustflags" CARGO_PROFILE_RELEASE_STRIP=false \
        cargo zigbuild --release --locked --quiet -p edgehub --bin edgehub --target "$t"
    bin=$target_dir/$t/release/edgehub
    # A fresh link still has its symbols; a build cargo found up to date was stripped already.
    if [ -n "$(readelf -SW "$bin" | sed -n '/ \.symtab /p')" ]; then
        cp -f "$bin" "$bin.sym"
        objcopy --strip-all "$bin.sym" "$bin"
    fi
done

# One section's size in hex, from the section headers `strip` leaves.
section_size() { readelf -SW "$1" | sed -n "s/.* $2  *PROGBITS  *[0-9a-f]*  *[0-9a-f]*  *\([0-9a-f]*\) .*/\1/p"; }

echo
printf '%-28s %10s  %s\n' target bytes file
status=0
for t in $targets; do
    bin=${CARGO_TARGET_DIR:-target}/$t/release/edgehub
    desc=$(file -b "$bin")
    size=$(stat -c %s "$bin")
    printf '%-28s %10d  %s\n' "$t" "$size" "${desc%%,*}, ${desc#*, }" | cut -c1-160
    case "$desc" in
        *"statically linked"* | *"static-pie linked"*) ;;
        *) echo "error: $bin is not statically linked: $desc" >&2; status=1 ;;
    esac
    # How much of the code is the start-up and idle set (0 when the script matched nothing).
    hot=$(section_size "$bin" '\.text\.hot'); text=$(section_size "$bin" '\.text')
    printf '%-28s %10d  bytes in .text.hot (start-up and idle code), %d in .text\n' "" "$((16#${hot:-0}))" "$((16#${text:-0}))"
    [ "$((16#${hot:-0}))" -gt 0 ] || { echo "error: cross/hot-text.ld matched no code in $bin" >&2; status=1; }
    if [ "$t" = aarch64-unknown-linux-musl ]; then
        awk -v s="$size" -v b="$budget_aarch64" 'BEGIN { printf "aarch64 size: %.2f MB of the %.1f MB budget (yurthub: about 19 MB compressed)\n", s / 1000000, b / 1000000 }'
        [ "$size" -le "$budget_aarch64" ] || { echo "error: aarch64 binary over the $budget_aarch64-byte budget" >&2; status=1; }
    fi
done
exit $status
