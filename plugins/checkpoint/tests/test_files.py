"""Saves visible only complete: a process killed at every step of publishing or deleting a checkpoint, and
what the next start (``recover``) makes of the folder it left."""

import errno
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_checkpoint import files
from titan_checkpoint.plugin import complete_checkpoints, storage_cause


class Killed(Exception):
    """The process died here."""


def saved(folder: Path, content: str, finished: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_text(content)
    if finished:  # DCP writes .metadata last, once every rank's shards are written
        (folder / ".metadata").write_text(content)
    return folder


def content(folder: Path) -> str:
    assert files.finished(folder), folder
    return (folder / "__0_0.distcp").read_text()


@pytest.fixture
def dies_after(monkeypatch):
    """``dies_after(n)``: renames and deletions raise Killed once n of them have run."""
    def arm(operations: int):
        done = [0]

        def mortal(real):
            def operation(*args, **kwargs):
                if done[0] == operations:
                    raise Killed
                done[0] += 1
                return real(*args, **kwargs)
            return operation
        monkeypatch.setattr(Path, "rename", mortal(Path.rename))
        monkeypatch.setattr(files.shutil, "rmtree", mortal(shutil.rmtree))
    return arm


@pytest.fixture
def deletions():
    running = files.Deletions()
    yield running
    running.executor.shutdown()


# Publishing a rerun of step 3 takes four operations: old -> .replaced, .partial -> step-3, .replaced ->
# .removed-<id>, and deleting that (on the deleting thread).
@pytest.mark.parametrize("killed_at, survivor", [(0, "old"), (1, "new"), (2, "new"), (3, "new"), (None, "new")])
def test_a_save_killed_at_any_step_of_the_swap_leaves_one_complete_checkpoint(tmp_path, monkeypatch, dies_after,
                                                                               killed_at, survivor, deletions):
    complete = saved(tmp_path / "step-3", "old")
    partial = saved(files.partial_of(complete), "new")
    if killed_at is not None:
        dies_after(killed_at)
    try:
        files.swap_in(partial, complete, deletions)
        deletions.done()
    except Killed:
        pass
    monkeypatch.undo()
    files.recover(tmp_path, deletions)
    deletions.done()
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"]
    assert content(complete) == survivor


def test_a_first_save_killed_before_its_rename_is_published(tmp_path, dies_after, monkeypatch, deletions):
    partial = saved(tmp_path / "step-5.partial", "new")
    dies_after(0)
    with pytest.raises(Killed):
        files.swap_in(partial, tmp_path / "step-5", deletions)
    monkeypatch.undo()
    assert complete_checkpoints(tmp_path) == []  # not loadable as it stands
    files.recover(tmp_path, deletions)
    deletions.done()
    assert [p.name for p in tmp_path.iterdir()] == ["step-5"] and content(tmp_path / "step-5") == "new"


def test_an_unfinished_save_is_dropped_and_the_one_it_was_replacing_comes_back(tmp_path, deletions):
    saved(tmp_path / "step-3.replaced", "old")
    saved(tmp_path / "step-3.partial", "new", finished=False)  # killed while the ranks wrote their shards
    saved(tmp_path / "step-6.partial", "newer", finished=False)
    files.recover(tmp_path, deletions)
    deletions.done()
    assert [p.name for p in tmp_path.iterdir()] == ["step-3"] and content(tmp_path / "step-3") == "old"


@pytest.mark.parametrize("killed_at", [0, 1])
def test_a_checkpoint_being_deleted_never_looks_complete(tmp_path, dies_after, monkeypatch, killed_at, deletions):
    old = saved(tmp_path / "step-1", "old")
    saved(tmp_path / "step-2", "kept")
    dies_after(killed_at)
    if killed_at == 0:
        with pytest.raises(Killed):
            deletions.delete(old)
    else:  # renamed, then the deletion died on its thread: a warning, and the rest goes at the next start
        deletions.delete(old)
        deletions.done()
    monkeypatch.undo()
    expected = [1, 2] if killed_at == 0 else [2]  # before the rename it is whole, after it is never listed
    assert [step for step, _ in complete_checkpoints(tmp_path)] == expected
    files.recover(tmp_path, deletions)
    deletions.done()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-{step}" for step in expected]


def test_a_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    target = tmp_path / "weights.pt"

    def dies_while_writing(obj, path):
        Path(path).write_bytes(b"half")
        raise Killed
    monkeypatch.setattr(files.torch, "save", dies_while_writing)
    with pytest.raises(Killed):
        files.save_file({"w": torch.ones(2)}, target)
    assert not target.exists()
    monkeypatch.undo()
    files.save_file({"w": torch.ones(2)}, target)
    assert torch.equal(torch.load(target)["w"], torch.ones(2))


def test_a_long_run_keeps_only_the_deletions_under_way(tmp_path, deletions):
    # One deletion per save over a whole run: the finished ones are let go as new ones start.
    for step in range(5):
        deletions.delete(saved(tmp_path / f"step-{step}", "old"))
        deletions.under_way[-1].result()
    assert len(deletions.under_way) == 1
    deletions.done()
    assert deletions.under_way == [] and list(tmp_path.iterdir()) == []


SAVE_PAST_A_LIMIT = """
import resource, sys, torch
from titan_checkpoint.plugin import storage_cause
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # Python ignores SIGXFSZ: writes fail
try:
    torch.save(torch.zeros(10_000), sys.argv[1])
except RuntimeError as error:
    cause = storage_cause(error)
    print(str(error).splitlines()[-1], cause.errno, cause.strerror, sep="|")
"""


def test_torchs_archive_writer_cut_short_is_a_storage_fault(tmp_path):
    """torch.save to a path writes through a C++ stream that drops the OS's error (a full disk, a file-size limit)
    and raises only "unexpected pos": the plugin takes it for the storage fault it is (exit 74, the checkpoint before
    named) instead of a rank's crash (exit 1, three lines)."""
    done = subprocess.run([sys.executable, "-c", SAVE_PAST_A_LIMIT, str(tmp_path / "weights.pt")], capture_output=True,
                          text=True, timeout=300)
    raised, code, reason = done.stdout.strip().split("|")
    assert "[enforce fail at inline_container.cc" in raised and "unexpected pos" in raised, done.stderr
    words = raised.rpartition("] . ")[2]
    assert (int(code), reason) == (errno.EIO, "a file came out short, as on a full disk or past a file-size limit "
                                              f"(torch: {words})")
    assert storage_cause(RuntimeError("a tensor's size differs")) is None  # other errors stay a rank's failure


def test_generate_streams_each_token_as_it_is_chosen_and_holds_a_split_character(capsys):
    """generate prints the text of every token as it is chosen (flushed, not at the end), and holds back a character
    whose bytes span tokens until its last one comes (byte-level tokens decode it to U+FFFD until then)."""
    from titan_checkpoint.generate import Stream

    pieces = {1: b"Hi", 2: b" caf", 3: "é".encode()[:1], 4: "é".encode()[1:], 5: b"!"}
    stream = Stream(lambda ids: b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace"))
    seen = []
    for length in range(1, 6):
        stream([1, 2, 3, 4, 5][:length])
        seen.append(capsys.readouterr().out)
    stream.end([1, 2, 3, 4, 5])
    assert seen == ["Hi", " caf", "", "é", "!"] and capsys.readouterr().out == "\n"
