"""Execute a notebook in place so that it is committed with its outputs (what a student sees on
opening it): `python -m utils.notebook final/walkthrough.ipynb`. `make run` does it after redrawing
the tables and plots. On a machine without a GPU (or with COURSE_NOTEBOOK_CPU=1) the notebook takes
its CPU path, which draws from the committed results. Execution times and kernel metadata are not
stored, so re-executing with the same results changes nothing but what really changed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def execute(path: Path, timeout: int = 600) -> Path:
    """Run every cell of the notebook at `path` in a fresh kernel and write it back with its outputs."""
    import nbclient
    import nbformat

    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": str(Path(path).parent)}})
    client.execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m utils.notebook NOTEBOOK.ipynb")
        return 2
    try:
        import nbclient  # noqa: F401  (only checks that it is there)
    except ImportError:
        print("nbclient is not installed (pip install nbclient ipykernel): notebook not executed")
        return 0
    os.environ.setdefault("MPLBACKEND", "Agg")
    print(f"executed {execute(Path(args[0]))} with its outputs stored")
    return 0


if __name__ == "__main__":
    sys.exit(main())
