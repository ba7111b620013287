"""The docs' examples print what the docs quote: every ```console block of docs/ and the README (``$ command``
lines, a trailing backslash continuing one, each followed by lines it prints; ``...`` stands for lines left out) is
run here, and its quoted lines must appear in its output, in order and exactly. A doc whose example now prints
otherwise fails, rather than telling its readers something the command no longer says."""

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GAP = "..."


def console_blocks() -> list[tuple[str, str, list[str]]]:
    """(file, command, quoted lines) of every ``$`` command in a ```console block."""
    found = []
    for file in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        inside, command, quoted = False, None, []
        for line in file.read_text().splitlines():
            if line.strip() == "```console":
                inside = True
            elif inside and line.strip() == "```":
                if command is not None:
                    found.append((str(file.relative_to(ROOT)), command, quoted))
                inside, command, quoted = False, None, []
            elif inside and line.startswith("$ "):
                if command is not None:
                    found.append((str(file.relative_to(ROOT)), command, quoted))
                command, quoted = line[2:], []
            elif inside and command is not None and command.endswith("\\"):
                command = command[:-1] + " " + line.strip()
            elif inside:
                quoted.append(line.rstrip())
    return found


def printed_in_order(quoted: list[str], printed: list[str]) -> str | None:
    """None when every quoted line is printed, in order (``...`` allowing any lines between, and only there);
    else the first quoted line that is not where the doc puts it."""
    position, gap = 0, True  # the output before the first quoted line is left out
    for line in quoted:
        if line == GAP:
            gap = True
            continue
        found = next((i for i in range(position, len(printed)) if printed[i].rstrip() == line), None)
        if found is None or (not gap and found != position):
            return line
        position, gap = found + 1, False
    return None


BLOCKS = console_blocks()


def test_the_docs_have_console_examples_to_check():
    assert {file for file, *_ in BLOCKS} >= {"docs/planner.md"}


@pytest.mark.parametrize("file, command, quoted", BLOCKS, ids=[f"{file}:{command[:60]}" for file, command, _ in BLOCKS])
def test_a_docs_example_prints_what_the_doc_quotes(file, command, quoted):
    argv = shlex.split(command)
    assert argv[:2] == ["python", "-m"], f"{file}: only python -m commands are run here: {command}"
    done = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = printed_in_order(quoted, done.stdout.splitlines())
    assert missing is None, f"{file}: `{command}` no longer prints, where the doc quotes it:\n{missing}\n" \
                            f"--- it printed:\n{done.stdout[-4000:]}"


def test_a_quoted_line_the_command_does_not_print_where_the_doc_puts_it_is_caught():
    printed = ["header", "a", "b", "c"]
    assert printed_in_order(["a", "...", "c"], printed) is None and printed_in_order(["b", "c"], printed) is None
    assert printed_in_order(["a", "c"], printed) == "c"  # a line left out without "..."
    assert printed_in_order(["c", "...", "a"], printed) == "a"  # out of order
    assert printed_in_order(["a", "...", "d"], printed) == "d"  # never printed
