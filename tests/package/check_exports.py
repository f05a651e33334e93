#!/usr/bin/env python3
"""libkdispatch.so exports the public API and nothing else.

Every defined dynamic symbol must be a kdispatch:: name (or the typeinfo or
vtable of a kdispatch class) whose first component after kdispatch:: is
declared in an installed header; and nothing declared in an internal header
(core/src/kdispatch/) is exported.

    check_exports.py LIBRARY PUBLIC_INCLUDE_DIR INTERNAL_INCLUDE_DIR
"""
import pathlib
import re
import subprocess
import sys


def words(directory):
    text = "".join(p.read_text() for p in pathlib.Path(directory).rglob("*.h*"))
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def main():
    library, public_dir, internal_dir = sys.argv[1:4]
    out = subprocess.run(["nm", "-D", "--defined-only", "-C", library], check=True, capture_output=True,
                         text=True).stdout
    public = words(public_dir)
    internal_only = words(internal_dir) - public
    bad = []
    count = 0
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if len(parts) < 3:
            continue
        name = parts[2]
        count += 1
        name = re.sub(r"^(typeinfo name for|typeinfo for|vtable for) ", "", name)
        if not name.startswith("kdispatch::"):
            bad.append(f"not in namespace kdispatch: {parts[2]}")
            continue
        first = re.match(r"kdispatch::([A-Za-z_][A-Za-z0-9_]*)", name).group(1)
        if first not in public:
            bad.append(f"not declared in a public header: {parts[2]}")
        elif first in internal_only:
            bad.append(f"declared in an internal header: {parts[2]}")
    print(f"{count} exported symbols in {library}")
    for b in bad:
        print(b)
    if bad or count == 0:
        sys.exit(1)
    print("all are public API")


if __name__ == "__main__":
    main()
