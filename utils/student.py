"""The student starter kit: a copy of the course with every solution region turned into a TODO.

`python -m utils.student --out DIR` copies the course's files (git's tracked and untracked-but-not-
ignored files, results/ included, utils/answers/ left out) into DIR and replaces each region marked
in the solutions

    // BEGIN SOLUTION: what the student writes here         (CUDA / C++: .cu .cuh .h .cpp ...)
    ...solution code...
    // END SOLUTION

    # BEGIN SOLUTION: what the student writes here          (Python)
    ...solution code...
    # END SOLUTION

by a TODO that still compiles and imports:
  CUDA / C++  `// TODO(student): <text>`; the kernel then leaves its outputs unwritten, so the
              tests (which NaN-poison every output buffer) fail on the values, not on the build.
  Python      `raise NotImplementedError("TODO(student): <text> - see <file>")`.
Inside a region, a comment line `// STUB: <code>` (Python: `# STUB: <code>`) becomes `<code>` in
the kit: the minimal code the rest of the file needs to compile (a declaration, a return value).

A region may hold the answer to an earlier TODO in another form (a later kernel that reuses the
step): it is marked too, so that no file of the kit holds an answer (utils/test_student.py checks
that no solution code is left anywhere in the kit), and its text starts with "Port of " and names
the earlier TODO: TODO.md lists such ports after their lesson's own TODOs.

The kit also gets its own README.md (utils/student_readme.md, in place of the course's), TODO.md
(every TODO with its file and line, by lesson) and a conftest.py that appends the TODOs still
present in a lesson to the message of each of that lesson's failing tests, so a failure points at
the code to write. Lessons are the folders whose manifest.json gives an `order` (utils/MANIFEST.md).
Left out: the generator (this file, its test, the README template) and the instructors' answer keys.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

C_SUFFIXES = (".cu", ".cuh", ".h", ".hpp", ".cpp", ".cc", ".c")
PY_SUFFIXES = (".py",)
KIT_README = "utils/student_readme.md"  # becomes the kit's README.md
# The generator, its test and its README template stay out of the kit (a kit has no solutions to
# strip), and so do the instructors' answer keys.
EXCLUDED = ("utils/student.py", "utils/test_student.py", KIT_README)
EXCLUDED_FOLDERS = ("utils/answers/",)
TODO_TAG = "TODO(student)"
PORT_PREFIX = "Port of "  # a TODO that repeats an earlier one in a later kernel
DEFAULT_TODO = "write this part (see the phase README)"


class StudentKitError(RuntimeError):
    """A malformed marker (nested, unclosed, END without BEGIN); the message names file and line."""


@dataclass
class Todo:
    path: str   # relative to the kit / repository root
    line: int   # 1-based line of the TODO in the kit's file
    text: str


def _marker_patterns(comment: str):
    c = re.escape(comment)
    begin = re.compile(rf"^(?P<indent>[ \t]*){c} BEGIN SOLUTION(?::[ \t]*(?P<text>.*?))?[ \t]*$")
    end = re.compile(rf"^[ \t]*{c} END SOLUTION[ \t]*$")
    stub = re.compile(rf"^[ \t]*{c} STUB: ?(?P<code>.*)$")
    return begin, end, stub


def comment_style(path: str | Path) -> str | None:
    suffix = Path(path).suffix
    if suffix in C_SUFFIXES:
        return "//"
    if suffix in PY_SUFFIXES:
        return "#"
    return None


def find_regions(text: str, path: str = "<text>") -> list[tuple[int, int, str]]:
    """(begin line, end line, TODO text) of every marked region, 0-based; raises on bad markers."""
    style = comment_style(path)
    if style is None:
        return []
    begin_re, end_re, _ = _marker_patterns(style)
    regions, start, todo = [], None, ""
    for n, line in enumerate(text.split("\n")):
        if (m := begin_re.match(line)):
            if start is not None:
                raise StudentKitError(f"{path}:{n + 1}: BEGIN SOLUTION inside the region opened at line {start + 1}")
            start, todo = n, (m.group("text") or "").strip() or DEFAULT_TODO
        elif end_re.match(line):
            if start is None:
                raise StudentKitError(f"{path}:{n + 1}: END SOLUTION without a BEGIN SOLUTION")
            regions.append((start, n, todo))
            start = None
    if start is not None:
        raise StudentKitError(f"{path}:{start + 1}: BEGIN SOLUTION is never closed by END SOLUTION")
    return regions


def transform(text: str, path: str) -> tuple[str, list[Todo]]:
    """The starter version of one file's text, and its TODOs (lines in the returned text)."""
    style = comment_style(path)
    regions = find_regions(text, path)
    if not regions:
        return text, []
    begin_re, _, stub_re = _marker_patterns(style)
    lines = text.split("\n")
    out: list[str] = []
    todos: list[Todo] = []
    pos = 0
    for start, end, todo in regions:
        out.extend(lines[pos:start])
        indent = begin_re.match(lines[start]).group("indent")
        if style == "//":
            out.append(f"{indent}// {TODO_TAG}: {todo}")
        else:
            out.append(f"{indent}raise NotImplementedError({f'{TODO_TAG}: {todo} - see {path}'!r})")
        todos.append(Todo(path, len(out), todo))
        for line in lines[start + 1:end]:
            if (m := stub_re.match(line)):
                out.append(f"{indent}{m.group('code')}")
        pos = end + 1
    out.extend(lines[pos:])
    return "\n".join(out), todos


