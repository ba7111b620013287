"""The errors users see as one line, and the exit codes that go with them."""

# The exit code of a job refused for bad input, before any worker starts.
EXIT_BAD_INPUT = 2
# A storage fault (full, read-only or vanished folder): sysexits.h's EX_IOERR, so a scheduler can tell it apart.
EXIT_STORAGE = 74


class ConfigError(Exception):
    """A bad setting, reported as one line: the field, what is wrong with it, and how to fix it.

    The launcher prints it and exits with code 2 before any worker starts.
    """

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(f"{field}: {problem}; fix: {fix}")
        self.field = field


class StorageError(Exception):
    """Writing a folder failed for a reason of the storage (full, read-only, gone), reported as one line: the
    folder, the cause, and what is kept (the checkpoint before it, the shards already written).

    The run exits with ``EXIT_STORAGE``.
    """

    def __init__(self, folder, cause: OSError, kept: str):
        reason = cause.strerror or str(cause)
        super().__init__(f"{folder}: {reason} (errno {cause.errno}); {kept}")
        self.folder = folder
