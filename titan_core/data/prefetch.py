"""The next batches of a loader, made on a background thread while the step runs."""

from __future__ import annotations

import copy
import queue
import threading


class Prefetcher:
    """Wraps any loader (an iterator of ``(inputs, labels)`` with ``state_dict``/``load_state_dict``) and
    keeps ``depth`` batches made ahead; ``depth`` 0 makes each batch in the step, as the loader alone would.

    Its position is the loader's as of the batches the step has taken, not of those made ahead, so a
    checkpoint resumes exactly. ``pin`` puts the batches in page-locked memory, for copies to a GPU that do
    not wait for the host.
    """

    def __init__(self, loader, depth: int, pin: bool = False):
        self.loader, self.depth, self.pin = loader, depth, pin
        self._taken = self._snapshot()
        self._queue: queue.Queue | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def __iter__(self):
        return self

    def __next__(self):
        if not self.depth:
            batch = self._make()
            self._taken = self._snapshot()
            return batch
        if self._thread is None:
            self._queue, self._stop = queue.Queue(self.depth), threading.Event()
            self._thread = threading.Thread(target=self._produce, args=(self._queue,), name="titan-core-prefetch",
                                            daemon=True)
            self._thread.start()
        assert self._queue is not None  # made with the thread
        item = self._queue.get()
        if isinstance(item, BaseException):
            raise item
        batch, self._taken = item
        return batch

    def _make(self):
        inputs, labels = next(self.loader)
        return (inputs.pin_memory(), labels.pin_memory()) if self.pin else (inputs, labels)

    def _snapshot(self) -> tuple[dict, dict]:
        metrics = getattr(self.loader, "metrics", None)
        return copy.deepcopy(self.loader.state_dict()), (metrics() if metrics else {})

    def _produce(self, batches: queue.Queue) -> None:
        try:
            while not self._stop.is_set():
                self._put(batches, (self._make(), self._snapshot()))
        except BaseException as error:  # noqa: BLE001 - the step raises it, where the user sees it
            self._put(batches, error)

    def _put(self, batches: queue.Queue, item) -> None:
        while not self._stop.is_set():
            try:
                batches.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def state_dict(self) -> dict:
        return self._taken[0]

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._taken = self._snapshot()

    def metrics(self) -> dict:
        """The loader's own metrics (tokens per source, ...) as of the batches taken."""
        return self._taken[1]

    def close(self) -> None:
        """Stop making batches ahead; the next one is made from the position taken."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self.loader.load_state_dict(self._taken[0])