def course_files(root: Path = REPO_ROOT) -> list[str]:
    """The course's files relative to root: git's tracked and untracked-but-not-ignored files
    (or, outside a git checkout, every file but build outputs and caches)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root, capture_output=True, check=True).stdout.decode().split("\0")
        files = [f for f in listed if f and (root / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        skip = {".git", ".venv", "build", "__pycache__", ".pytest_cache", "gpu_results"}
        files = [str(p.relative_to(root)) for p in root.rglob("*")
                 if p.is_file() and not skip & set(p.relative_to(root).parts)]
    return sorted(f for f in set(files) - set(EXCLUDED) if not f.startswith(EXCLUDED_FOLDERS))


def generate(out: str | Path, root: Path = REPO_ROOT) -> list[Todo]:
    """Write the starter kit into `out` (created; must be empty or absent). Returns its TODOs."""
    out = Path(out).resolve()
    root = Path(root).resolve()
    if out == root or out in root.parents:
        raise StudentKitError(f"--out {out} would overwrite the course itself: pick another folder")
    if out.exists() and any(out.iterdir()):
        raise StudentKitError(f"--out {out} is not empty: pick a new folder or remove it first")
    files = [f for f in course_files(root) if f != "README.md"]  # the kit has its own README
    todos: list[Todo] = []
    for rel in files:
        src, dst = root / rel, out / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if comment_style(rel) is not None:
            text = src.read_text()
            new_text, file_todos = transform(text, rel)
            if file_todos:
                dst.write_text(new_text)
                shutil.copymode(src, dst)
                todos.extend(file_todos)
                continue
        shutil.copy2(src, dst)
    if (out / "conftest.py").exists():
        raise StudentKitError("the course has a root conftest.py: merge the kit's TODO hook into it")
    (out / "conftest.py").write_text(KIT_CONFTEST)
    shutil.copyfile(root / KIT_README, out / "README.md")
    (out / "TODO.md").write_text(todo_markdown(todos))
    return todos


def lesson_folders() -> dict[str, str]:
    """Folder (relative to the repository root) -> name of every lesson, from the manifests."""
    from utils.manifest import lessons

    return {m["_dir"].relative_to(REPO_ROOT).as_posix(): m["name"] for m in lessons()}


def lesson_of(path: str, folders: dict[str, str]) -> str:
    """The lesson whose folder holds the file (the deepest one), else the file's top folder."""
    holders = [f for f in folders if path.startswith(f + "/")]
    return folders[max(holders, key=len)] if holders else path.split("/")[0]


def todo_markdown(todos: list[Todo]) -> str:
    lines = ["# Student starter kit: what to write", "",
             "Each item is a `TODO(student)` in the code: the solution's code was removed there, so the",
             "lesson's tests fail on a GPU until you write it (README.md says what runs without one).",
             "Build with `make build`, test with `python -m pytest LESSON_DIR`. Delete a TODO line once",
             "you have written its part: the failing tests list the TODOs still left in their lesson.",
             "A lesson's ports come last: each repeats an earlier TODO in a later kernel.", ""]
    folders = lesson_folders()
    by_lesson: dict[str, list[Todo]] = {}
    for t in todos:
        by_lesson.setdefault(lesson_of(t.path, folders), []).append(t)
    for lesson, items in by_lesson.items():
        own = [t for t in items if not t.text.startswith(PORT_PREFIX)]
        ports = [t for t in items if t.text.startswith(PORT_PREFIX)]
        lines += ["", f"## {lesson}", ""] + [f"- [ ] `{t.path}:{t.line}` {t.text}" for t in own]
        if ports:
            lines += ["", "Ports:", ""] + [f"- [ ] `{t.path}:{t.line}` {t.text}" for t in ports]
    return "\n".join(lines).replace("\n\n\n", "\n\n") + "\n"


