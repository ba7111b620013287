"""Stopping a run on SIGTERM or SIGINT (a cluster's preemption, Ctrl-C) at a step every rank agrees on.

Each rank notes a signal instead of dying of it. The ranks may note it at different moments, so they agree
by a collective: at the end of every step each rank starts a small all-reduce (MAX) of the signal it has
seen, on a gloo group of its own so that it runs beside the step without making the host wait for the
device, and reads the result at the end of the next step. Every rank therefore stops after the same step,
one step after the first rank saw the signal, and the core saves the training state before exiting
(``save_checkpoint(preempted=True)``). A one-rank run reads its own signal directly.
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    """Catches SIGTERM and SIGINT while entered; ``agreed()`` says, on every rank alike, when to stop."""

    def __init__(self, world_size: int):
        self.received = 0
        self.group = dist.new_group(backend="gloo") if world_size > 1 else None
        self.reduced = torch.zeros(1, dtype=torch.int32)
        self.pending: dist.Work | None = None
        self.previous: dict[int, signal._HANDLER] = {}  # _HANDLER: typeshed's type of what signal.signal returns

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # Python handles signals there only
            for number in STOP_SIGNALS:
                self.previous[number] = signal.signal(number, self._note)
        return self

    def __exit__(self, kind, error, traceback) -> None:
        if self.pending is not None and error is None:  # a failed rank's peers may be gone: it does not wait
            self.pending.wait()
        self.pending = None
        for number, handler in self.previous.items():
            signal.signal(number, handler)

    def _note(self, number: int, frame) -> None:
        self.received = self.received or number

    def agreed(self) -> signal.Signals | None:
        """The signal every rank stops for after this step, or None to go on. Every rank calls it once per
        step; with several ranks the answer is the one started at the end of the previous step."""
        if self.group is None:
            return signal.Signals(self.received) if self.received else None
        decided = 0
        if self.pending is not None:
            self.pending.wait()
            decided = int(self.reduced.item())
        self.reduced = torch.tensor([self.received], dtype=torch.int32)
        self.pending = dist.all_reduce(self.reduced, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return signal.Signals(decided) if decided else None


def exit_code(stopped: signal.Signals) -> int:
    """The shell's code for a process ended by ``stopped``: 130 for SIGINT, 143 for SIGTERM."""
    return 128 + int(stopped)
