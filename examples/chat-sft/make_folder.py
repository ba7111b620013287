"""Write a small Qwen3 as a Hugging Face folder, the way a released checkpoint comes: config.json and weights
written by transformers, the tokenizer titan-core ships, and a ChatML chat template in tokenizer_config.json.

    python examples/chat-sft/make_folder.py /tmp/tiny-qwen3
"""

import argparse
import json
import shutil
from pathlib import Path

import torch
import transformers
from omegaconf import OmegaConf

from titan_core import tokenizer_file

CHATML = (Path(__file__).parents[2] / "plugins" / "sft" / "tests" / "data" / "chatml.jinja").read_text()


def make_folder(folder: Path) -> Path:
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        intermediate_size=384, vocab_size=2048, max_position_embeddings=512, tie_word_embeddings=False))
    model.save_pretrained(folder)
    shutil.copyfile(tokenizer_file(OmegaConf.create({"path": "builtin"})), folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>", "chat_template": CHATML}, indent=1))
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    print(f"wrote {make_folder(parser.parse_args().folder)}")
