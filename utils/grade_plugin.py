"""pytest plugin of the grader (`pytest -p utils.grade_plugin`): writes the node ids collected and
each test's outcome to the JSON file named by $GRADE_OUTCOMES.

    {"collected": [node id, ...],
     "tests": {node id: {"outcome": passed|failed|error|skipped|xfailed, "message": ..., "seconds": ...}}}

A module that fails to import is recorded under its own node id with outcome "error" (its tests are
then missing from "collected"). The first outcome that is not a pass wins: a failed call stays
failed even if its teardown errs too.
"""

from __future__ import annotations

import json
import os

COLLECTED: list[str] = []
TESTS: dict[str, dict] = {}


def _message(report) -> str:
    """A skip's reason, or a failure's crash line with the end of its traceback."""
    if isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
    tail = "\n".join(report.longreprtext.strip().splitlines()[-6:])
    return f"{crash}\n{tail}" if crash else tail


def _outcome(report) -> str:
    if report.skipped:
        return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "passed"


def pytest_collectreport(report):
    if report.failed:
        TESTS[report.nodeid] = {"outcome": "error", "message": _message(report), "seconds": 0.0}


def pytest_collection_finish(session):
    COLLECTED.extend(item.nodeid for item in session.items)


def pytest_runtest_logreport(report):
    record = TESTS.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
    record["seconds"] += report.duration
    outcome = _outcome(report)
    if record["outcome"] == "passed" and outcome != "passed":
        record["outcome"], record["message"] = outcome, _message(report)


def pytest_sessionfinish(session):
    path = os.environ.get("GRADE_OUTCOMES")
    if path:
        with open(path, "w") as handle:
            json.dump({"collected": COLLECTED, "tests": TESTS}, handle)
