"""``python -m titan_core.compare RUN...``: see :mod:`titan_core.tools.compare`."""

from titan_core.tools.compare import main

if __name__ == "__main__":
    main()
