#!/usr/bin/env python3
"""Runs every runnable code block of README.md and docs/*.md as written.

The convention. A fenced block is runnable when the word `runnable` follows
its language in the fence's info string:

    ```sh runnable
    build/default/bin/kdispatch list
    ```

    ```python runnable needs=torch
    import torch, kdispatch.torch
    ```

- `sh` (also `bash`, `shell`) blocks run as one bash script with
  `set -eo pipefail`, so every command of the block must succeed;
  `python` blocks run as one script with the Python the module is built
  for and PYTHONPATH=<build>/python. Each block runs on its own, from the
  source root, so it must not depend on another block.
- `needs=a,b` names what a block needs beyond a default build; without it
  the block is reported as skipped, not run: `cuda-plugin` (the build has
  the CUDA plugin), `numpy`, `torch` (importable by the module's Python).
  Python blocks also need the Python module (`-DKDISPATCH_BUILD_PYTHON`).
- Blocks are written for the `default` preset, as a reader runs them:
  `build/default` in a block stands for the build tree under test, and
  `/usr/bin/python3` for the Python the module is built for; both are
  replaced before the block runs.
- Blocks that cannot run in a test (a GPU, an install into a system
  prefix, the quick start's package installation) stay unmarked.

The blocks run without the caller's KDISPATCH_* variables (a block sets
what it needs), with XDG_CACHE_HOME in the build tree and TMPDIR a fresh
directory that is removed afterwards. A failing block is reported with its
file:line, the block as run and its output; the exit status is 1 when any
block failed, or when no runnable block was found at all.

  run_doc_blocks.py --source DIR --build DIR [--python EXE] [--python-module]
                    [--cuda-plugin] [FILE.md ...]
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
SHELLS = {"sh", "bash", "shell"}
PYTHONS = {"python", "python3", "py"}
DEFAULT_BUILD = re.compile(r"(?<![\w./-])build/default(?![\w-])")
DEFAULT_PYTHON = re.compile(r"(?<![\w./-])/usr/bin/python3(?![\w.-])")
TIMEOUT_S = 600


class Block:
    def __init__(self, path, line, language, needs, text):
        self.path, self.line, self.language, self.needs, self.text = path, line, language, needs, text

    def where(self, source):
        return f"{self.path.relative_to(source)}:{self.line}"


def runnable_blocks(path):
    """The runnable fenced blocks of one Markdown file, with the line of their fence."""
    blocks = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence = m.group("fence")
        words = m.group("info").split()
        start = i
        body = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i])
            i += 1
        i += 1  # the closing fence
        if len(words) < 2 or words[1] != "runnable":
            continue
        needs = set()
        for word in words[2:]:
            if word.startswith("needs="):
                needs.update(n for n in word[len("needs="):].split(",") if n)
            else:
                raise SystemExit(f"{path}:{start + 1}: unknown word '{word}' in the fence's info string")
        language = words[0].lower()
        if language not in SHELLS | PYTHONS:
            raise SystemExit(f"{path}:{start + 1}: a runnable block must be sh or python, not '{words[0]}'")
        if language in PYTHONS:
            needs.add("python")
        blocks.append(Block(path, start + 1, language, needs, "\n".join(body) + "\n"))
    return blocks


def python_can_import(python, module, env):
    if not python:
        return False
    return subprocess.run([python, "-c", f"import {module}"], env=env, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL).returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, type=pathlib.Path)
    parser.add_argument("--build", required=True, type=pathlib.Path)
    parser.add_argument("--python", default="", help="the Python the module is built for")
    parser.add_argument("--python-module", action="store_true", help="the build has the Python module")
    parser.add_argument("--cuda-plugin", action="store_true", help="the build has the CUDA plugin")
    parser.add_argument("files", nargs="*", type=pathlib.Path)
    args = parser.parse_args()

    source = args.source.resolve()
    build = pathlib.Path(os.path.abspath(args.build))
    files = [f.resolve() for f in args.files] or [source / "README.md", *sorted((source / "docs").glob("*.md"))]

    env = {k: v for k, v in os.environ.items() if not k.startswith("KDISPATCH_")}
    env["XDG_CACHE_HOME"] = str(build / "tests" / "cache-docs")
    python_env = dict(env, PYTHONPATH=str(build / "python"))
    available = set()
    if args.cuda_plugin:
        available.add("cuda-plugin")
    if args.python_module and args.python:
        available.add("python")
        for module in ("numpy", "torch"):
            if python_can_import(args.python, module, python_env):
                available.add(module)

    blocks = [b for f in files for b in runnable_blocks(f)]
    if not blocks:
        print("no runnable block found in " + ", ".join(str(f.relative_to(source)) for f in files))
        return 1

    failed = skipped = 0
    for block in blocks:
        missing = sorted(block.needs - available)
        if missing:
            print(f"{block.where(source)}: skipped (needs {', '.join(missing)})")
            skipped += 1
            continue
        text = DEFAULT_BUILD.sub(str(build), block.text)
        if args.python:
            text = DEFAULT_PYTHON.sub(args.python, text)
        tmp = tempfile.mkdtemp(prefix="kdispatch-doc-block.")
        try:
            run_env = dict(python_env if block.language in PYTHONS else env, TMPDIR=tmp)
            if block.language in SHELLS:
                command = ["bash", "-e", "-o", "pipefail", "-c", text, f"{block.where(source)}"]
            else:
                command = [args.python, "-c", text]
            start = time.monotonic()
            try:
                result = subprocess.run(command, cwd=source, env=run_env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, timeout=TIMEOUT_S)
                status, output = result.returncode, result.stdout
            except subprocess.TimeoutExpired as e:
                status = f"timeout after {TIMEOUT_S} s"
                output = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
            seconds = time.monotonic() - start
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if status == 0:
            print(f"{block.where(source)}: ok ({seconds:.1f} s)")
            continue
        failed += 1
        print(f"{block.where(source)}: FAILED (exit {status})")
        print(f"--- the {block.language} block, as run:")
        print(text, end="")
        print("--- its output:")
        print(output, end="" if output.endswith("\n") else "\n")
        print("---")

    ran = len(blocks) - failed - skipped
    print(f"\ndoc blocks: {ran} passed, {failed} failed, {skipped} skipped, of {len(blocks)} in {len(files)} files")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
