#!/usr/bin/python3
"""The exported dynamic symbols of libctr.so must be exactly the functions that
include/ctr/ctr.h declares: nothing internal leaks, nothing declared is missing.

usage: check_symbols.py LIBCTR_SO CTR_H
"""
import re
import subprocess
import sys


def header_functions(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return set(re.findall(r"CTR_API\s+[^;(]*?\b(ctr_\w+)\s*\(", text))


def exported(lib):
    out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True,
                         capture_output=True, text=True).stdout
    syms = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("T", "W", "D", "B", "R", "V", "i"):
            syms.add(parts[2].split("@")[0])
    return syms


def main():
    lib, header = sys.argv[1], sys.argv[2]
    declared = header_functions(header)
    have = exported(lib)
    if len(declared) < 30:
        print(f"only {len(declared)} declarations parsed from {header}: parser broken?")
        return 1
    extra = sorted(have - declared)
    missing = sorted(declared - have)
    if extra:
        print("exported but not in the header:", *extra, sep="\n  ")
    if missing:
        print("declared in the header but not exported:", *missing, sep="\n  ")
    if extra or missing:
        return 1
    print(f"{len(declared)} functions declared and exported, nothing else")
    return 0


if __name__ == "__main__":
    sys.exit(main())