def extension_packages_touched(todos: list[Todo], root: Path) -> list[str]:
    """The extension packages (utils.build.extension_packages) whose sources hold a TODO."""
    from utils.build import extension_packages, module_file

    touched = []
    for package in extension_packages():
        source = module_file(package, root)
        if not source.exists():
            continue
        folder = source.parent.relative_to(root).as_posix()
        module_text = source.read_text()
        for t in todos:
            path = Path(t.path)
            if path.parent.as_posix() != folder:
                continue
            # A .cu / .cpp belongs to the packages that list it; a header to every package beside it.
            if path.suffix in (".cu", ".cpp", ".cc", ".c") and f'"{path.name}"' not in module_text:
                continue
            touched.append(package)
            break
    return touched


# conftest.py of the kit: a failing test's report gets the TODOs still left in its lesson.
KIT_CONFTEST = r'''"""Student starter kit: a failing test's message lists the TODO(student) items left in its lesson."""

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
CODE_SUFFIXES = {".cu", ".cuh", ".h", ".hpp", ".cpp", ".cc", ".c", ".py"}


def lessons():
    """Folder (relative to the kit) -> order of every lesson, from the kit's manifest.json files."""
    found = {}
    for path in [*ROOT.glob("*/manifest.json"), *ROOT.glob("*/*/manifest.json")]:
        order = json.loads(path.read_text()).get("order")
        if order is not None:
            found[path.parent.relative_to(ROOT)] = order
    return found


def todos_in(folders):
    found = []
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in CODE_SUFFIXES or path.name.startswith("test_") or not path.is_file():
                continue
            for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if "TODO(student)" in line:
                    text = line.split("TODO(student):", 1)[-1].strip()
                    if "NotImplementedError(" in line:
                        text = text[:-2]  # the string's closing quote and parenthesis
                    found.append(f"  {path.relative_to(ROOT)}:{n}: {text}")
    return found


def todos_for(test_file):
    """The TODOs of the lesson that holds the test; a lesson with none of its own (final) builds
    on the lessons before it, and a test from outside the kit (hidden tests) may test any."""
    orders = lessons()
    try:
        rel = test_file.resolve().relative_to(ROOT)
    except ValueError:
        return todos_in(sorted(orders))
    holders = [f for f in orders if f in rel.parents]
    if not holders:
        return []
    holder = max(holders, key=lambda f: len(f.parts))
    return todos_in([holder]) or todos_in(sorted(f for f in orders if orders[f] < orders[holder]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    left = todos_for(Path(str(item.fspath)))
    if not left:
        return
    title = "starter kit: TODO(student) still in the code this test exercises"
    longrepr = report.longrepr
    if hasattr(longrepr, "addsection"):
        longrepr.addsection(title, "\n".join(left))
        crash = getattr(longrepr, "reprcrash", None)
        if crash is not None:  # the one-line summary (pytest -ra) names the first TODO too
            first, _, rest = crash.message.partition("\n")
            pointer = f"[{len(left)} TODO(student) left, first at {left[0].strip().split(': ')[0]}]"
            crash.message = f"{first} {pointer}" + (f"\n{rest}" if rest else "")
    else:
        report.longrepr = f"{report.longreprtext}\n\n{title}:\n" + "\n".join(left)
'''


COURSE_PYTHON_FILE = ".course-python"  # utils/env.sh reads it


def share_environment(out: Path) -> None:
    """Name this interpreter (the course's environment, which has torch and the rest) in the kit's
    .course-python: utils/env.sh in the kit then runs with it instead of installing another .venv
    of several GB. Where it no longer works (the kit moved to another machine), env.sh goes on to
    its other choices. The file names a path of this machine, so the kit's git ignores it."""
    (out / COURSE_PYTHON_FILE).write_text(os.path.abspath(sys.executable) + "\n")
    gitignore = out / ".gitignore"
    lines = gitignore.read_text().splitlines() if gitignore.exists() else []
    if f"/{COURSE_PYTHON_FILE}" not in lines:
        gitignore.write_text("\n".join([*lines, f"/{COURSE_PYTHON_FILE}"]) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder to write the kit into (new or empty)")
    args = parser.parse_args(argv)
    try:
        todos = generate(args.out)
    except StudentKitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    share_environment(Path(args.out))
    files = sorted({t.path for t in todos})
    print(f"starter kit in {Path(args.out).resolve()}: {len(todos)} TODOs in {len(files)} files "
          f"(listed in TODO.md); it runs with this interpreter, {sys.executable} (.course-python)")
    for path in files:
        print(f"  {path}: {sum(t.path == path for t in todos)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
