"""An operator's bad day, second round: the data on disk is checked before it is trained on, storage faults are
one line with the previous checkpoint kept, and each mistake below is refused in one line before anything runs.

| fault or mistake                                   | what the user sees                                            |
|----------------------------------------------------|---------------------------------------------------------------|
| bytes flipped in a prepared token shard            | one line naming the shard and its bytes, exit 2, no step      |
| ... with data.damaged=skip                         | a warning, the samples replaced, damaged_samples_replaced      |
| token ids outside the vocabulary                   | one line naming the shard and the token, exit 2               |
| a full, read-only or vanished checkpoint folder     | one line naming the folder, the cause, the intact checkpoint, |
|   (during a save, during the HF export)            |   exit 74; the run resumes from the intact one                |
| a full disk during prepare                         | one line, exit 74; the same command resumes                   |
| manifest.json cut short                            | one line, exit 2                                              |
| data.source=tokens without data.path               | one line, exit 2                                              |
| a binary (non-UTF-8) local data file               | one line, exit 2                                              |
| training.seq_len=1000000000                        | one line from the memory bound, exit 2                        |
| --hardware file: YAML syntax / a non-number field  | one line, exit 2                                              |
| compare on a run killed mid-write                  | a warning naming the file; the comparison goes on             |
| prepare into a folder of other files               | one line, exit 2, nothing written                             |
| a hub dataset that cannot be reached               | one line within 5 s                                           |
| a plugin distribution whose code is gone           | one line naming it and how to reinstall, exit 2               |
| a worker ended by a native crash (an abort)        | one line naming the rank, its fatal error and its log, which  |
|                                                    |   holds every thread's Python stack                           |
"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from omegaconf import OmegaConf

from titan_core.data.prepare import main as prepare_main
from titan_core.data.text import check_documents
from titan_core.data.tokens import CHECKSUM_BLOCK, Samples, TokenLoader, TokenShards
from titan_core.errors import ConfigError
from titan_core.forked_jobs import FRESH
from titan_core.testing import TINY, config_error, error_line, install_plugins, run_job

SEQ = 32


@pytest.fixture
def damaged(prepared, tmp_path):
    """A copy of the prepared folder; ``damage(shard, offset, values)`` overwrites tokens of one of its shards."""
    folder = tmp_path / "damaged"
    shutil.copytree(prepared, folder)

    def damage(values, shard=0, offset=100):
        tokens = np.memmap(folder / f"tokens-{shard:05d}.bin", dtype=np.uint16, mode="r+")
        tokens[offset:offset + len(values)] = values
        tokens.flush()
        return folder
    return damage


TOKENS = [*TINY, "tokenizer.path=bytes", "data.source=tokens"]


def test_a_flipped_byte_in_a_shard_stops_the_run_before_it_is_trained_on(damaged, tmp_path):
    folder = damaged([65, 66, 67])  # ids still in the vocabulary: only the checksum can tell
    result = run_job([*TOKENS, f"data.path={folder}"], tmp_path / "run", expect_success=False)
    line = error_line(result)
    assert f"data.path: {folder}/tokens-00000.bin: bytes 0-{CHECKSUM_BLOCK - 1} differ from what" in line
    assert "fix: prepare" in line and "data.damaged=skip" in line
    assert result.metrics == []  # not one step trained


def test_a_damaged_shard_under_several_workers_is_one_line_on_the_console_and_exit_2(damaged, tmp_path):
    """Both ranks of fsdp 2 read the damaged block: the console had each rank's line and the launcher's "worker rank
    0 failed (exit code 2); see .../rank0.log", and the job exited 1. Now the first rank's line alone, exit 2."""
    folder = damaged([65, 66, 67])
    result = run_job([*TOKENS, f"data.path={folder}", "+plugins=[fsdp]", "plugins.fsdp.degree=2"], tmp_path / "run",
                     expect_success=False)
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core:")]
    assert result.returncode == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"titan-core: error: data.path: {folder}/tokens-00000.bin: bytes 0-")


