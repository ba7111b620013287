"""Start-up is O(1) per rank: what the job checks and loads from files at start (the tokenizer, the
checkpoint's metadata, the plugins' validation) is read by one rank and broadcast, not read by every rank."""

import json
import os
import subprocess
import sys

import pytest

from titan_core.testing import TINY, install_plugins, merged, run_job

# Counts, from its import in each rank, the files the rank opens whose name ends with one of WATCHED.
PROBE = """
import json
import os
import sys
from collections import Counter

from titan_core import hookimpl

WATCHED = ("tokenizer.json", ".metadata")
opened = Counter()


def count(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].endswith(WATCHED):
        opened[os.path.basename(args[0])] += 1


sys.addaudithook(count)


@hookimpl
def on_train_end(config):
    \"\"\"readprobe: write the watched files this rank opened.\"\"\"
    with open(f"{config.plugins.readprobe.out}/opened-rank{os.environ['RANK']}.json", "w") as out:
        json.dump(opened, out)
"""


@pytest.mark.slow
def test_only_rank_0_reads_the_tokenizer_and_the_checkpoint_metadata(tmp_path):
    seed = run_job([*TINY, "tokenizer.path=builtin", "training.steps=2", "+plugins=[checkpoint]"], tmp_path / "seed")
    env = install_plugins(tmp_path / "site", {"readprobe": (PROBE, "out: null\n")})
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--rdzv-backend=c10d",
               "--rdzv-endpoint=127.0.0.1:0", "--rdzv-id=reads", "-m", "titan_core.run",
               *merged(TINY, ["tokenizer.path=builtin", "training.steps=2", "+plugins=[checkpoint,fsdp,readprobe]",
                              "plugins.fsdp.degree=-1", f"plugins.readprobe.out={tmp_path}",
                              f"plugins.checkpoint.load_path={seed.run_dir / 'checkpoints' / 'step-2'}",
                              "plugins.checkpoint.load_parts=[model]"])]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                               env={**os.environ, **env})
    assert completed.returncode == 0, completed.stderr[-3000:]
    opened = {rank: json.loads((tmp_path / f"opened-rank{rank}.json").read_text()) for rank in (0, 1)}
    assert opened[1] == {}, opened  # everything rank 1 needed came from rank 0
    # Rank 0: the job's checks (the plugins' validation reads the metadata) and once more in the world.
    assert 1 <= opened[0].get("tokenizer.json", 0) <= 2 and 1 <= opened[0].get(".metadata", 0) <= 2, opened
