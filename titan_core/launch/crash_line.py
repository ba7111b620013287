"""The one line a rank that runs in the process the user started (a single-process job, a torchrun rank) prints
when it dies in native code: nothing of that process can print it, so a small process beside it does.

The rank's faulthandler writes into a pipe whose other end this module's ``main`` reads, run by path in its own
interpreter (standard library only: it starts in milliseconds and imports nothing of the job). Whatever arrives
before the pipe closes, which it does when the rank's process ends, is a fatal error's stacks: appended to the
rank's log, and named on stderr in one line. A rank that ends any other way closes the pipe having written
nothing, and this process ends silently.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

__all__ = ["start_crash_line"]


def start_crash_line(log: Path, rank: int) -> subprocess.Popen:
    """Start the process that reports rank ``rank``'s native crash; its ``stdin`` is the pipe to give faulthandler,
    and closing it ends the process. It stays in the job's process group (what kills the job kills it) and
    ignores Ctrl-C and SIGTERM, which the rank answers with its own line."""
    return subprocess.Popen([sys.executable, "-I", "-S", __file__, str(log), str(rank)], stdin=subprocess.PIPE)


def main(log: str, rank: str) -> None:
    for number in (signal.SIGINT, signal.SIGTERM):
        signal.signal(number, signal.SIG_IGN)
    stacks = sys.stdin.buffer.read()
    if not stacks:
        return
    with open(log, "ab") as file:
        file.write(stacks)
    fatal = stacks.decode(errors="replace").strip().splitlines()[0]
    print(f"titan-core: rank {rank} crashed ({fatal}); its stack is in {log}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
