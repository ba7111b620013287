"""Libraries' start-up chatter kept off the user's console: at DEBUG in the rank's log, where it is still found."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger("titan_core")
# torchao, imported by the float8 plugin and by transformers: without its CUDA kernels it warns "Failed to load ...
# .so" for each and "Detected no triton", and its Enum registration trips a pytree deprecation warning. None is
# anything a user can act on; the plugins' own checks refuse what cannot run.
TORCHAO_LOGGERS = ("torchao", "torch.utils._pytree")


class _AtDebug(logging.Handler):
    """Re-logs a library's record at DEBUG on titan_core's logger."""

    def emit(self, record: logging.LogRecord) -> None:
        log.debug("%s: %s", record.name, record.getMessage())


@contextlib.contextmanager
def library_logs_at_debug(*names: str) -> Iterator[None]:
    """The records of the loggers ``names`` (and of their children) at DEBUG on titan_core's logger while inside."""
    loggers = [logging.getLogger(name) for name in names]
    handler, propagates = _AtDebug(), [logger.propagate for logger in loggers]
    for logger in loggers:  # records of child loggers (torchao.kernel.*) reach this handler and stop there
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, propagates):
            logger.removeHandler(handler)
            logger.propagate = propagate
