#!/usr/bin/env python3
"""Lists the code objects in the CUDA fat binary of an ELF file (.nv_fatbin):
kind (ELF = SASS for an sm_XX, PTX = compute_XX for JIT) and architecture.

For machines without cuobjdump. Reads the documented-by-practice layout of
fatbin containers (magic 0xBA55ED50) and of their entry headers.

    tools/gpu/fatbin_archs.py build/lib/kdispatch/plugins/libkdispatch-cuda.so
"""
import struct
import subprocess
import sys

FATBIN_MAGIC = 0xBA55ED50
KINDS = {1: "PTX", 2: "ELF"}


def section(path, name):
    """Bytes of section `name`, located with readelf."""
    out = subprocess.run(["readelf", "-S", "-W", path], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        fields = line.replace("[ ", "[").split()
        if len(fields) > 5 and fields[1] == name:
            offset, size = int(fields[4], 16), int(fields[5], 16)
            with open(path, "rb") as f:
                f.seek(offset)
                return f.read(size)
    raise SystemExit(f"{path}: no {name} section")


def entries(blob):
    pos = 0
    while pos + 16 <= len(blob):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", blob, pos)
        if magic != FATBIN_MAGIC:
            pos += 8  # containers are 8-byte aligned; skip padding
            continue
        entry = pos + header_size
        end = entry + fat_size
        while entry + 32 <= end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", blob, entry)
            arch = struct.unpack_from("<I", blob, entry + 28)[0]
            yield KINDS.get(kind, f"kind{kind}"), arch
            entry += entry_header + payload
        pos = end


def main():
    for path in sys.argv[1:]:
        for kind, arch in entries(section(path, ".nv_fatbin")):
            name = f"sm_{arch}" if kind == "ELF" else f"compute_{arch}"
            print(f"{path}: {kind} {name}")


if __name__ == "__main__":
    main()
