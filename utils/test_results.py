"""Results files: the environment stamp and the schema (CPU only)."""

import json

import pytest

from utils import results


def test_write_then_read_round_trip(tmp_path):
    rows = [{"impl": "torch_naive", "op": "attention", "ms": 1.5, "B": 1}]
    path = results.write_results(tmp_path / "m.json", rows, {"dram_TBps": 3.0}, note="x")
    doc = results.read_results(path)
    assert doc["rows"] == rows and doc["note"] == "x" and doc["ceilings"]["dram_TBps"] == 3.0
    for key in results.REQUIRED_ENV_KEYS:
        assert doc["env"][key] not in (None, "")


def test_rows_missing_fields_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="lacks"):
        results.write_results(tmp_path / "m.json", [{"impl": "x", "op": "attention"}])


def test_env_lacking_keys_is_rejected(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"env": {"gpu": "x"}, "ceilings": {}, "rows": []}))
    with pytest.raises(ValueError, match="env lacks"):
        results.read_results(path)


def test_commit_override(monkeypatch):
    monkeypatch.setenv("COURSE_COMMIT", "feedbee")
    assert results.env_stamp()["commit"] == "feedbee"


def test_select():
    rows = [{"impl": "a", "S": 1}, {"impl": "b", "S": 1}, {"impl": "a", "S": 2}]
    assert results.select(rows, impl="a") == [rows[0], rows[2]]