def test_skipping_damaged_data_trains_on_the_rest_and_counts_it(damaged, tmp_path):
    folder = damaged([65, 66, 67])
    result = run_job([*TOKENS, f"data.path={folder}", "data.damaged=skip"], tmp_path / "run")
    assert result.metrics[-1]["damaged_samples_replaced"] >= 1
    assert "skipping the samples of damaged data" in result.stdout


def test_ids_outside_the_vocabulary_are_refused_naming_the_token(prepared, tmp_path):
    folder = tmp_path / "outside"
    shutil.copytree(prepared, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    del manifest["checksum_block"]  # a folder prepared before checksums: the ids are still checked
    (folder / "manifest.json").write_text(json.dumps(manifest))
    tokens = np.memmap(folder / "tokens-00000.bin", dtype=np.uint16, mode="r+")
    tokens[40] = 60000
    tokens.flush()
    line = error_line(run_job([*TOKENS, f"data.path={folder}"], tmp_path / "run", expect_success=False))
    assert f"data.path: {folder}/tokens-00000.bin: token 40 is id 60000, outside the tokenizer's 264 ids" in line


def test_each_rank_checks_only_the_blocks_it_reads(prepared):
    """A rank reads, to check them, exactly the blocks its own rows lie in: its cost grows with what it trains
    on, never with what the other ranks read."""
    batch, steps, length = 8, 2, SEQ + 1

    def checked(dp_rank, dp_size):
        shards = TokenShards(str(prepared), "data.path")
        samples = Samples(shards, length, seed=3)
        loader = TokenLoader([samples], ["builtin"], [1.0], batch, dp_rank, dp_size)
        for _ in range(steps):
            next(loader)
        rows = [step * batch + row for step in range(steps) for row in loader.rows]
        blocks = set()
        for row in rows:  # the tokens of this rank's samples, as bytes of the stream, by shard and block
            start = samples.slot(row) * length
            for token in (start, start + length - 1):
                shard = int(np.searchsorted(shards.starts, token, side="right")) - 1
                blocks.add((shard, (token - shards.starts[shard]) * 2 // CHECKSUM_BLOCK))
        sizes = {(shard, block): min(CHECKSUM_BLOCK, shards.counts[shard] * 2 - block * CHECKSUM_BLOCK)
                 for shard, block in blocks}
        return shards.verified_bytes, sum(sizes.values()), blocks

    ranks = [checked(rank, 2) for rank in range(2)]
    for verified, expected, _ in ranks:
        assert verified == expected  # its own rows' blocks, each once
    alone = checked(0, 1)
    assert alone[2] == ranks[0][2] | ranks[1][2] and max(verified for verified, _, _ in ranks) < alone[0]


FAULTY_STORAGE = """
import errno
import os
import resource
from pathlib import Path

from torch.distributed.checkpoint import filesystem

from titan_core import hookimpl


@hookimpl
def after_init(plugin_config):
    \"\"\"faultystorage: writes into folders whose name holds `where` fail with the OS error `code`.\"\"\"
    def failing(path):
        return plugin_config.where in str(path)

    def error(path):
        code = getattr(errno, plugin_config.code)
        return OSError(code, os.strerror(code), str(path))

    create_stream, write_text = filesystem.FileSystem.create_stream, Path.write_text

    def refusing_stream(self, path, mode):
        if failing(path) and "w" in mode and plugin_config.code == "FSIZE":
            # A real limit from here on: the OS cuts each write past 64 KiB short (Python ignores SIGXFSZ).
            resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        elif failing(path) and "w" in mode:
            raise error(path)
        return create_stream(self, path, mode)

    def refusing_text(self, *args, **kwargs):
        if failing(self):
            raise error(self)
        return write_text(self, *args, **kwargs)
    filesystem.FileSystem.create_stream, Path.write_text = refusing_stream, refusing_text
"""


@pytest.fixture
def faulty_storage(tmp_path):
    options = "where: never-matches\ncode: ENOSPC\n"
    return install_plugins(tmp_path / "site", {"faultystorage": (FAULTY_STORAGE, options)}, "faulty-storage")


@pytest.mark.parametrize("code, cause", [("ENOSPC", "No space left on device"), ("EROFS", "Read-only file system"),
                                         ("EIO", "Input/output error"), ("FSIZE", "File too large")],
                         ids=["full", "read-only", "vanished", "past-a-real-file-size-limit"])
def test_a_storage_fault_during_a_save_is_one_line_and_keeps_the_checkpoint_before(tmp_path, faulty_storage, code,
                                                                                    cause):
    job = [*TINY, "training.steps=6", "+plugins=[checkpoint,faultystorage]", "plugins.checkpoint.interval=2",
           "plugins.faultystorage.where=step-4", f"plugins.faultystorage.code={code}"]
    result = run_job(job, tmp_path / "run", expect_success=False, env=faulty_storage)
    folder = tmp_path / "run" / "checkpoints"
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core:")]
    assert result.returncode == 74 and lines == [
        f"titan-core: storage: rank 0: {folder / 'step-4.partial'}: {cause} (errno {getattr(errno, code, errno.EFBIG)}); the "
        f"newest checkpoint, {folder / 'step-2'}, is intact"], result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]  # the failed save's files are gone
    resumed = run_job([*job[:-2], "plugins.faultystorage.where=never-matches"], tmp_path / "run", env=faulty_storage)
    assert "continuing after step 2" in resumed.stdout and resumed.metrics[-1]["step"] == 6


def test_a_full_disk_during_the_hugging_face_export_is_one_line(tmp_path, faulty_storage):
    result = run_job([*TINY, "training.steps=2", "+plugins=[checkpoint,faultystorage]",
                      "plugins.checkpoint.export_hf=true", "plugins.faultystorage.where=hf-step"], tmp_path / "run",
                     expect_success=False, env=faulty_storage)
    folder = tmp_path / "run" / "checkpoints"
    assert result.returncode == 74
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("titan-core:")]
    assert line.startswith(f"titan-core: storage: rank 0: {folder / 'hf-step-2.partial'}: No space left on device")
    assert sorted(p.name for p in folder.iterdir()) == ["step-2"]


def test_a_full_disk_during_prepare_is_one_line_and_the_same_command_resumes(tmp_path, monkeypatch, capsys):
    real_open = open

    def full_after_the_first_shard(path, mode="r", *args, **kwargs):
        if "tokens-00001" in str(path) and "w" in mode:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_open(path, mode, *args, **kwargs)
    argv = [str(tmp_path / "out"), "tokenizer.path=bytes", "--workers", "1", "--documents-per-shard", "500"]
    monkeypatch.setattr("builtins.open", full_after_the_first_shard)
    with pytest.raises(SystemExit) as exit_:
        prepare_main(argv)
    monkeypatch.undo()
    assert exit_.value.code == 74
    line = capsys.readouterr().err.strip()
    assert line == (f"titan-core: storage: {tmp_path / 'out'}: No space left on device (errno 28); the shards "
                    "written before are kept: run the same command again once there is room, and it resumes")
    assert (tmp_path / "out" / "shard-00000.json").is_file() and not list((tmp_path / "out").glob("*.partial"))
    prepare_main(argv)
    assert (tmp_path / "out" / "manifest.json").is_file()


def test_a_manifest_cut_short_is_one_line(prepared, tmp_path):
    folder = tmp_path / "cut"
    shutil.copytree(prepared, folder)
    (folder / "manifest.json").write_text((folder / "manifest.json").read_text()[:50])
    line = error_line(run_job([*TOKENS, f"data.path={folder}"], tmp_path / "run", expect_success=False))
    assert line.startswith(f"titan-core: error: data.path: {folder}/manifest.json is not whole (") and "fix: " in line


@pytest.mark.parametrize("overrides, words", [
    (["data.source=tokens"], "data.path: is empty but data.source=tokens; fix: set data.path to a folder"),
    (["data.source=local", "data.path=BINARY"], "data.path: BINARY cannot be read as json documents ("),
    (["training.seq_len=1000000000"], "training.seq_len: one sequence of 1,000,000,000 tokens needs at least "),
], ids=["tokens-without-path", "binary-file", "sequence-too-long"])
def test_mistakes_are_one_line_before_launch(tmp_path, overrides, words):
    binary = tmp_path / "data.jsonl"
    binary.write_bytes(bytes(range(256)) * 64)
    overrides = [o.replace("BINARY", str(binary)) for o in overrides]
    words = words.replace("BINARY", str(binary))
    result = run_job([*TINY, *overrides], tmp_path / "run", expect_success=False)
    assert words in error_line(result) and "fix: " in error_line(result)
    assert not (tmp_path / "run" / "logs").exists()  # no worker started


def test_a_plugin_distribution_whose_code_is_gone_is_one_line(tmp_path):
    """An editable install whose folder moved leaves its metadata behind: its entry points name modules that
    are no longer there."""
    env = install_plugins(tmp_path / "site", {"ghost": ("", "")}, "titan-ghost")
    (tmp_path / "site" / "titan_ghost_ghost.py").unlink()
    shutil.rmtree(tmp_path / "site" / "titan_ghost_ghost_conf")
    result = run_job([*TINY], tmp_path / "run", expect_success=False, env=env)
    assert result.returncode == 2 and error_line(result) == (
        "titan-core: error: plugins.ghost: the installed distribution titan-ghost names the config package 'titan_ghost_ghost_conf', "
        "which cannot be imported (No module named 'titan_ghost_ghost_conf'); fix: reinstall titan-ghost "
        "(pip install -e <its folder>) or pip uninstall titan-ghost")
    assert "Traceback" not in result.stderr and not (tmp_path / "run" / "logs").exists()


CRASHING = """
import os

from titan_core import Declaration, hookimpl


@hookimpl
def declare():
    return Declaration()


@hookimpl
def on_step_end(step):
    \"\"\"crashing: the job's last rank aborts after step 2, as a library's failed check in native code does.\"\"\"
    if step == 2 and int(os.environ.get("RANK", 0)) == int(os.environ.get("WORLD_SIZE", 1)) - 1:
        os.abort()
"""


def test_a_native_crash_is_one_line_and_the_stack_is_in_the_ranks_log(tmp_path):
    env = install_plugins(tmp_path / "site", {"crashing": (CRASHING, "")}, "crashing")
    result = run_job([*TINY, "+plugins=[fsdp,crashing]", "plugins.fsdp.degree=2"], tmp_path / "run",
                     expect_success=False, env=env, timeout=120)
    log = tmp_path / "run" / "logs" / "rank1.log"
    assert result.returncode == 1
    # Rank 0's connection to rank 1 dies with it: the elastic agent reports whichever of the two it finds dead.
    assert (f"titan-core: worker rank 1 crashed (Fatal Python error: Aborted); its stack is in {log}"
            in result.stderr.splitlines()), result.stderr
    # Rank 0 fails on the reset connection, if the agent has not stopped it first (then it prints nothing).
    survivors = [line for line in result.stderr.splitlines() if line.startswith("titan-core: rank 0 failed: ")]
    assert all("(another rank ended first: its own line says why)" in line for line in survivors), result.stderr
    assert "most recent call first" not in result.stderr and 'File "' not in result.stderr, result.stderr
    assert "resource_tracker" not in result.stderr, result.stderr  # the semaphores rank 1 leaves are freed quietly
    stack = log.read_text().split("Fatal Python error: Aborted", 1)[1]
    assert "in on_step_end" in stack and "in worker_main" in stack


def test_a_single_process_jobs_native_crash_is_one_line_too(tmp_path, monkeypatch):
    """No launcher of ours watches a job of one process (nor a torchrun rank): a process beside it, reading what
    faulthandler writes, says it crashed and where the stack is."""
    env = install_plugins(tmp_path / "site", {"crashing": (CRASHING, "")}, "crashing")
    # A job that ends any other way leaves nothing of it: no line, nothing more in its log.
    finished = run_job([*TINY, "+plugins=[crashing]", "training.steps=1"], tmp_path / "done", env=env)
    assert "crashed" not in finished.stderr and "Fatal" not in (tmp_path / "done" / "logs" / "rank0.log").read_text()
    # Its own interpreter, whose stderr the test reads to its end: the line comes as the job's process dies.
    monkeypatch.setenv(FRESH, "1")
    result = run_job([*TINY, "+plugins=[crashing]"], tmp_path / "run", expect_success=False, env=env, timeout=120)
    log = tmp_path / "run" / "logs" / "rank0.log"
    assert result.returncode == -signal.SIGABRT
    assert result.stderr.strip().splitlines() == [
        f"titan-core: rank 0 crashed (Fatal Python error: Aborted); its stack is in {log}"], result.stderr
    stack = log.read_text().split("Fatal Python error: Aborted", 1)[1]
    assert "in on_step_end" in stack and "in hydra_main" in stack


def test_the_memory_bound_can_be_switched_off(tmp_path):
    result = run_job([*TINY, "training.seq_len=1000000000", "launch.check_memory=false", "launch.dry_run=true"],
                     tmp_path / "run", expect_success=False)
    assert "needs at least" not in result.stderr


@pytest.mark.parametrize("text, words", [
    ("bf16_tflops: 100\nmemory_gib: [1\n", "is not a YAML mapping of a device's figures"),
    ("bf16_tflops: fast\n", "bf16_tflops is 'fast', not a number"),
], ids=["yaml-syntax", "not-a-number"])
def test_a_bad_hardware_file_is_one_line(tmp_path, text, words):
    profile = tmp_path / "mine.yaml"
    profile.write_text(text)
    done = subprocess.run([sys.executable, "-m", "titan_core.planner", "--hardware", str(profile), *TINY],
                          capture_output=True, text=True, timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("titan-core: error: --hardware: ") and words in lines[0] and "fix: " in lines[0]


def test_compare_leaves_out_a_last_line_cut_short(tmp_path):
    for name, cut in (("whole", False), ("killed", True)):
        run = tmp_path / name
        run.mkdir()
        lines = [json.dumps({"step": step, "loss": 5.0 - step}) for step in (1, 2, 3)]
        (run / "metrics.jsonl").write_text("\n".join(lines)[:-5 if cut else None])
    done = subprocess.run([sys.executable, "-m", "titan_core.compare", str(tmp_path / "whole"),
                           str(tmp_path / "killed")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip() == (f"titan-core: warning: {tmp_path / 'killed' / 'metrics.jsonl'}: its last line is "
                                   "cut short (the run stopped while writing it); compared without it")
    assert [line.split()[1] for line in done.stdout.splitlines()[1:]] == ["3", "2"]  # steps of each run
    missing = subprocess.run([sys.executable, "-m", "titan_core.compare", str(tmp_path / "nothing")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "; fix: " in missing.stderr


def test_prepare_refuses_a_folder_of_other_files(tmp_path, capsys):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as exit_:
        prepare_main([str(tmp_path / "mine"), "tokenizer.path=bytes"])
    assert exit_.value.code == 2
    assert "output: " in capsys.readouterr().err and sorted(os.listdir(tmp_path / "mine")) == ["notes.txt"]


def test_an_unreachable_hub_is_one_line_within_seconds(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # CI runs offline
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "ENDPOINT", "https://hub.invalid")  # never resolves (RFC 2606)
    config = OmegaConf.create({"source": "hub", "path": "someone/corpus", "name": None, "split": "train",
                               "text_field": "text"})
    start = time.monotonic()
    with pytest.raises(ConfigError) as error:
        check_documents(config)
    assert time.monotonic() - start < 5
    assert "the Hub dataset 'someone/corpus' cannot be opened: https://hub.invalid cannot be reached" in str(
        error.value)


@pytest.mark.parametrize("overrides, field, words", [
    (("+plugins=[ac]", "plugins.ac.mode=full", "plugins.ac.matmuls=every_other"), "plugins.ac.matmuls",
     "every_other does nothing unless plugins.ac.mode=selective_op; fix: set plugins.ac.mode=selective_op, or leave "
     "plugins.ac.matmuls at its default (all)"),
    (("+plugins=[ac]", "plugins.ac.every=3"), "plugins.ac.every",
     "3 does nothing unless plugins.ac.mode=selective_layer"),
    (("+plugins=[ac]", "plugins.ac.mode=selective_layer", "plugins.ac.save_ops=[mm]"), "plugins.ac.save_ops",
     "[mm] does nothing unless plugins.ac.mode=selective_op"),
    (("+plugins=[checkpoint]", "plugins.checkpoint.async_writer=process"), "plugins.checkpoint.async_writer",
     "process does nothing unless plugins.checkpoint.async_save=true"),
    (("+plugins=[checkpoint]", "plugins.checkpoint.load_parts=[model]"), "plugins.checkpoint.load_parts",
     "[model] does nothing unless plugins.checkpoint.load_path names a checkpoint"),
    (("+plugins=[checkpoint]", "plugins.checkpoint.export_dtype=bfloat16"), "plugins.checkpoint.export_dtype",
     "bfloat16 does nothing unless plugins.checkpoint.final_model_only=true or export_hf=true"),
    (("data.damaged=skip",), "data.damaged", "needs data.source=tokens (data.source is builtin)"),
], ids=["ac-matmuls", "ac-every", "ac-save_ops", "async_writer", "load_parts", "export_dtype", "damaged-text"])
def test_an_option_that_would_do_nothing_is_refused_naming_what_it_needs(overrides, field, words):
    """Each was accepted and did nothing: an option that acts only beside another setting, set without it. The
    plugins declare the rule (Declaration.acts_only); the same options at their defaults, or beside what they need,
    pass."""
    error = config_error(*TINY, *overrides)
    assert error.field == field and words in str(error), str(error)


ACTS_ONLY = """
from titan_core import Declaration, hookimpl


@hookimpl
def declare():
    \"\"\"warmup: its length acts only when it is on.\"\"\"
    return Declaration(acts_only={"steps": ("plugins.warmup.enabled=true",
                                            lambda options, config: options.enabled)})
"""


def test_a_plugin_written_from_the_docs_declares_an_option_that_acts_only_beside_another(tmp_path):
    env = install_plugins(tmp_path / "site", {"warmup": (ACTS_ONLY, "enabled: false\nsteps: 10\n")}, "warmup-plugin")
    refused = run_job([*TINY, "+plugins=[warmup]", "plugins.warmup.steps=20"], tmp_path / "refused",
                      expect_success=False, env=env)
    assert error_line(refused) == ("titan-core: error: plugins.warmup.steps: 20 does nothing unless "
                                   "plugins.warmup.enabled=true; fix: set plugins.warmup.enabled=true, or leave "
                                   "plugins.warmup.steps at its default (10)")
    trained = run_job([*TINY, "training.steps=1", "+plugins=[warmup]", "plugins.warmup.steps=20",
                       "plugins.warmup.enabled=true"], tmp_path / "trained", env=env)
    assert trained.metrics[-1]["step"] == 1
