"""results/*.json with the environment stamp (shared/DESIGN.md, "Results schema").

{"env": {...}, "ceilings": {...}, "rows": [{"impl", "op", "B", "H", "Sq", "Sk", "D", "dtype",
"causal", "ms", "tflops", "gbps", ...}], ...extra sections}
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import torch

from utils.build import REPO_ROOT

REQUIRED_ENV_KEYS = ("gpu", "sms", "torch", "cuda", "driver", "date", "commit")
REQUIRED_ROW_KEYS = ("impl", "op", "ms")


def git_commit() -> str:
    """The checked-out commit (COURSE_COMMIT overrides it, for copies of the tree without .git)."""
    if os.environ.get("COURSE_COMMIT"):
        return os.environ["COURSE_COMMIT"]
    proc = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, text=True, check=False)
    commit = proc.stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                           capture_output=True, text=True, check=False).stdout.strip()
    return commit + ("-dirty" if dirty else "")


def driver_version() -> str:
    proc = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True, check=False)
    return proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else "unknown"


def env_stamp() -> dict:
    """Where and when a result was measured: GPU, SM count, driver, torch, CUDA, date, commit."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu, sms = props.name, props.multi_processor_count
    else:
        gpu, sms = "none", 0
    return {
        "gpu": gpu,
        "sms": sms,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "driver": driver_version() if gpu != "none" else "none",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def write_results(path: str | Path, rows: list[dict], ceilings: dict | None = None, **extra) -> Path:
    """Write rows with the environment stamp and the ceilings they are compared against."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"env": env_stamp(), "ceilings": ceilings or {}, "rows": rows, **extra}
    validate(doc)
    path.write_text(json.dumps(doc, indent=1, default=_jsonable) + "\n")
    return path


def read_results(path: str | Path) -> dict:
    doc = json.loads(Path(path).read_text())
    validate(doc)
    return doc


def validate(doc: dict) -> None:
    """Raise ValueError unless doc follows the results schema."""
    for key in ("env", "ceilings", "rows"):
        if key not in doc:
            raise ValueError(f"results file lacks '{key}'")
    missing = [k for k in REQUIRED_ENV_KEYS if k not in doc["env"]]
    if missing:
        raise ValueError(f"results env lacks {missing}")
    for n, row in enumerate(doc["rows"]):
        lacking = [k for k in REQUIRED_ROW_KEYS if k not in row]
        if lacking:
            raise ValueError(f"results row {n} lacks {lacking}: {row}")


def select(rows: list[dict], **match) -> list[dict]:
    """Rows whose fields equal every keyword given."""
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def _jsonable(value):
    if isinstance(value, torch.dtype):
        return str(value).replace("torch.", "")
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serializable: {type(value)}")
