"""The one renderer: README tables and plots drawn from results files by declaration.

A folder whose README carries measured numbers holds a `manifest.json` beside it that declares,
as data, every table and plot (utils/MANIFEST.md describes each field). A generated table sits in
the README between one kind of marker, which names it:

    <!-- table:headline -->
    ...rewritten by `python -m utils.render`...
    <!-- /table:headline -->

Everything else in a README is written by hand. This module writes tables and plots, never
sentences: each table ends with one line naming its source file and where it was measured.

    python -m utils.render              every manifest of the course
    python -m utils.render phase2_naive one folder's
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from utils.build import REPO_ROOT
from utils import gpu_checks, grading_doc, plots
from utils.manifest import field, load_doc, load_manifest, manifests, matches, peer_row, rows_at

MARKER = re.compile(r"(<!-- table:([\w.-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)


# ------------------------------------------------------------------------------------------------
# Cells


def fmt(x, digits: int = 3) -> str:
    """3 significant digits, thousands separators from 1,000 on, '–' for a missing value."""
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return str(x)
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def cell(column: dict, row: dict, rows: list[dict], ceilings: dict):
    """One column's value for a row (None where it cannot be computed). Column kinds:
    {"key": field, "scale": s}; {"speedup_over": impl} = that peer's ms / this row's ms (or the
    peer's `key` / this row's `key`); {"share_of": ceiling, "key": field, "scale": s} =
    field * scale / ceilings[ceiling]. A dotted key reads a nested field ('us.attention')."""
    if "speedup_over" in column:
        return speedup(row, peer_row(rows, row, column["speedup_over"]), column.get("key", "ms"))
    value = field(row, column["key"])
    if value is None or isinstance(value, (str, bool)):
        return value
    value = value * column.get("scale", 1)
    if "share_of" in column:
        ceiling = ceilings.get(column["share_of"])
        return value / ceiling if ceiling else None
    return value


def speedup(row: dict, other: dict | None, key: str = "ms"):
    """How many times faster `row` is than `other`: other's `key` / row's (None without both)."""
    theirs, ours = (field(other, key) if other else None), field(row, key)
    return theirs / ours if theirs is not None and ours else None


def kernel_name(name: str) -> str:
    """A kernel's name as ncu or torch.profiler print it, without `void`s, namespaces and parameters."""
    name = re.sub(r"\bvoid\s+|\(anonymous namespace\)::|<unnamed>::|\b\w+::(?=[\w<~(])", "", name)
    depth = 0
    for n, ch in enumerate(name):
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0 and n > 0:
            return name[:n].rstrip()
    return name


def shortened(text: str, max_chars: int | None) -> str:
    return text if max_chars is None or len(text) <= max_chars else text[:max_chars - 1] + "…"


def formatted(column: dict, value, extra_digits: int = 0) -> str:
    """A cell's text; extra_digits adds decimals to a ratio or a percentage."""
    if value is None:
        return "–"
    if column.get("format") == "kernel":
        return f"`{shortened(kernel_name(value), column.get('max_chars'))}`"
    if isinstance(value, str):
        return shortened(value, column.get("max_chars"))
    if column.get("format") == "pct" or "share_of" in column:
        return f"{100 * value:.{extra_digits}f}%" if abs(value) >= 0.01 else f"{100 * value:.2g}%"
    if column.get("format") == "x":
        return f"{value:.{2 + extra_digits}f}x"
    return fmt(value, column.get("digits", 3))


def label(column: dict) -> str:
    if "label" in column:
        return column["label"]
    if "speedup_over" in column:
        return f"× {column['speedup_over']}"
    return column["key"]


# ------------------------------------------------------------------------------------------------
# Tables


def environment(doc: dict, source: Path) -> str:
    e = doc["env"]
    where = source.relative_to(REPO_ROOT).as_posix() if source.is_relative_to(REPO_ROOT) else source.name
    return (f"_{where}: {e['gpu']}, torch {e['torch']}, CUDA {e['cuda']}, {e['date'][:10]}, "
            f"commit {e['commit']}._")


