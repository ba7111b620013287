"""``python -m titan_core.run [overrides]``: see :mod:`titan_core.launch.main`."""

from titan_core.launch.main import main

if __name__ == "__main__":
    main()
