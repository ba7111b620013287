"""``titan <command> [arguments]``: every titan-core command under one name, as ``tune run`` or ``litgpt finetune``.

The commands are entry points of the group ``titan_core.commands``: the core's own (``run``, ``plan``, ``compare``,
``prepare``) and those a plugin's distribution adds (the checkpoint plugin's ``generate``, lora's ``merge``), so the
core names none of a plugin's. ``titan <command> --help`` is that command's help; ``python -m`` runs each as before.
"""

from __future__ import annotations

import sys
from importlib.metadata import EntryPoint, entry_points

GROUP = "titan_core.commands"
SUMMARY = "titan: train, plan and compare large language models with titan-core (a small core plus plugins)"


def commands() -> dict[str, EntryPoint]:
    return {point.name: point for point in sorted(entry_points(group=GROUP), key=lambda point: point.name)}


def usage(found: dict[str, EntryPoint]) -> str:
    lines = [SUMMARY, "", "usage: titan <command> [arguments]   (titan <command> --help: that command's own)", "",
             "commands:"]
    lines += [f"  {name:<10} {_summary(point)}" for name, point in found.items()]
    return "\n".join(lines)


def _summary(point: EntryPoint) -> str:
    """The first line of the command's docstring: what it does."""
    return ((point.load().__doc__ or "").strip().splitlines() or [point.value])[0]


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    found = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print(usage(found))
        sys.exit(0 if argv else 2)
    name, rest = argv[0], argv[1:]
    if name not in found:
        print(f"titan: error: unknown command '{name}'; fix: use one of {', '.join(found)} (titan --help)",
              file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"titan {name}", *rest]  # each command reads its arguments as its python -m form does
    found[name].load()()


if __name__ == "__main__":
    main()
