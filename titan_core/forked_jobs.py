"""Test jobs forked from one interpreter that has imported torch and the core once.

A fresh ``python -m titan_core.run`` spends about 10 s of a core importing torch, the core, torch's compiler and
the datasets library before the job's first line runs, and a plugin's tests run dozens of tiny jobs (the
core's suite, hundreds). The parity harness (:func:`titan_core.testing.run_job`) therefore asks a server, one
per test process, which has made those imports once: for each job it forks a child that takes the job's
environment, search path, working directory and output files, and runs ``titan_core.run`` as ``python -m``
would, to the interpreter's normal exit. Whatever the server's imports printed opens each job's stdout and
stderr, so a test of a quiet start still sees it. A setting a library reads from the environment as it is
imported (``TORCHINDUCTOR_*``, ``HF_HUB_OFFLINE``) has the server's value, the test process's at its first job.
Set ``TITAN_FRESH_INTERPRETER=1`` to start every job as its own interpreter instead.

    python -m titan_core.forked_jobs FD   (one JSON request a line on stdin, one answer a line on pipe FD)
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_core.launch.main import WORKER_IMPORTS

__all__ = ["FRESH", "ForkedJobs", "fresh_interpreter"]

FRESH = "TITAN_FRESH_INTERPRETER"


def fresh_interpreter() -> bool:
    """Whether jobs start as interpreters of their own (``TITAN_FRESH_INTERPRETER=1``)."""
    return os.environ.get(FRESH, "") not in ("", "0")


class ForkedJobs:
    """The client: a server process started on first use, one job at a time."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._answers = -1  # the read end of the server's answers
        self._said = ("", "")  # what the server's imports wrote to stdout and stderr

    def run(self, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run ``python -m titan_core.run *argv`` in a child of the server; as :func:`subprocess.run` would,
        with its output captured (a job still running after ``timeout`` seconds is killed, with its workers,
        and raises :class:`subprocess.TimeoutExpired`)."""
        if self._server is None or self._server.poll() is not None:
            self._start()
        with tempfile.TemporaryDirectory(prefix="titan-job-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            server = self._server
            assert server is not None and server.stdin is not None, "started above, reading a pipe (stdin=PIPE)"
            server.stdin.write(json.dumps(request).encode() + b"\n")
            pid = self._answer(None)["pid"]
            try:
                returncode = self._answer(timeout)["returncode"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)  # the job and the workers it forked
                self._answer(None)
                raise subprocess.TimeoutExpired(argv, timeout, *self._output(out, err)) from None
            return subprocess.CompletedProcess(argv, returncode, *self._output(out, err))

    def _start(self) -> None:
        if self._answers >= 0:
            os.close(self._answers)
        self._answers, answers = os.pipe()
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            self._server = subprocess.Popen([sys.executable, "-m", __name__, str(answers)], stdin=subprocess.PIPE,
                                            stdout=out, stderr=err, pass_fds=(answers,), bufsize=0)
            os.close(answers)
            try:
                self._answer(None)  # ready: its imports are done
            except RuntimeError as ended:
                raise RuntimeError(f"{ended}\n{_read(err)[-3000:]}") from None
            self._said = (_read(out), _read(err))

    def _output(self, out: Path, err: Path) -> tuple[str, str]:
        return self._said[0] + out.read_text(), self._said[1] + err.read_text()

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line, read unbuffered so that waiting on the pipe sees every byte sent."""
        line = b""
        while not line.endswith(b"\n"):
            if not select.select([self._answers], [], [], timeout)[0]:
                raise TimeoutError
            chunk = os.read(self._answers, 1)
            if not chunk:
                raise RuntimeError(f"the job server (python -m {__name__}) ended; set {FRESH}=1 to run without it")
            line += chunk
        return json.loads(line)


def _read(stream) -> str:
    stream.seek(0)
    return stream.read()


def _serve(answers_fd: int) -> None:
    """Import once, then fork a child per request; the child leaves this loop to run its job."""
    for module in WORKER_IMPORTS:
        importlib.import_module(module)
    base_path = [entry for entry in sys.path[1:] if entry not in _python_path(os.environ)]
    answers = os.fdopen(answers_fd, "w")
    running: list[int] = []

    def stop(number, frame):  # Ctrl-C or SIGTERM on the tests: the job, in a group of its own, stops with them
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        os._exit(128 + number)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    sys.stdout.flush()  # what the imports printed, for the client to read; and no buffer for a child to repeat
    sys.stderr.flush()
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            answers.close()
            _become_job(request, base_path)
            return
        running[:] = [pid]
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        running.clear()
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


def _python_path(env) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _become_job(request: dict, base_path: list[str]) -> None:
    """This child as ``python -m titan_core.run`` started with the request's environment and files."""
    os.setpgid(0, 0)  # its own group, so that a timeout kills the workers with it
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # SIGPIPE stays ignored, as Python starts
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = [request["cwd"], *_python_path(request["env"]), *base_path]
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("titan_core.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
