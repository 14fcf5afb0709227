"""utils.progress: plain lines in a log, a status line only on a terminal, streamed subprocesses (CPU)."""

import sys
import time

from utils.build import REPO_ROOT


def test_progress_redraws_a_status_line_only_on_a_terminal():
    import io

    from utils.progress import Progress, remaining

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log, terminal = io.StringIO(), Terminal()
    for stream in (log, terminal):
        progress = Progress(stream, every=0.0)
        progress.status("running a")
        progress.heartbeat("running b")
        progress.line("a done")
        progress.close()
    assert log.getvalue() == "running b\na done\n"
    assert terminal.getvalue().startswith("\rrunning a") and "\r" + " " * len("running b") + "\r" in terminal.getvalue()
    assert terminal.getvalue().endswith("a done\n")
    assert remaining(1, 4, 30.0) == "about 1 min 30 s left" and remaining(4, 4, 30.0) == ""


def test_stream_process_echoes_logs_and_stops_at_the_timeout(tmp_path, capsys):
    from utils.progress import stream_process

    code = "import sys; print('out'); print('err', file=sys.stderr)"
    assert stream_process([sys.executable, "-c", code], REPO_ROOT, log=tmp_path / "x.log", prefix="> ") == (0, "out\nerr\n")
    assert capsys.readouterr().out == "> out\n> err\n" and (tmp_path / "x.log").read_text() == "out\nerr\n"
    start = time.perf_counter()
    # the timeout holds even while a child left behind keeps the pipe open
    returncode, output = stream_process(["sh", "-c", "echo started; sleep 20 & sleep 20"], REPO_ROOT, timeout=1.0)
    assert returncode is None and output == "started\n" and time.perf_counter() - start < 15
    assert stream_process([sys.executable, "-c", "raise SystemExit(3)"], REPO_ROOT)[0] == 3


def test_the_full_job_logs_each_step(monkeypatch, tmp_path, capsys):
    from utils import run_all

    monkeypatch.setattr(run_all, "LOG_DIR", tmp_path)
    assert run_all.run_logged("hello", [sys.executable, "-c", "print('hi')"])
    assert not run_all.run_logged("fails", [sys.executable, "-c", "raise SystemExit(1)"])
    assert (tmp_path / "hello.log").read_text() == "hi\n" and "hi\n" in capsys.readouterr().out
