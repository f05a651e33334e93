#!/usr/bin/env python3
"""A plugin folder whose name is not UTF-8 (any byte is valid in a Linux
file name) comes back from kdispatch.select, backends and doctor with the
undecodable bytes as lone surrogates, as os.fsdecode gives them, never as a
UnicodeDecodeError; os.fsencode gives the bytes back.

Usage: test_undecodable_names.py FX_GOOD_DIR (the built fixture's folder)"""
import json
import os
import shutil
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys
import kdispatch
folder = os.fsdecode(os.environb[b"KDISPATCH_ADD_PLUGIN_PATH"])
chosen = kdispatch.select("fixture.scale", backend="fx_good")
assert chosen["manifest"].startswith(folder), (chosen["manifest"], folder)
assert os.fsencode(chosen["manifest"]).startswith(os.environb[b"KDISPATCH_ADD_PLUGIN_PATH"])
assert any(b["manifest"].startswith(folder) for b in kdispatch.backends("fixture.scale"))
report = kdispatch.doctor()
assert folder in report["search_path"], report["search_path"]
assert any(p["manifest"].startswith(folder) for p in report["plugins"])
print("decoded")
"""


def main(fixture_dir):
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(os.fsencode(tmp), b"plugins-\xff\xfe")
        os.mkdir(folder)
        manifest = json.loads(open(os.path.join(fixture_dir, "fx_good.json")).read())
        with open(os.path.join(folder, b"fx_good.json"), "w") as f:
            json.dump(manifest, f)
        shutil.copy2(os.path.join(fixture_dir, manifest["library"]), os.path.join(folder, os.fsencode(manifest["library"])))
        env = dict(os.environb)
        env[b"KDISPATCH_ADD_PLUGIN_PATH"] = folder
        result = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True)
        if result.returncode != 0 or "decoded" not in result.stdout:
            print("FAIL: " + result.stderr.strip().splitlines()[-1] if result.stderr.strip() else result.stdout)
            print(result.stderr)
            return 1
    print("ok: select, backends and doctor decode a non-UTF-8 plugin folder")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
