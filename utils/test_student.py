"""The student starter kit generates, strips every solution region, leaves no answer anywhere in
the kit, imports and compiles (no GPU)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from utils.build import extension_packages
from utils.manifest import lessons, load_manifest
from utils.student import (KIT_README, PORT_PREFIX, REPO_ROOT, TODO_TAG, StudentKitError, comment_style,
                           course_files, extension_packages_touched, find_regions, generate, transform)
from utils.testing import requires_gpu, requires_toolkit


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


def region_code(rel: str) -> str:
    """The lines inside the solution regions of one course file."""
    lines = (REPO_ROOT / rel).read_text().split("\n")
    return "\n".join(line for a, b, _ in find_regions("\n".join(lines), rel) for line in lines[a + 1:b])


# Each phase's idea, by a line of the code that embodies it: that line must be a student's TODO.
# The second group are later kernels that repeat an earlier TODO's step (ports).
PHASE_IDEAS = {
    "phase2_naive/naive_qk.cu": ["fmaf(q_row[d], k_row[d], acc)"],
    "phase2_naive/naive_softmax.cu": ["l += expf("],
    "phase2_naive/naive_av.cu": ["fmaf(p_row[j], v_col[j * D], acc)"],
    "phase3_tiled/tiled_qk.cu": ["Kt[ty][tx] =", "__syncthreads()", "fmaf(Qs[ty][c], Kt[c][tx], acc)"],
    "phase3_tiled/tiled_av.cu": ["Vs[ty][tx] =", "fmaf(Ps[ty][c], Vs[c][tx], acc)"],
    "phase3_tiled/block_softmax.cu": ["l_t = l_t * expf(m_t - x) + 1.0f", "course::block_reduce_max"],
    "phase4_coalesced/matmul_tiled.cu": [
        "kPad = 4",                                        # padding against bank conflicts
        "*reinterpret_cast<const float4*>(src)",           # coalesced float4 loads
        "As[buf][kk + e][row] = a_stage[l][e]",            # transposed staging
        "load_tiles((t + 1) * BK)", "store_tiles(buf ^ 1)",  # double buffering
        "acc[i][j] = fmaf(a[i], b[j], acc[i][j])",         # register micro-tile
        "*reinterpret_cast<float4*>(c_row + col)"],        # float4 stores
    "phase4_coalesced/softmax_rows.cu": ["*reinterpret_cast<const float4*>(s + j0)", "row_sum<kThreads>"],
    "phase5_fused/fp32/fused_teaching.cu": ["const float alpha = expf(m - m_ref)", "o[d] *= alpha", "m + logf(l)"],
    "phase6_layernorm_mlp/layer_norm.cu": ["const float Kx = to_float(x[base])", "local += t * t",
                                           "team_sum<kWarpPerRow>(local, scratch)",
                                           "course::block_reduce_sum(local, scratch)"],
    "phase5_fused/fp32/fused_v2_register_tiles.cu": ["o[i][c] *= alpha", "o[i][c] * inv"],
    "phase5_fused/fp32/fused_v3_cp_async.cu": ["o[i][c] *= alpha", "o[i][c] * inv"],
    "phase5_fused/fp32/fused_v4_exp2.cu": ["o[i][c] *= alpha", "o[i][c] * inv"],
    "phase5_fused/fp32/fused_fast.cu": ["exp2f(m[i] - m_use)", "log2f(l_total)"],
    "phase5_fused/fp32/fused_v6_tf32x3.cu": ["alpha[r] = exp2f(m[r] - m_use)", "o[W * grp + i][2 * r] * inv"],
    "phase5_fused/tensor_cores/tc_attention.cu": ["o[mt][dn][2 * r] *= alpha", "__frcp_rn(total)"],
    "phase5_fused/tensor_cores/tc_versions.cuh": ["expf(st.m[mt][r] - m_ref)", "1.0f / l_row"],
    "phase5_fused/tensor_cores/tc_v5_exp2.cu": ["tc::exp2_approx(st.m[mt][r] - m_ref)"],
    "phase5_fused/tensor_cores/tc_v6_lazy.cu": ["__any_sync(course::kFullMask, raise)", "st.l[mt][r] *= rescale"],
    "phase5_fused/decode/decode_split.cu": ["exp2f(m[n] - base)", "o[n][e] * inv_l"],
    "phase5_fused/decode/decode_merge.cuh": ["exp2f(weight[s] - lse)"],
    "phase5_fused/hopper/hopper_kernel.cuh": ["tc::exp2_approx(m[h] - m_use)", "o[4 * j + e] *= alpha[e / 2]",
                                              "__frcp_rn(total)"],
    "phase6_layernorm_mlp/linear_tile.cuh": ["acc[i][j] = fmaf(a[i], w[j], acc[i][j])", "activate<ACT>(out)"],
    "phase6_layernorm_mlp/linear.cu": ["*reinterpret_cast<const float4*>(p)", "QuadSwizzle::col(row, k + j)",
                                       "store_tile<kThreads>(a_regs, As[1 - stage])"],
}
PORTS = ("phase5_fused/fp32/fused_v2_register_tiles.cu", "phase5_fused/fp32/fused_v3_cp_async.cu",
         "phase5_fused/fp32/fused_v4_exp2.cu", "phase5_fused/fp32/fused_fast.cu",
         "phase5_fused/fp32/fused_v6_tf32x3.cu",
         "phase5_fused/tensor_cores/tc_attention.cu", "phase5_fused/tensor_cores/tc_versions.cuh",
         "phase5_fused/tensor_cores/tc_v5_exp2.cu", "phase5_fused/tensor_cores/tc_v6_lazy.cu",
         "phase5_fused/decode/decode_split.cu",
         "phase5_fused/decode/decode_merge.cuh", "phase5_fused/hopper/hopper_kernel.cuh",
         "phase5_fused/hopper/hopper_merge.cuh",
         "phase6_layernorm_mlp/linear_tile.cuh",
         "phase6_layernorm_mlp/linear.cu")


def test_the_solutions_mark_each_phases_idea():
    marked = marked_files()
    for rel, fragments in PHASE_IDEAS.items():
        inside = region_code(rel)
        for fragment in fragments:
            assert fragment in inside, f"{rel}: `{fragment}` is not inside a solution region"
    for rel, regions in marked.items():
        ports = [todo.startswith(PORT_PREFIX) for _, _, todo in regions]
        assert all(ports) if rel in PORTS else not any(ports), f"{rel}: ports are the later kernels' TODOs"


def test_launchers_and_ops_stay_given():
    for rel in marked_files():
        assert not rel.endswith("ops.cpp"), rel
        assert "<<<" not in region_code(rel), f"{rel}: a kernel launch inside a solution region"


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
    changed = {t.path for t in todos} | {"README.md"}
    for rel in course_files(REPO_ROOT):
        if rel not in changed:
            assert (out / rel).read_bytes() == (REPO_ROOT / rel).read_bytes(), rel
    assert not (out / "utils" / "student.py").exists()
    assert (out / "TODO.md").exists() and (out / "conftest.py").exists()


def test_answer_keys_and_the_generator_stay_out(kit):
    out, _ = kit
    assert list((REPO_ROOT / "utils" / "answers").glob("*.md")), "the course's answer keys moved"
    assert not (out / "utils" / "answers").exists()
    for rel in ("utils/student.py", "utils/test_student.py", KIT_README):
        assert not (out / rel).exists(), rel
    assert (out / "phase4_coalesced" / "results" / "metrics.json").exists()  # results stay, to compare with


def test_kit_has_its_own_readme_naming_every_file_with_a_todo(kit):
    out, todos = kit
    readme = (out / "README.md").read_text()
    assert readme == (REPO_ROOT / KIT_README).read_text() != (REPO_ROOT / "README.md").read_text()
    for phrase in ("TODO.md", "HANDOUT.md", "Without a GPU", "skipped"):
        assert phrase in readme, phrase
    for path in sorted({t.path for t in todos}):
        assert Path(path).name in readme, f"the kit's README does not name {path}"
    ports_section = readme.split("## TODOs that port an earlier step", 1)[1].split("\n## ", 1)[0]
    for path in PORTS:
        assert Path(path).name in ports_section, f"the kit's README does not say what fails until {path} is ported"
    # The course's headline tables have their markers, so `python -m utils.render` works in the kit,
    # and the kit ships without the reference solution's numbers in them.
    for table in load_manifest(REPO_ROOT)["tables"]:
        marker = f"<!-- table:{table['name']} -->\n"
        assert marker in readme, marker
        assert not readme.split(marker, 1)[1].startswith("|"), f"{table['name']}: numbers in the kit's README"


def test_todo_list_puts_each_lessons_ports_last(kit):
    out, todos = kit
    listed = [line for line in (out / "TODO.md").read_text().splitlines() if line.startswith("- [ ]")]
    assert len(listed) == len(todos)
    fast = [n for n, line in enumerate(listed) if "`phase5_fused/fp32/fused_fast.cu:" in line]
    teaching = [n for n, line in enumerate(listed) if "`phase5_fused/fp32/fused_teaching.cu:" in line]
    assert fast and teaching and max(teaching) < min(fast)


# --- No answer anywhere in the kit ---------------------------------------------------------------
# A solution region's code is normalized (whitespace collapsed; comments, short lines and lines of
# braces dropped); any LEAK_RUN consecutive such lines found in a kit file, normalized the same way,
# are a leak: the kit holds the answer to a TODO.
MIN_CODE_CHARS = 20
LEAK_RUN = 3


def code_lines(text: str, path: str) -> list[str]:
    comment = "#" if comment_style(path) == "#" else "//"
    kept = []
    for line in text.split("\n"):
        code = " ".join(line.split(comment, 1)[0].split())
        if len(code) >= MIN_CODE_CHARS and set(code) - set("{}();, "):
            kept.append(code)
    return kept


def runs(lines: list[str]) -> set[tuple]:
    return {tuple(lines[n:n + LEAK_RUN]) for n in range(len(lines) - LEAK_RUN + 1)}


def leaks(solution_runs: dict[tuple, str], root: Path) -> list[str]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        data = path.read_bytes()
        if b"\0" in data:  # images and other binaries
            continue
        rel = path.relative_to(root).as_posix()
        for run in runs(code_lines(data.decode(errors="ignore"), rel)) & solution_runs.keys():
            found.append(f"{rel} holds the code of {solution_runs[run]}: {run[0]}")
    return found


def test_leak_check_sees_code_through_layout_and_comments(tmp_path):
    solution = ("  a_long_name = first_value + 1;\n"
                "  b_long_name = second_value * 2;\n"
                "  c_long_name = a_long_name + b;\n")
    # The same three lines re-indented, with comments and a brace between them: a leak.
    (tmp_path / "same.cu").write_text("a_long_name =   first_value + 1;  // one\n// two\n"
                                      "b_long_name = second_value * 2;\n}\nc_long_name = a_long_name + b;\n")
    # Two of them only: not a run.
    (tmp_path / "two_lines.cu").write_text("a_long_name = first_value + 1;\nb_long_name = second_value * 2;\n")
    found = leaks({run: "k.cu:1" for run in runs(code_lines(solution, "k.cu"))}, tmp_path)
    assert len(found) == 1 and found[0].startswith("same.cu holds the code of k.cu:1")


def test_no_solution_code_anywhere_in_the_kit(kit):
    out, _ = kit
    solution_runs = {}
    for rel, regions in marked_files().items():
        lines = (REPO_ROOT / rel).read_text().split("\n")
        for a, b, _ in regions:
            for run in runs(code_lines("\n".join(lines[a + 1:b]), rel)):
                solution_runs[run] = f"{rel}:{a + 1}"
    assert len(solution_runs) > 100, "too few solution lines to check"
    assert not leaks(solution_runs, out), "\n".join(leaks(solution_runs, out))


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


def lesson_test_paths() -> list[str]:
    return [path for manifest in lessons() for path in manifest.get("tests", [])]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: the kit's tests run there (and fail)")
def test_kit_lessons_report_no_failure_without_a_gpu(kit):
    """What the kit's README says: on a CPU-only machine an unfinished kit's tests skip, none fails."""
    out, _ = kit
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not compile",
                           *lesson_test_paths()], cwd=out, capture_output=True, text=True)
    assert proc.returncode == 0 and " skipped" in proc.stdout, proc.stdout[-4000:]


@requires_gpu
@requires_toolkit
@pytest.mark.compile
def test_kit_lessons_fail_on_a_gpu_until_their_todos_are_done(kit):
    """On a GPU every lesson with a TODO has a failing test in the unfinished kit."""
    out, todos = kit
    for manifest in lessons():
        folder = manifest["_dir"].relative_to(REPO_ROOT).as_posix()
        if not any(t.path.startswith(folder + "/") for t in todos):
            continue
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               *manifest["tests"]], cwd=out, capture_output=True, text=True)
        assert proc.returncode == 1 and "TODO(student)" in proc.stdout, f"{folder}:\n{proc.stdout[-3000:]}"


def test_the_kit_runs_with_the_course_environment(tmp_path):
    """`make student` names the course's interpreter in the kit's .course-python (ignored by the
    kit's git): the kit's utils/env.sh picks it instead of installing another .venv."""
    from utils.student import share_environment

    (tmp_path / "utils").mkdir()
    shutil.copy(REPO_ROOT / "utils" / "env.sh", tmp_path / "utils" / "env.sh")
    (tmp_path / ".gitignore").write_text(".venv/\n")
    share_environment(tmp_path)
    share_environment(tmp_path)  # once in the ignore list
    assert (tmp_path / ".gitignore").read_text() == ".venv/\n/.course-python\n"
    # (were the file passed over, the invalid COURSE_TORCH would stop the set-up before any install)
    env = {**{k: v for k, v in os.environ.items() if k != "COURSE_PYTHON"}, "COURSE_TORCH": "none"}
    proc = subprocess.run(["sh", str(tmp_path / "utils" / "env.sh")], capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.stdout.strip() == os.path.abspath(sys.executable) and not (tmp_path / ".venv").exists()
