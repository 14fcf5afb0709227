"""The student starter kit generates, strips every solution region, imports and compiles (no GPU)."""

import os
import shutil
import subprocess
import sys

import pytest

from utils.build import extension_packages
from utils.student import (REPO_ROOT, TODO_TAG, StudentKitError, comment_style, course_files,
                           extension_packages_touched, find_regions, generate, transform)
from utils.testing import requires_toolkit


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    out = tmp_path_factory.mktemp("student") / "kit"
    todos = generate(out)
    return out, todos


def marked_files() -> dict[str, list]:
    """Solution files with marked regions: path -> regions."""
    found = {}
    for rel in course_files(REPO_ROOT):
        if comment_style(rel) is not None:
            regions = find_regions((REPO_ROOT / rel).read_text(), rel)
            if regions:
                found[rel] = regions
    return found


def test_the_solutions_mark_the_kernels_students_write():
    marked = marked_files()
    for phase in ("phase2_naive", "phase3_tiled", "phase4_coalesced", "phase5_fused",
                  "phase6_layernorm_mlp"):
        assert any(p.startswith(phase + "/") for p in marked), f"{phase}: no BEGIN SOLUTION region"
    assert "phase5_fused/fp32/fused_teaching.cu" in marked
    assert "phase6_layernorm_mlp/layer_norm.cu" in marked


def test_every_marked_region_becomes_a_todo(kit):
    out, todos = kit
    marked = marked_files()
    assert {t.path for t in todos} == set(marked)
    for rel, regions in marked.items():
        solution = (REPO_ROOT / rel).read_text().split("\n")
        starter = (out / rel).read_text()
        assert "BEGIN SOLUTION" not in starter and "END SOLUTION" not in starter, rel
        assert starter.count(TODO_TAG) == len(regions), rel
        # Code lines that exist only inside the regions must be gone from the starter.
        inside = {n for a, b, _ in regions for n in range(a, b + 1)}
        outside = {solution[n].strip() for n in range(len(solution)) if n not in inside}
        starter_lines = {line.strip() for line in starter.split("\n")}
        for n in sorted(inside):
            code = solution[n].strip()
            is_comment = code.startswith(("//", "#"))
            if code and not is_comment and code not in outside:
                assert code not in starter_lines, f"{rel}:{n + 1}: solution line left in the kit: {code}"
    for t in todos:
        line = (out / t.path).read_text().split("\n")[t.line - 1]
        assert TODO_TAG in line and t.text in line, f"{t.path}:{t.line}: {line}"


def test_unmarked_files_are_copied_unchanged(kit):
    out, todos = kit
    changed = {t.path for t in todos}
    for rel in course_files(REPO_ROOT):
        if rel not in changed:
            assert (out / rel).read_bytes() == (REPO_ROOT / rel).read_bytes(), rel
    assert not (out / "utils" / "student.py").exists()
    assert (out / "TODO.md").exists() and (out / "conftest.py").exists()


def test_python_regions_raise_not_implemented(tmp_path):
    text = ("def f(x):\n"
            "    y = 1\n"
            "    # BEGIN SOLUTION: return x squared\n"
            "    # STUB: z = 0\n"
            "    return x * x\n"
            "    # END SOLUTION\n")
    starter, todos = transform(text, "phaseX/api.py")
    assert "return x * x" not in starter and "BEGIN SOLUTION" not in starter
    assert len(todos) == 1 and todos[0].line == 3 and todos[0].text == "return x squared"
    namespace = {}
    exec(compile(starter, "api.py", "exec"), namespace)
    with pytest.raises(NotImplementedError, match=r"TODO\(student\): return x squared - see phaseX/api.py"):
        namespace["f"](3)
    assert "    z = 0" in starter


@pytest.mark.parametrize("text, message", [
    ("// BEGIN SOLUTION\n// BEGIN SOLUTION\n// END SOLUTION\n", "inside the region"),
    ("x;\n// END SOLUTION\n", "without a BEGIN"),
    ("// BEGIN SOLUTION: never closed\nx;\n", "never closed"),
])
def test_bad_markers_name_file_and_line(text, message):
    with pytest.raises(StudentKitError, match=message):
        transform(text, "k.cu")


def test_refuses_to_overwrite(tmp_path):
    (tmp_path / "something").write_text("x")
    with pytest.raises(StudentKitError, match="not empty"):
        generate(tmp_path)
    with pytest.raises(StudentKitError, match="overwrite the course"):
        generate(REPO_ROOT)


def test_kit_python_imports(kit):
    out, _ = kit
    packages = sorted(p.parent.name for p in out.glob("*/__init__.py"))
    packages += [p for p in extension_packages() if p not in packages]
    code = "import importlib\n" + "".join(f"importlib.import_module({p!r})\n" for p in packages)
    proc = subprocess.run([sys.executable, "-c", code], cwd=out, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_kit_failure_messages_point_at_the_todos(kit):
    """The kit's conftest appends a lesson's TODOs to the report of its failing tests; a later
    lesson without TODOs of its own points at the earlier lessons', a folder that is no lesson at none."""
    out, todos = kit
    later, tool = out / "zz_later_lesson", out / "zz_tool"
    for folder in (later, tool):
        folder.mkdir()
    (later / "manifest.json").write_text('{"name": "zz_later_lesson", "order": 99}')
    probes = [out / "phase2_naive" / "test_zz_lesson.py", later / "test_zz_later.py", tool / "test_zz_tool.py"]
    for probe in probes:
        probe.write_text("def test_fails():\n    assert False, 'kernel output wrong'\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-ra", "-p", "no:cacheprovider",
                               *(str(p.relative_to(out)) for p in probes)], cwd=out, capture_output=True, text=True,
                              env=dict(os.environ, COLUMNS="1000"))  # summary lines in full
    finally:
        probes[0].unlink()
        for folder in (later, tool):
            shutil.rmtree(folder)
    assert proc.returncode == 1, proc.stdout[-3000:]
    first = next(t for t in todos if t.path.startswith("phase2_naive/"))
    summary = {line.split(" ")[1].split("::")[0]: line for line in proc.stdout.splitlines() if line.startswith("FAILED")}
    assert f"first at {first.path}:{first.line}" in summary["phase2_naive/test_zz_lesson.py"], proc.stdout[-3000:]
    assert "TODO(student) left" in summary["zz_later_lesson/test_zz_later.py"], proc.stdout[-3000:]
    assert "TODO(student)" not in summary["zz_tool/test_zz_tool.py"], proc.stdout[-3000:]


@requires_toolkit
@pytest.mark.compile
def test_kit_extensions_compile(kit):
    """The kit's own utils.build compiles every extension that holds a TODO (in parallel)."""
    out, todos = kit
    packages = extension_packages_touched(todos, out)
    assert packages, "no extension holds a TODO"
    proc = subprocess.run([sys.executable, "-m", "utils.build", *packages], cwd=out,
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-8000:]}"
