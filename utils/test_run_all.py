"""The main job's archive and its four parts (CPU only)."""

import tarfile
import time

from utils import run_all


def _names(path):
    with tarfile.open(path) as tar:
        return [m.name for m in tar.getmembers() if m.isfile()]


def test_archive_holds_only_results_written_since_the_start(tmp_path):
    everything = _names(run_all.archive(tmp_path / "all"))
    assert "phase5_fused/results/metrics.json" in everything and "utils/results/ceilings.json" in everything
    later = _names(run_all.archive(tmp_path / "none", since=time.time() + 3600))
    assert not [n for n in later if "/results/" in n]


def test_the_parts_cover_every_phase_script_once():
    scripts = [s for part in run_all.PARTS.values() for s in part["scripts"]]
    assert sorted(scripts) == sorted(run_all.PHASE_SCRIPTS)
    assert sum(part.get("grade", False) for part in run_all.PARTS.values()) == 1
    assert sum(part.get("sanitize", False) for part in run_all.PARTS.values()) == 1
