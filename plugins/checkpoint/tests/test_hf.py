"""Hugging Face folders (of the Llama model plugin): transformers reads our export with equal logits, and we
read it back."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from titan_core import ConfigError
from titan_core.testing import init_weights
from titan_llama3.model import LlamaArgs, Transformer
from titan_llama3.plugin import describe, llama_args
from titan_checkpoint.hf import export_hf, hf_shapes, import_hf

LOGIT_TOLERANCE = 1e-5


def tiny_llama(**rope) -> Transformer:
    args = LlamaArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=300, multiple_of=32, max_seq_len=32,
                     rope_theta=10000.0, **rope)
    model = Transformer(args)
    init_weights(model, describe(model.args), 3)
    return model.eval()


# The 3.1 scaling changes frequencies only past the original context, so it is set short here.
ROPES = {"plain": {}, "llama3.1": dict(rope_scaling_factor=8.0, rope_original_max_positions=16)}
TOKENS = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("rope", ROPES.values(), ids=ROPES.keys())
def test_transformers_reads_the_export_with_equal_logits(tmp_path, rope):
    transformers = pytest.importorskip("transformers")
    model = tiny_llama(**rope)
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path)
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path, attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        diff = (hf(TOKENS).logits - model(TOKENS)).abs().max().item()
    print(f"max logit diff against transformers ({rope or 'plain rope'}): {diff:.2e}")
    assert diff <= LOGIT_TOLERANCE


def test_import_gives_back_the_same_model(tmp_path):
    model = tiny_llama(**ROPES["llama3.1"])
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path, shard_bytes=40_000)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == 21
    adapter = describe(model.args).hf
    options, weights = import_hf(tmp_path, adapter)
    args = llama_args(options, vocab_size=300, seq_len=32)
    assert (args.dim, args.n_layers, args.n_heads, args.kv_heads, args.ffn_hidden_dim, args.rope_scaling_factor) == \
        (64, 2, 8, 4, model.args.ffn_hidden_dim, 8.0)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert hf_shapes(tmp_path, adapter, list(weights)) == {f"model.{k}": tuple(v.shape)
                                                           for k, v in model.state_dict().items()}
    rebuilt = Transformer(args)
    rebuilt.load_state_dict(weights)
    rebuilt.rope = model.rope
    with torch.no_grad():
        assert torch.equal(rebuilt(TOKENS), model(TOKENS))
    # An export of what was imported keeps the folder's context, not the training length it was read at.
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    options, _ = import_hf(tmp_path, adapter)
    export_hf(weights, describe(llama_args(options, vocab_size=300, seq_len=32)).hf, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["max_position_embeddings"] == 131072


def test_export_dtype_is_the_stored_dtype(tmp_path):
    model = tiny_llama()
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path, dtype=torch.bfloat16)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"


def test_bad_folders_are_named(tmp_path):
    adapter = describe(tiny_llama().args).hf
    with pytest.raises(ConfigError, match="has no config.json"):
        import_hf(tmp_path, adapter)
    model = tiny_llama()
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match="model_type 'gpt2', not llama"):
        import_hf(tmp_path, adapter)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="has no model.safetensors"):
        hf_shapes(tmp_path, adapter, ["norm.weight"])


@pytest.mark.slow
def test_sharded_import_reads_each_ranks_slices_only(tmp_path):
    import re
    from pathlib import Path

    from omegaconf import OmegaConf

    from titan_core.testing import TINY, run_job

    conf = Path(__file__).resolve().parents[2] / "llama3" / "titan_llama3" / "conf" / "model" / "tiny.yaml"
    model = Transformer(llama_args(OmegaConf.load(conf), vocab_size=264, seq_len=32))
    init_weights(model, describe(model.args), 5)  # not the run's seed: the weights must come from the files
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path / "hf")
    result = run_job([*TINY, "training.steps=0", "+plugins=[fsdp,checkpoint]", "plugins.fsdp.degree=2",
                      f"plugins.checkpoint.load_path={tmp_path / 'hf'}"], tmp_path / "run")
    weights = result.final_weights()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    total = sum(v.nbytes for v in model.state_dict().values())
    read = [int(re.search(r"read (\d+) bytes", (tmp_path / "run" / "logs" / f"rank{r}.log").read_text()).group(1))
            for r in range(2)]
    print(f"bytes read per rank {read} of {total}")
    assert sum(read) == total and max(read) <= 0.55 * total


def test_an_export_generates_and_stops_at_the_end_of_text(tmp_path):
    """The export carries the special tokens (config.json, generation_config.json, tokenizer_config.json): a model
    trained on 'BOS hello world EOS' repeated, exported, then generates in transformers and stops at EOS."""
    transformers = pytest.importorskip("transformers")
    from titan_core.testing import TINY, run_job

    documents = tmp_path / "documents.jsonl"
    documents.write_text(json.dumps({"text": "hello world"}) + "\n")
    run_job([*TINY, "tokenizer.path=builtin", "data.source=local", f"data.path={documents}", "training.steps=40",
             "optimizer.lr=1e-2", "+plugins=[checkpoint]", "plugins.checkpoint.export_hf=true"], tmp_path / "run")
    folder = tmp_path / "run" / "checkpoints" / "hf-step-40"
    config = json.loads((folder / "config.json").read_text())
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.bos_token, tokenizer.eos_token) == ("<|begin_of_text|>", "<|end_of_text|>")
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = tokenizer("<|begin_of_text|>hello", add_special_tokens=False, return_tensors="pt").input_ids
    generated = model.generate(prompt, max_new_tokens=20, do_sample=False)[0].tolist()
    assert generated[-1] == tokenizer.eos_token_id and len(generated) < prompt.shape[1] + 20, generated
    assert tokenizer.decode(generated[prompt.shape[1]:-1]) == " world"


@pytest.mark.parametrize("key, value", [("rope_theta", 20000.0), ("rms_norm_eps", 1e-6)])
def test_a_folder_whose_model_is_not_the_jobs_is_refused_by_load_path_as_by_model_path(tmp_path, key, value):
    """load_path names a Hugging Face folder whose config.json disagrees with the job's model on a value no tensor
    shape shows: refused before launch naming the field, as model=hf model.path= refuses a disagreeing option (the
    weights once loaded into the preset's other model without a word; the folder as exported loads:
    test_sharded_import_reads_each_ranks_slices_only)."""
    from omegaconf import OmegaConf

    from titan_core.testing import TINY, config_error

    conf = Path(__file__).resolve().parents[2] / "llama3" / "titan_llama3" / "conf" / "model" / "tiny.yaml"
    model = Transformer(llama_args(OmegaConf.load(conf), vocab_size=264, seq_len=32))
    export_hf(model.state_dict(), describe(model.args).hf, tmp_path / "hf")
    job = [*TINY, "+plugins=[checkpoint]", f"plugins.checkpoint.load_path={tmp_path / 'hf'}"]
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    rope = {**config["rope_parameters"], "rope_theta": value} if key == "rope_theta" else config["rope_parameters"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, key: value, "rope_parameters": rope}))
    error = config_error(*job)
    assert error.field == "plugins.checkpoint.load_path"
    assert f"config.json has {key}={value!r} where the job's model has" in str(error)
    assert f"fix: start from the folder with model=hf model.path={tmp_path / 'hf'}" in str(error)
