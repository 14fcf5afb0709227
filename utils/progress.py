"""Progress of the course's long jobs (the parallel build, the sweeps, the grader, the full GPU job).

Plain lines, not a progress-bar library: most long work here runs in a process whose output is a
pipe into a log (utils.run_all streams every step into build/logs; the grader streams its pytest
and timing processes; the GPU job's logs are read as text afterwards), where a bar's carriage
returns turn into noise. A line per event (started, finished, how far along, how long) reads the
same in a terminal and in a CI log, and costs no dependency. Only where stdout is a terminal does
`Progress.status` redraw one line in place (what is still running); elsewhere it prints nothing,
and `Progress.heartbeat` prints a plain line now and then instead, so a long silent step in a log
still shows it is alive.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from pathlib import Path


def duration(seconds: float) -> str:
    """42 s, 3 min 05 s, 1 h 02 min."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def remaining(done: int, total: int, seconds: float) -> str:
    """'about 3 min 05 s left' at the pace so far (empty before the first item is done, or after the last)."""
    if done <= 0 or done >= total:
        return ""
    return f"about {duration(seconds / done * (total - done))} left"


class Count:
    """How far a loop of known length is: `tag()` after each item gives '[desc n/total, 1 min 02 s,
    about 3 min left]'. A sweep made of smaller sweeps passes one Count to all of them."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n = total, desc, 0
        self.start = time.perf_counter()

    def step(self) -> str:
        """Count one more item done; its tag."""
        self.n += 1
        return self.tag()

    def tag(self) -> str:
        spent = time.perf_counter() - self.start
        left = remaining(self.n, self.total, spent)
        return f"[{self.desc} {self.n}/{self.total}, {duration(spent)}{', ' + left if left else ''}]"


class Progress:
    """Lines for events and, on a terminal only, one status line redrawn in place.

    line(text): prints a line (from any thread), first clearing the status line if one is shown.
    status(text): on a terminal, redraws the status line; elsewhere does nothing.
    heartbeat(text): where stdout is not a terminal, prints `text` as a line at most every
    `every` seconds; on a terminal, status(text)."""

    def __init__(self, stream=None, every: float = 60.0):
        self.stream = stream or sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every
        self._shown = 0
        self._last_beat = time.perf_counter()
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self._clear()
            self.stream.write(text + "\n")
            self.stream.flush()

    def status(self, text: str) -> None:
        if not self.tty:
            return
        with self._lock:
            text = text[:_columns() - 1]
            self.stream.write("\r" + text.ljust(self._shown))
            self.stream.flush()
            self._shown = len(text)

    def heartbeat(self, text: str) -> None:
        if self.tty:
            self.status(text)
        elif time.perf_counter() - self._last_beat >= self.every:
            self._last_beat = time.perf_counter()
            self.line(text)

    def close(self) -> None:
        with self._lock:
            self._clear()
            self.stream.flush()

    def _clear(self) -> None:
        if self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self._shown = 0


def _columns() -> int:
    import shutil

    return shutil.get_terminal_size((100, 20)).columns


def stream_process(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float | None = None,
                   log: Path | None = None, prefix: str = "") -> tuple[int | None, str]:
    """Run cmd with its output (stdout and stderr together) echoed line by line as it comes, each
    line after `prefix`, and written to `log` if given. Returns (exit status, or None if it ran past
    `timeout` seconds and was killed; its whole output). The process stays in this one's process
    group (a signal to the group, as `timeout` sends, reaches it); a thread reads its output, so
    that the timeout holds even while a child it left behind keeps the pipe open."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            errors="replace")
    lines: list[str] = []

    def pump() -> None:
        with open(log, "w") if log else contextlib.nullcontext() as handle:
            for line in proc.stdout:
                lines.append(line)
                sys.stdout.write(prefix + line)
                sys.stdout.flush()
                if handle:
                    handle.write(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        reader.join(5.0)
        return None, "".join(lines)
    except BaseException:  # interrupted: the child goes too
        proc.kill()
        raise
    reader.join()
    return returncode, "".join(lines)
