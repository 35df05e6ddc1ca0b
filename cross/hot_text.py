#!/usr/bin/env python3
"""Writes cross/hot-text.ld: the functions edgehub runs when it starts and idles, gathered at
the front of the binary's code, so that the pages an idle device keeps mapped are theirs.

Why: the kernel maps a binary's code in blocks around each page a process touches (64 KiB
of fault-around, or a whole large folio of the page cache), and rustc lays functions out in
no order that follows use. Starting and idling, edgehub ran about 6,000 functions (2.5 MB of
the 4.97 MB of x86_64 code) spread over all 75 of the text's 64 KiB blocks, so the whole
text stayed resident (issue 33). Gathered, they fill the first 41.

Input: the unstripped binary the profile ran (`nm`) and callgrind's outputs
(`--demangle=no`, one `fn=` line per function that ran). Output: a linker script added to
the default one (`INSERT BEFORE .text`) with one output section, `.text.hot`, that takes each
of those functions' input sections (`-ffunction-sections`: `.text.<symbol>`).

The names are v0-mangled (`-C symbol-mangling-version=v0`, set by cross/build.sh): they
carry every generic argument, so one pattern picks one instantiation, where the legacy
mangling named all of a generic function's instantiations the same but for a hash. Each
crate's disambiguator (`Cs<base62>_`) depends on the target and the compiler, so it becomes a
`*`: the same script serves x86_64 and aarch64 and survives a dependency's version bump. A
function the script does not name (new code, a renamed one) only lands in `.text` as before.

    python3 cross/hot_text.py BINARY OUT.ld CALLGRIND_OUT...
"""

import bisect
import re
import subprocess
import sys

# `C` (crate root), then the disambiguator `s<base62>_`, then the crate name's length.
DISAMBIGUATOR = re.compile(r"C(s[0-9A-Za-z]*_)(?=[0-9])")
# A back-reference (`B<base62>_`): an offset into the name, which moves when a disambiguator
# before it is one character longer or shorter. The pattern may also catch an identifier
# that happens to start with `B`; the glob is then only looser, still matching this name.
BACKREF = re.compile(r"B[0-9A-Za-z]*_")
# LLVM's suffixes on internalized or duplicated symbols (`.llvm.<digits>`, `.<digits>`)
# change between builds.
LLVM_SUFFIX = re.compile(r"(\.llvm)?\.[0-9]+$")


# Code that picks its implementation by the CPU it runs on (ring's AES-GCM, SHA-2 and P-256,
# memchr): callgrind's virtual CPU is neither this machine's nor an aarch64 device's, so the
# variants the profile saw are not all the ones a device runs. All of it goes in: about 45 KB
# of ring's Rust on x86_64 (27 KB on aarch64) beside its assembly, which `*(.text)` takes.
CPU_DISPATCHED = [
    "_R*Cs*_4ring*",
    "ring_core_*",
    # ring's X25519 in C, whose field arithmetic takes the ADX/BMI2 path on a CPU with them.
    "fe_*",
    "fe4_*",
    "x25519_*",
    "_R*Cs*_6memchr*",
    "_R*Cs*_10std_detect*",
]


def executed(paths):
    """Every function callgrind saw run, by symbol name, with how many of the profiled
    processes ran it."""
    runs = {}
    for path in paths:
        names = set()
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("fn="):
                    # A recursion depth marker (`'2`) follows a function entered again.
                    names.add(re.sub(r"'[0-9]+$", "", line[3:].strip()))
        for n in names:
            runs[n] = runs.get(n, 0) + 1
    return runs


def resolve(ran, syms, starts):
    """Callgrind's names for code it found no symbol for: `(below main)` is musl's
    `__libc_start_main`, and a bare address is inside the symbol that starts below it."""
    out = {}
    for name, count in ran.items():
        if name == "(below main)":
            name = "__libc_start_main"
        elif re.fullmatch(r"0x[0-9a-f]+", name):
            i = bisect.bisect_right(starts, (int(name, 16), "\uffff")) - 1
            if i < 0:
                continue
            name = starts[i][1]
        if name in syms:
            out[name] = max(out.get(name, 0), count)
    return out


def text_symbols(binary):
    """The binary's function symbols with their sizes, and every name each address has."""
    out = subprocess.run(
        ["nm", "-S", "--defined-only", binary], capture_output=True, text=True, check=True
    ).stdout
    syms, names_at = {}, {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[2] in "tTwW":
            addr, size, name = int(parts[0], 16), int(parts[1], 16), parts[3]
            syms.setdefault(name, size)
            names_at.setdefault(addr, []).append(name)
    aliases = {}
    for names in names_at.values():
        for n in names:
            aliases[n] = names
    starts = sorted((a, ns[0]) for a, ns in names_at.items())
    return syms, aliases, starts


def pattern(symbol):
    """The symbol as a linker-script glob that any target's build matches."""
    name = LLVM_SUFFIX.sub(".*", symbol)
    if name.startswith("_R"):
        name = BACKREF.sub("B*_", DISAMBIGUATOR.sub("Cs*_", name))
    # `?`, `[` and `]` are glob characters too; none appears in a v0 or C name, but a
    # pattern that meant something else would silently match other sections.
    if any(c in name for c in "?[]\\ \t"):
        return None
    return name


def main():
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    binary, out, profiles = sys.argv[1], sys.argv[2], sys.argv[3:]
    syms, aliases, starts = text_symbols(binary)
    ran = resolve(executed(profiles), syms, starts)
    # What every process ran first (the runtime, TLS, SQLite, the idle loop), then what only
    # some did (1000 pods, the offline start, the CRI): a process that ran less keeps fewer
    # of the section's pages.
    hot = sorted((n for n in ran if n in syms), key=lambda n: (-ran[n], n))
    # Every name of a function: musl's section is named after `__pthread_create`, while
    # callgrind may report its weak alias `pthread_create`.
    named = (a for n in hot for a in aliases.get(n, [n]))
    patterns = list(dict.fromkeys(p for p in map(pattern, named) if p))
    hot_bytes = sum(syms[n] for n in hot)
    all_bytes = sum(syms.values())
    with open(out, "w") as f:
        f.write(
            "/* Generated by cross/profile-hot.sh (cross/hot_text.py); do not edit by hand.\n"
            f" * {len(hot)} functions that ran while edgehub started and idled, {hot_bytes} of the\n"
            f" * {all_bytes} bytes of x86_64 code, gathered before .text so that an idle device\n"
            " * keeps their pages mapped and not the whole text (see cross/hot_text.py). */\n"
            "SECTIONS\n{\n    .text.hot : {\n"
        )
        for p in patterns:
            # `.text*.`: LLVM puts a function it deems cold (`#[cold]`, a grow path) in
            # `.text.unlikely.<symbol>`, and some of those run at every start.
            f.write(f"        *(.text*.{p})\n")
        f.write("        /* Code that picks its implementation by CPU (cross/hot_text.py). */\n")
        for p in CPU_DISPATCHED:
            f.write(f"        *(.text*.{p})\n")
        f.write(
            "        /* Code built without a section per function (musl's libc, ring's assembly,\n"
            "         * compiler-rt): one .text per object, which no name above picks. */\n"
            "        *(.text)\n"
        )
        f.write("    }\n}\nINSERT BEFORE .text;\n")
    print(
        f"{len(hot)} functions ran ({hot_bytes} of {all_bytes} bytes of code); "
        f"{len(patterns)} patterns written to {out}"
    )


if __name__ == "__main__":
    main()
