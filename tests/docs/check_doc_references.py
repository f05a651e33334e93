#!/usr/bin/env python3
"""Checks that README.md and docs/*.md agree with the tree they describe.

  check_doc_references.py --source DIR links
      Every relative link of README.md, docs/*.md and tools/bench/README.md
      names a file or directory that exists (and, with a #fragment into a
      Markdown file, a heading of it).
  check_doc_references.py --source DIR errors TOOL
      The table of docs/errors.md lists exactly the codes and titles that
      `TOOL explain --json` (core/src/error_catalogue.cpp) gives, in order.
  check_doc_references.py --source DIR environment
      Every KDISPATCH_* environment variable that core/, plugins/, tools/ or
      the CMake files read (getenv, secure_getenv, get_env, environment_value
      of plugin_helpers.hpp, os.environ, a shell $NAME or
      CMake's ENV) is documented in docs/environment.md.

Exit status 1 with one line per problem.
"""
import argparse
import json
import pathlib
import re
import subprocess
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# How each kind of file reads an environment variable.
ENV_READS = {
    (".c", ".cpp", ".hpp", ".h", ".cu", ".cuh"): re.compile(
        r"""(?:secure_getenv|getenv|get_env|environment_value)\(\s*"(KDISPATCH_[A-Z0-9_]+)"\s*\)"""),
    (".py",): re.compile(r"""environ(?:\.get\(|\[)\s*["'](KDISPATCH_[A-Z0-9_]+)["']"""),
    (".sh",): re.compile(r"""\$\{?(KDISPATCH_[A-Z0-9_]+)"""),
    (".txt", ".cmake"): re.compile(r"""ENV[ {]+(KDISPATCH_[A-Z0-9_]+)"""),
}


def markdown_files(source):
    return [source / "README.md", *sorted((source / "docs").glob("*.md")), source / "tools/bench/README.md"]


def anchors(path):
    """GitHub's anchors of a Markdown file's headings."""
    out = set()
    in_fence = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith(("```", "~~~")):
            in_fence = not in_fence
        if in_fence or not line.startswith("#"):
            continue
        title = line.lstrip("#").strip().lower()
        title = re.sub(r"[^\w\- ]", "", title)
        out.add(title.replace(" ", "-"))
    return out


def check_links(source):
    problems = []
    for md in markdown_files(source):
        text = md.read_text(encoding="utf-8")
        # Links inside code are examples, not links.
        text = re.sub(r"```.*?```", "", text, flags=re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file_part, _, fragment = target.partition("#")
            resolved = (md.parent / file_part).resolve()
            name = f"{md.relative_to(source)}: link to {target}"
            if not resolved.exists():
                problems.append(f"{name}: no such file")
            elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
                problems.append(f"{name}: no heading '{fragment}' in {resolved.relative_to(source)}")
    return problems


def check_errors(source, tool):
    catalogue = json.loads(subprocess.run([tool, "explain", "--json"], check=True, stdout=subprocess.PIPE,
                                          text=True).stdout)["codes"]
    want = [(c["code"], c["title"]) for c in catalogue]
    rows = re.findall(r"^\| (KD-E\d{3}) \| (.*) \|$", (source / "docs/errors.md").read_text(encoding="utf-8"),
                      flags=re.M)
    if rows == want:
        return []
    problems = []
    for code, title in want:
        if (code, title) not in rows:
            problems.append(f"docs/errors.md: missing or different: | {code} | {title} |")
    for code, title in rows:
        if (code, title) not in want:
            problems.append(f"docs/errors.md: not in the catalogue: | {code} | {title} |")
    return problems or ["docs/errors.md: the codes are not in the catalogue's order"]


def check_environment(source):
    read = {}
    files = [source / "CMakeLists.txt"]
    for directory in ("core", "plugins", "tools", "cmake"):
        files += sorted((source / directory).rglob("*"))
    for path in files:
        patterns = [p for suffixes, p in ENV_READS.items() if path.suffix in suffixes]
        if not path.is_file() or not patterns:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for pattern in patterns:
            for name in pattern.findall(text):
                read.setdefault(name, str(path.relative_to(source)))
    documented = set(re.findall(r"`(KDISPATCH_[A-Z0-9_]+)", (source / "docs/environment.md").read_text(
        encoding="utf-8")))
    return [f"docs/environment.md: {name} (read by {where}) is not documented"
            for name, where in sorted(read.items()) if name not in documented]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", required=True, type=pathlib.Path)
    parser.add_argument("check", choices=["links", "errors", "environment"])
    parser.add_argument("tool", nargs="?")
    args = parser.parse_args()
    source = args.source.resolve()
    if args.check == "links":
        problems = check_links(source)
    elif args.check == "errors":
        if not args.tool:
            parser.error("errors needs the kdispatch tool")
        problems = check_errors(source, args.tool)
    else:
        problems = check_environment(source)
    for p in problems:
        print(p)
    print(f"{args.check}: {'ok' if not problems else f'{len(problems)} problem(s)'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