def table_lines(table: dict, manifest: dict) -> list[str]:
    """The Markdown of one declared table (a note in place of it where its results are missing)."""
    doc, source = load_doc(manifest, table.get("source"))
    if doc is None:
        return [f"_No results yet: {source.name} is written by a GPU run._"]
    rows = rows_at(doc, table.get("rows", "rows"))
    chosen = [r for r in rows if matches(r, table.get("where", {}))]
    if "sort" in table:
        chosen = sorted(chosen, key=lambda r: tuple(_sort_key(r, k) for k in table["sort"]))
    columns = table["columns"]
    bold = table.get("bold", {})
    lines = ["| " + " | ".join(label(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    for r in chosen:
        cells = [formatted(c, cell(c, r, rows, doc.get("ceilings", {}))) for c in columns]
        if bold and matches(r, bold):
            cells[0] = f"**{cells[0]}**"
        lines.append("| " + " | ".join(cells) + " |")
    if not chosen:
        return [f"_No rows yet: the run in {source.name} (commit {doc['env']['commit']}) measured none of "
                "this table; its script's next GPU run does._"]
    return [*lines, "", environment(doc, source)]


def _sort_key(row: dict, key):
    """A sort key is a field (ascending, missing last) or {"key": field, "values": [...]}: that
    field's values in the declared order, others last."""
    if isinstance(key, dict):
        value = row.get(key["key"])
        return (0, key["values"].index(value)) if value in key["values"] else (1, 0)
    value = row.get(key)
    return (value is None, 0 if value is None else int(value) if isinstance(value, bool) else value)


def measured_against(column: dict, value, bound: float) -> str:
    """A target's measured value as `formatted` writes it, with one or two more digits where it
    would otherwise print as the bound itself (0.998x under a bound of 1.00x reads "1.00x ... no")."""
    for extra in (0, 1, 2):
        text = formatted(column, value, extra)
        if value is None or value == bound or text != formatted(column, bound, extra):
            break
    return text


def target_lines(table: dict, manifest: dict) -> list[str]:
    """A table of declared targets: each compares one row's speed with a peer's (`at_least`, a
    ratio of the peer's ms to the row's, or of the peer's `key` to the row's), with the same impl's
    row where the fields of `against` differ (the same ratio), or one field with a bound (`key` and
    `at_least`; with `share_of`, the field as a share of that measured ceiling)."""
    doc, source = load_doc(manifest, table.get("source"))
    if doc is None:
        return [f"_No results yet: {source.name} is written by a GPU run._"]
    rows = rows_at(doc, table.get("rows", "rows"))
    lines = ["| target | measured | needed | met |", "|---|---|---|---|"]
    for target in table["targets"]:
        found = [r for r in rows if matches(r, target["where"])]
        if "against" in target:
            column = {"format": "x"}
            other = [r for r in rows if matches(r, {**target["where"], **target["against"]})]
            value = speedup(found[0], other[0] if other else None, target.get("key", "ms")) if found else None
        else:
            column = {"speedup_over": target["peer"], "key": target.get("key", "ms"), "format": "x"} if "peer" in target \
                else {"key": target["key"], "scale": target.get("scale", 1), "format": target.get("format"),
                      **({"share_of": target["share_of"]} if "share_of" in target else {})}
            value = cell(column, found[0], rows, doc.get("ceilings", {})) if found else None
        need = formatted(column, target["at_least"])
        met = None if value is None else value >= target["at_least"]
        lines.append(f"| {target['name']} | {measured_against(column, value, target['at_least'])} | ≥ {need} | "
                     f"{fmt(met)} |")
    return [*lines, "", environment(doc, source)]


KINDS = {"table": table_lines, "targets": target_lines}
# Tables filled wherever their markers stand, with no declaration: name -> fn(manifest) -> lines.
BUILTIN = {"checks": gpu_checks.checks_lines, "grading": grading_doc.grading_lines}


def render_tables(manifest: dict) -> list[str]:
    """Rewrite every declared table of the manifest's README, and every built-in one placed there
    (BUILTIN); the names of those written."""
    readme = manifest["_dir"] / manifest.get("readme", "README.md")
    text = readme.read_text()
    declared = {t["name"]: t for t in manifest.get("tables", [])}
    placed = {m.group(2) for m in MARKER.finditer(text)}
    missing = sorted(set(declared) - placed)
    if missing:
        raise ValueError(f"{readme} has no markers for the tables {missing}")

    def replace(m: re.Match) -> str:
        table = declared.get(m.group(2))
        if table is not None:
            body = KINDS[table.get("kind", "table")](table, manifest)
        elif m.group(2) in BUILTIN:
            body = BUILTIN[m.group(2)](manifest)
        else:
            return m.group(0)
        return m.group(1) + "\n".join(body) + "\n" + m.group(4)

    new = MARKER.sub(replace, text)
    if new != text:
        readme.write_text(new)
    return sorted(set(declared) | (placed & set(BUILTIN)))


def render(folder: Path) -> None:
    """Tables and plots of one folder's manifest."""
    manifest = load_manifest(folder)
    names = render_tables(manifest)
    drawn = plots.draw_all(manifest)
    where = manifest["_dir"].relative_to(REPO_ROOT).as_posix()
    print(f"{where}: {len(names)} tables, {len(drawn)} plots from the results files", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    folders = [REPO_ROOT / a for a in argv] if argv else [m.parent for m in manifests()]
    for folder in folders:
        render(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
