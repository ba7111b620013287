"""The one error type users see for bad input, and the exit code that goes with it."""

# The exit code of a job refused for bad input, before any worker starts.
EXIT_BAD_INPUT = 2


class ConfigError(Exception):
    """A bad setting, reported as one line: the field, what is wrong with it, and how to fix it.

    The launcher prints it and exits with code 2 before any worker starts.
    """

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(f"{field}: {problem}; fix: {fix}")
        self.field = field
