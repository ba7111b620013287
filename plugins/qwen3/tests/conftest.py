"""Shared by the Qwen3 and Qwen3-MoE tests: a folder transformers made from a config.json taken word for word, and
our model of it against transformers'."""

import json

import pytest
import torch

from titan_checkpoint.hf import load_hf_slices
from titan_core.testing import transformers_folder

TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
ROPE_KEYS = ("rope_type", "rope_theta", "factor", "original_max_position_embeddings")


@pytest.fixture
def read_as_transformers(tmp_path):
    """``check(config, compared, build, options_from_hf, describe)``: transformers' model of a folder whose config.json
    is ``config`` and ours (the file through ``options_from_hf``, then ``build``, the weights loaded as a job loads
    them) give the same logits within 1e-5, and ours exports the ``compared`` keys, the head width and the RoPE
    transformers read."""
    def check(config: dict, compared, build, options_from_hf, describe) -> None:
        transformers = pytest.importorskip("transformers")
        folder = transformers_folder(config, tmp_path / "hf")
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
        ours = build(options_from_hf(json.loads((folder / "config.json").read_text())))
        load_hf_slices([ours], folder, describe(ours.args).hf)
        exported = describe(ours.args).hf.config
        theirs = {key: getattr(hf.config, key) for key in compared if key != "head_dim"}
        theirs["head_dim"] = hf.model.layers[0].self_attn.head_dim  # Qwen3-MoE's config may have none
        assert {key: exported[key] for key in theirs} == theirs
        assert ({key: exported["rope_parameters"].get(key) for key in ROPE_KEYS}
                == {key: hf.config.rope_parameters.get(key) for key in ROPE_KEYS})
        with torch.no_grad():
            expected = hf.eval()(TOKENS).logits
            diff = (ours.eval()(TOKENS) - expected).abs().max().item()
        print(f"max logit diff against transformers {diff:.1e} (logits' scale {expected.abs().max():.1f})")
        assert diff <= 1e-5
    # Building both models draws from torch's global generator: later tests get it as they would have.
    with torch.random.fork_rng():
        yield check
