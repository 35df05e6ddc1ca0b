#!/usr/bin/env python3
"""The executables a `cargo build --message-format=json` run produced, read from stdin.

    cargo-executables.py --bench                    # "name path" of each bench
    cargo-executables.py --test --exclude a,b       # the path of each test binary, but a and b
    cargo-executables.py --test --exclude-spawning  # ... but those that spawn a cargo bin

benches/run.sh runs the benches it built directly; cross/qemu-check.sh runs the aarch64
test binaries under qemu.
"""
import argparse
import json
import os
import re
import sys

p = argparse.ArgumentParser()
kind = p.add_mutually_exclusive_group(required=True)
kind.add_argument("--bench", action="store_true", help="bench targets, as 'name path'")
kind.add_argument("--test", action="store_true", help="test binaries (no bins), as 'path'")
p.add_argument("--exclude", default="", help="comma-separated target names to leave out")
p.add_argument(
    "--exclude-spawning",
    action="store_true",
    help="leave out test targets whose source, or a module it includes by #[path], names "
    "CARGO_BIN_EXE_ (they spawn a binary built for the target, which qemu-user cannot exec "
    "without binfmt_misc)",
)
args = p.parse_args()
excluded = set(filter(None, args.exclude.split(",")))

PATH_MOD = re.compile(r'#\[path\s*=\s*"([^"]+)"\]')


def spawns_a_bin(src):
    """Whether `src` or a file it includes by `#[path = ...]` names CARGO_BIN_EXE_ (a list
    kept by hand missed tests/upgrade_faults.rs once; reading the sources cannot)."""
    try:
        text = open(src, encoding="utf-8").read()
    except OSError:
        return False
    if "CARGO_BIN_EXE_" in text:
        return True
    base = os.path.dirname(src)
    for rel in PATH_MOD.findall(text):
        try:
            if "CARGO_BIN_EXE_" in open(os.path.join(base, rel), encoding="utf-8").read():
                return True
        except OSError:
            continue
    return False


for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    if m.get("reason") != "compiler-artifact" or not m.get("executable"):
        continue
    target = m["target"]
    if target["name"] in excluded:
        continue
    if args.exclude_spawning and spawns_a_bin(target.get("src_path", "")):
        print("leaving out (spawns a binary):", target["name"], file=sys.stderr)
        continue
    if args.bench and "bench" in target["kind"]:
        print(target["name"], m["executable"])
    elif args.test and m["profile"]["test"] and target["kind"] != ["bin"]:
        print(m["executable"])
