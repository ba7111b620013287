"""The example's commands, as its README gives them, with fewer steps."""

import subprocess
import sys
from pathlib import Path

import pytest

from titan_core.testing import run_job

pytest.importorskip("transformers")
ROOT = Path(__file__).parents[3]


@pytest.mark.slow
def test_the_readme_commands_fine_tune_a_folder_on_chats_and_merge_it(tmp_path):
    folder = tmp_path / "tiny-qwen3"
    subprocess.run([sys.executable, str(ROOT / "examples" / "chat-sft" / "make_folder.py"), str(folder)], check=True,
                   capture_output=True)
    result = run_job(["model=hf", f"model.path={folder}", "+plugins=[checkpoint,lora,sft]",
                      f"plugins.sft.path={ROOT / 'plugins' / 'sft' / 'tests' / 'data' / 'chat.jsonl'}",
                      "plugins.sft.holdout_every=8", "training.attention_mask=block_causal", "training.seq_len=256",
                      "training.steps=6", "optimizer.lr=3e-3", "validation.every=3", "validation.batches=1",
                      "metrics.log_every=1", "launch.device=cpu"], tmp_path / "run")
    validation = [m["validation_loss"] for m in result.metrics if "validation_loss" in m]
    assert len(validation) == 2 and validation[1] < validation[0]  # held-out replies: it learnt the task, not the rows
    merged = tmp_path / "merged"
    subprocess.run([sys.executable, "-m", "titan_lora.merge", str(folder), str(tmp_path / "run" / "adapter-step-6"),
                    str(merged)], check=True, capture_output=True)
    looked = subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", str(merged), "--text",
                             "<|im_start|>user\nWhat is 12 plus 30?<|im_end|>\n<|im_start|>assistant\n"],
                            capture_output=True, text=True, check=True)
    assert looked.stdout.strip()
