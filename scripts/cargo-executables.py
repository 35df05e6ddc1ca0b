#!/usr/bin/env python3
"""The executables a `cargo build --message-format=json` run produced, read from stdin.

    cargo-executables.py --bench                    # "name path" of each bench
    cargo-executables.py --test --exclude a,b       # the path of each test binary, but a and b

benches/run.sh runs the benches it built directly; cross/qemu-check.sh runs the aarch64
test binaries under qemu.
"""
import argparse
import json
import sys

p = argparse.ArgumentParser()
kind = p.add_mutually_exclusive_group(required=True)
kind.add_argument("--bench", action="store_true", help="bench targets, as 'name path'")
kind.add_argument("--test", action="store_true", help="test binaries (no bins), as 'path'")
p.add_argument("--exclude", default="", help="comma-separated target names to leave out")
args = p.parse_args()
excluded = set(filter(None, args.exclude.split(",")))

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
    if args.bench and "bench" in target["kind"]:
        print(target["name"], m["executable"])
    elif args.test and m["profile"]["test"] and target["kind"] != ["bin"]:
        print(m["executable"])
