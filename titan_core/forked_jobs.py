"""Test jobs forked from one interpreter that has imported torch and the core once.

A fresh ``python -m titan_core.run`` spends about 10 s of a core importing torch, the core, torch's compiler and
the datasets library before the job's first line runs, and a plugin's tests run dozens of tiny jobs (the
core's suite, hundreds). The parity harness (:func:`titan_core.testing.run_job`) therefore asks a server, one
per test process, which has made those imports once: for each job it forks a child that takes the job's
environment, search path, working directory and output files, and runs ``titan_core.run`` as ``python -m``
would, to the interpreter's normal exit. Whatever the imports printed is printed again at the start of each
job's output, so a test of a quiet start still sees it. A setting a library reads from the environment as it
is imported (``TORCHINDUCTOR_*``, ``HF_HUB_OFFLINE``) has the server's value, the test process's at its first
job. Set ``TITAN_FRESH_INTERPRETER=1`` to start every job as its own interpreter instead.

    python -m titan_core.forked_jobs   (reads one JSON request a line on stdin, answers on stdout)
"""

from __future__ import annotations

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

__all__ = ["ForkedJobs", "fresh_interpreter"]

FRESH = "TITAN_FRESH_INTERPRETER"
# What a job imports before its first step, which forked children share.
PRELOADED = ("titan_core.launch.main", "torch._dynamo", "datasets")


def fresh_interpreter() -> bool:
    """Whether jobs start as interpreters of their own (``TITAN_FRESH_INTERPRETER=1``)."""
    return os.environ.get(FRESH, "") not in ("", "0")


class ForkedJobs:
    """The client: a server process started on first use, one job at a time."""

    def __init__(self):
        self._server: subprocess.Popen | None = None

    def run(self, argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run ``python -m titan_core.run *argv`` in a child of the server; as :func:`subprocess.run` would,
        with its output captured (a job still running after ``timeout`` seconds is killed, with its workers,
        and raises :class:`subprocess.TimeoutExpired`)."""
        if self._server is None or self._server.poll() is not None:
            self._server = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, bufsize=0)
        with tempfile.TemporaryDirectory(prefix="titan-job-") as folder:
            out, err = Path(folder, "stdout"), Path(folder, "stderr")
            request = {"argv": argv, "env": env, "cwd": os.getcwd(), "stdout": str(out), "stderr": str(err)}
            self._server.stdin.write(json.dumps(request).encode() + b"\n")
            pid = self._answer(None)["pid"]
            try:
                returncode = self._answer(timeout)["returncode"]
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)  # the job and the workers it forked
                self._answer(None)
                raise subprocess.TimeoutExpired(argv, timeout, out.read_text(), err.read_text()) from None
            return subprocess.CompletedProcess(argv, returncode, out.read_text(), err.read_text())

    def _answer(self, timeout: float | None) -> dict:
        """The server's next line, read unbuffered so that waiting on the pipe sees every byte sent."""
        line, fd = b"", self._server.stdout.fileno()
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], timeout)[0]:
                raise TimeoutError
            chunk = os.read(fd, 1)
            if not chunk:
                raise RuntimeError(f"the job server (python -m {__name__}) ended; set {FRESH}=1 to run without it")
            line += chunk
        return json.loads(line)


def _serve() -> None:
    """Import once, then fork a child per request; the child leaves this loop to run its job."""
    with tempfile.TemporaryFile("w+") as imports_said:
        saved = os.dup(2)
        os.dup2(imports_said.fileno(), 2)
        for module in PRELOADED:
            importlib.import_module(module)
        sys.stderr.flush()
        os.dup2(saved, 2)
        imports_said.seek(0)
        said = imports_said.read()
    base_path = [entry for entry in sys.path[1:] if entry not in _python_path(os.environ)]
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _become_job(request, said, base_path)
            return
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


def _python_path(env) -> list[str]:
    return [entry for entry in env.get("PYTHONPATH", "").split(os.pathsep) if entry]


def _become_job(request: dict, said: str, base_path: list[str]) -> None:
    """This child as ``python -m titan_core.run`` started with the request's environment and files."""
    os.setpgid(0, 0)  # its own group, so that a timeout kills the workers with it
    for number in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # SIGPIPE stays ignored, as Python starts
        signal.signal(number, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[:] = [request["cwd"], *_python_path(request["env"]), *base_path]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    for fd, key in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stderr.write(said)
    sys.argv = ["-m", *request["argv"]]
    runpy.run_module("titan_core.run", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    _serve()
