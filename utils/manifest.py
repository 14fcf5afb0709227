"""Manifests: what a folder declares about its results, and how declarations read them.

A folder whose README carries measured numbers holds a `manifest.json` (utils/MANIFEST.md): the
results files it writes, the module that writes them, its tables and plots. Course tooling (the
renderer, the full GPU job, the grader) finds phases through these files, never by importing them.
"""

from __future__ import annotations

import json
from pathlib import Path

from utils.build import REPO_ROOT

# The fields that say which problem a row measured: a peer row must agree on every one the row has.
SHAPE_KEYS = ("op", "B", "H", "S", "Sq", "Sk", "D", "dtype", "causal", "stride", "rows", "hidden",
              "tokens", "inner", "batch", "seq", "M", "N", "K", "H_kv", "window")


def manifests() -> list[Path]:
    """Every manifest.json of the course (the top level, phases, their lessons and final)."""
    found = [REPO_ROOT / "manifest.json", *REPO_ROOT.glob("*/manifest.json"), *REPO_ROOT.glob("*/*/manifest.json")]
    return sorted({p for p in found if p.exists() and ".venv" not in p.parts and "build" not in p.parts})


def lessons() -> list[dict]:
    """The manifests that place a lesson in the course (an `order`), loaded, in course order."""
    loaded = [load_manifest(path.parent) for path in manifests()]
    return sorted((m for m in loaded if "order" in m), key=lambda m: m["order"])


def load_manifest(folder: Path) -> dict:
    path = Path(folder) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["_dir"] = path.parent
    return manifest


def load_doc(manifest: dict, source: str | None) -> tuple[dict | None, Path]:
    """The results document a declaration reads (its `source`, else the manifest's `results`)."""
    path = (manifest["_dir"] / (source or manifest.get("results", "results/metrics.json"))).resolve()
    return (json.loads(path.read_text()) if path.exists() else None), path


def rows_at(doc: dict, path: str) -> list[dict]:
    """The list of records at a dotted path ('rows', 'ncu.kernels'). A dict of records or of lists
    of records ('ncu.records' = {impl: [...]}) is flattened, each record given its key as `impl`;
    a dict of plain values ({name: share}) becomes records {"impl": name, "value": share}."""
    node = doc
    for part in path.split("."):
        node = node.get(part, []) if isinstance(node, dict) else []
    if isinstance(node, dict):
        return [{"impl": key, **(r if isinstance(r, dict) else {"value": r})} for key, records in node.items()
                for r in (records if isinstance(records, list) else [records])]
    return list(node)


def field(row: dict, key: str):
    """A row's field; a dotted key reaches into nested records ('us.attention'), a key that itself
    holds dots ('attention.qk') taken whole first."""
    if key in row or "." not in key:
        return row.get(key)
    head, rest = key.split(".", 1)
    return field(row[head], rest) if isinstance(row.get(head), dict) else None


def matches(row: dict, where: dict | list) -> bool:
    """A `where` value is the field's value, or a list of accepted values; a list of `where`s
    accepts a row that matches any of them."""
    if isinstance(where, list):
        return any(matches(row, alternative) for alternative in where)
    for key, want in where.items():
        have = row.get(key)
        if isinstance(want, list) and not isinstance(have, list):
            if have not in want:
                return False
        elif have != want:
            return False
    return True


def peer_row(rows: list[dict], row: dict, peer: str) -> dict | None:
    """The row of impl `peer` that measured the same problem as `row`."""
    shape = {k: row[k] for k in SHAPE_KEYS if k in row}
    return next((r for r in rows if r.get("impl") == peer and matches(r, shape)), None)
