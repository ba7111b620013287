"""Starting from a Hugging Face folder (``model=hf model.path=<folder>``): folders that transformers itself wrote
for every family titan-core ships give transformers' logits, train, and export a folder transformers reads with
the trained model's logits; an option that disagrees with the folder's config.json is refused naming both."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_core import folder_config, load_tokenizer
from titan_core.testing import config_error, error_line, install_plugins, run_job, write_hf_folder

transformers = pytest.importorskip("transformers")
from titan_checkpoint.generate import job_config, load_model  # noqa: E402  (after the skip: it needs safetensors)

LOGIT_TOLERANCE = 1e-5
TOKENS = [5, 17, 300, 42, 1000, 7, 99, 2047, 512, 3]
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             vocab_size=2048, rms_norm_eps=1e-6, max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {  # family: (transformers' model class, its config), each with a non-default RoPE base and norm epsilon
    "llama3": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, rope_theta=50000.0))),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16, rope_theta=20000.0))),
    "qwen3_moe": (lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **SHAPE, head_dim=16, rope_theta=20000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        norm_topk_prob=False))),
}
# Each family trains under another plan: one process, two FSDP shards, two experts' ranks.
PLANS = {"llama3": [], "qwen3": ["+plugins=[fsdp]", "plugins.fsdp.degree=2"],
         "qwen3_moe": ["+plugins=[fsdp,ep]", "plugins.fsdp.degree=2", "plugins.ep.degree=2"]}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {family: write_hf_folder(FAMILIES[family](), root / family) for family in FAMILIES}


def our_logits(source: Path, config_path: Path | None = None) -> torch.Tensor:
    config = job_config(source, config_path)
    config.training.seq_len = len(TOKENS)
    with torch.no_grad():
        return load_model(source, config)(torch.tensor([TOKENS]))[0]


def their_logits(folder: Path) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([TOKENS])).logits[0]


@pytest.mark.slow
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_transformers_folder_gives_its_logits_trains_and_exports_to_transformers(folders, family, tmp_path):
    folder = folders[family]
    assert folder_config(folder, 32).model.name == family
    expected = their_logits(folder)
    start = our_logits(folder)
    diff = (start - expected).abs().max().item()
    print(f"{family}: max logit diff against transformers on its own folder {diff:.2e} (logits up to "
          f"{expected.abs().max().item():.1f})")
    assert diff <= LOGIT_TOLERANCE

    run_job(["model=hf", f"model.path={folder}", "+plugins=[checkpoint]", *PLANS[family],
             "plugins.checkpoint.export_hf=true", "training.steps=3", "training.seq_len=32",
             "training.global_batch_size=4", "optimizer.lr=1e-3", "lr_scheduler.warmup_steps=1"], tmp_path)
    checkpoints = tmp_path / "checkpoints"
    trained = our_logits(checkpoints / "step-3")
    exported = their_logits(checkpoints / "hf-step-3")
    moved = (trained - start).abs().max().item()
    print(f"{family}: after 3 steps the logits moved {moved:.3f}; transformers on the export differs by "
          f"{(exported - trained).abs().max().item():.2e}")
    assert (exported - trained).abs().max().item() <= LOGIT_TOLERANCE
    assert 1e-3 < moved


def test_the_generate_command_continues_a_text_as_transformers_does(folders, tmp_path):
    folder = folders["qwen3"]
    command = [sys.executable, "-m", "titan_checkpoint.generate", str(folder), "--text", "Once upon a time",
               "--new-tokens", "6", "--logits", str(tmp_path / "logits.pt")]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    tokenizer = load_tokenizer(folder_config(folder, 32).tokenizer)
    prompt = torch.tensor([[tokenizer.bos_id, *tokenizer.encode("Once upon a time")]])
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        expected = model(prompt).logits[0]
        continued = model.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=tokenizer.eos_id)
    assert (torch.load(tmp_path / "logits.pt") - expected).abs().max().item() <= LOGIT_TOLERANCE
    assert printed.rstrip("\n") == tokenizer.decode(continued[0, prompt.shape[1]:].tolist())


@pytest.mark.parametrize("override, field, said", [
    ("+model.rope_theta=10000", "model.rope_theta", "10000 disagrees with 20000.0"),
    ("+model.rms_norm_eps=1e-5", "model.rms_norm_eps", "1e-05 disagrees with 1e-06"),
    ("+model.norm_topk_prob=true", "model.norm_topk_prob", "True disagrees with False"),
    ("model.name=qwen3", "model.path", "model_type 'qwen3_moe', which model 'qwen3' does not read"),
])
def test_an_option_disagreeing_with_the_folder_is_refused_naming_both_values(folders, override, field, said):
    error = config_error("model=hf", f"model.path={folders['qwen3_moe']}", "+plugins=[checkpoint]", override)
    assert error.field == field and said in str(error)


def test_a_folder_the_job_cannot_honour_is_refused(folders, tmp_path):
    qwen3 = ["model=hf", f"model.path={folders['qwen3']}"]
    assert "would train from random weights" in str(config_error(*qwen3))
    assert config_error("model=qwen3_tiny", f"+model.path={folders['qwen3']}", "+plugins=[checkpoint]").field \
        == "model.num_hidden_layers"
    broken = shutil.copytree(folders["qwen3"], tmp_path / "broken")
    settings = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**settings, "attention_bias": True}))
    assert "config.json sets attention_bias=True, which qwen3 does not compute" in str(
        config_error("model=hf", f"model.path={broken}", "+plugins=[checkpoint]"))
    (broken / "config.json").write_text(json.dumps({**settings, "model_type": "gpt_neox"}))
    assert "model_type 'gpt_neox', which any installed model plugin" in str(
        config_error("model=hf", f"model.path={broken}", "+plugins=[checkpoint]"))
    (broken / "config.json").write_text(json.dumps(settings))
    (broken / "tokenizer.json").unlink()
    error = config_error("model=hf", f"model.path={broken}", "+plugins=[checkpoint]")
    assert error.field == "tokenizer.path" and "has no tokenizer.json" in str(error)
    assert "has no config.json" in str(config_error("model=hf", f"model.path={tmp_path}", "+plugins=[checkpoint]"))
    assert config_error("model=hf", "model.path=7", "+plugins=[checkpoint]").field == "model.path"
    assert "none is named" in str(config_error("model=hf", "+plugins=[checkpoint]"))


def test_transformers_4_and_5_field_names_give_the_same_options(folders, tmp_path):
    """transformers 5 writes rope_parameters and num_local_experts; 4 wrote rope_theta and num_experts; a Qwen
    folder without a begin-of-text token starts documents with its end-of-text token."""
    new = folder_config(folders["qwen3_moe"], 32)
    old = shutil.copytree(folders["qwen3_moe"], tmp_path / "old")
    settings = json.loads((old / "config.json").read_text())
    settings["rope_theta"] = settings.pop("rope_parameters")["rope_theta"]
    settings["num_experts"] = settings.pop("num_local_experts")
    (old / "config.json").write_text(json.dumps(settings))
    (old / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": {"content": "<|end_of_text|>"}}))
    legacy = folder_config(old, 32)
    assert {**legacy.model, "path": None} == {**new.model, "path": None}
    assert legacy.tokenizer.bos_token == legacy.tokenizer.eos_token == "<|end_of_text|>"


# A third party's fork of Qwen3, written from docs/writing-models.md: it reads the same config.json.
FORK = """
from titan_core import check_hf_config, hookimpl


@hookimpl
def hf_model_options(hf_config):
    if hf_config.get("model_type") != "qwen3":
        return None
    check_hf_config(hf_config, "qwen3_fork", hidden_act=("silu",))
    return {"name": "qwen3_fork", "width": hf_config["hidden_size"]}
"""


def test_two_installed_models_reading_one_folder_are_refused_until_one_is_named(folders, tmp_path):
    env = install_plugins(tmp_path / "site", {}, distribution="fork", models={"qwen3_fork": (FORK, {"fork": "name: qwen3_fork\n"})})
    job = ["model=hf", f"model.path={folders['qwen3']}", "+plugins=[checkpoint]", "launch.dry_run=true"]
    refused = run_job(job, tmp_path / "both", expect_success=False, env=env)
    assert ("model.path: model plugins qwen3, qwen3_fork all read model_type 'qwen3'; fix: choose one with "
            "model.name=qwen3") in error_line(refused)
    chosen = run_job([*job, "model.name=qwen3"], tmp_path / "chosen", env=env)
    assert "model qwen3" in chosen.stdout


def test_a_tokenizer_larger_than_the_folders_vocabulary_is_refused_with_a_fix_that_works(folders, tmp_path):
    """A folder's model fixes its vocabulary: the refusal asks for a tokenizer that fits (not model.vocab_size=null,
    which Hydra refuses under model=hf), and the job so fixed gets past it."""
    small = shutil.copytree(folders["qwen3"], tmp_path / "small")
    settings = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**settings, "vocab_size": 1000}))
    job = ["model=hf", f"model.path={small}", "+plugins=[checkpoint]"]
    error = config_error(*job)
    assert str(error).startswith("model.vocab_size: 1000 is smaller than the tokenizer's")
    assert str(error).endswith("fix: take the folder's tokenizer (tokenizer.path=builtin) or one of at most 1000 ids")
    fixed = config_error(*job, "tokenizer.path=bytes")  # 264 ids: past the vocabulary, on to the weights' shapes
    assert fixed.field == "plugins.checkpoint.load_path" and "[2048, 64] in" in str(fixed)


def test_generate_refuses_bad_input_in_one_line(folders, tmp_path):
    """Every mistake on generate's command line is one line naming the argument, exit 2, before any model loads:
    no argparse usage, no traceback, no text generated from nothing."""
    folder = str(folders["qwen3"])
    bare_checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    bare_checkpoint.mkdir(parents=True)
    (bare_checkpoint / ".metadata").write_bytes(b"")
    cases = [([str(tmp_path / "nowhere"), "--text", "hi"], "model: "),
             ([folder, "--text", ""], "--text: is empty"),
             ([folder, "--text", "hi", "--new-tokens", "-1"], "--new-tokens: -1 is negative"),
             ([folder, "--token-ids", ""], "--token-ids: '' is not comma-separated integers"),
             ([folder, "--token-ids", "1,99999"], "--token-ids: 99999 is not an id of the tokenizer"),
             ([folder, "--text", "hi", "--logits", str(tmp_path / "missing" / "l.pt")], "--logits: "),
             ([str(bare_checkpoint), "--text", "hi"], "--config: ")]
    for args, said in cases:
        done = subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", *args], capture_output=True,
                              text=True, timeout=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith(f"titan-checkpoint: error: {said}"), (args, lines)


def test_model_path_naming_a_file_or_a_hub_id_says_what_to_do(folders, tmp_path, monkeypatch):
    """model.path at a folder's config.json names the folder to use instead (and the job so fixed gets further);
    a hub id, which titan-core does not download, says how to get the folder."""
    monkeypatch.chdir(tmp_path)
    folder = folders["qwen3"]
    error = config_error("model=hf", f"model.path={folder / 'config.json'}")
    assert str(error) == (f"model.path: {folder / 'config.json'} is a file, not a Hugging Face model folder; fix: set "
                          f"model.path={folder}")
    assert "would train from random weights" in str(config_error("model=hf", f"model.path={folder}"))


def test_a_hub_id_is_read_from_the_hub_cache_and_one_missing_offline_is_one_line(folders, tmp_path, monkeypatch):
    """model.path (and tokenizer.path) may name a hub model: its snapshot in huggingface_hub's cache is the folder
    (downloaded into it first where the hub can be reached: not here, where CI runs offline). A model the cache
    lacks, offline, is one line naming the id and the cache; the job runs as from the folder."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-qwen3" / "snapshots" / ("0" * 40)
    shutil.copytree(folders["qwen3"], snapshot)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    # A fresh interpreter: huggingface_hub reads its cache and offline settings once, as it is imported.
    monkeypatch.setenv("TITAN_FRESH_INTERPRETER", "1")
    env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    job = ["model=hf", "+plugins=[checkpoint]", "training.steps=1", "training.seq_len=32",
           "training.global_batch_size=2", "launch.device=cpu"]
    trained = run_job([*job, "model.path=someone/tiny-qwen3"], tmp_path / "run", env=env)
    assert trained.metrics[-1]["step"] == 1
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert f"path: {snapshot}" in config  # the model and its tokenizer read from the cached snapshot
    planned = run_job(["model=tiny", "tokenizer.path=someone/tiny-qwen3", "launch.dry_run=true"], tmp_path / "dry",
                      env=env)
    assert planned.returncode == 0 and f"path: {snapshot}" in (tmp_path / "dry" / "config.yaml").read_text()
    missing = run_job([*job, "model.path=someone/absent"], tmp_path / "missing", env=env, expect_success=False)
    assert error_line(missing).startswith(f"titan-core: error: model.path: someone/absent is not in the hub cache "
                                          f"({cache}) and could not be downloaded (")
    assert error_line(missing).endswith("fix: download it where the hub can be reached (huggingface-cli download "
                                        "someone/absent), or set model.path=<a local folder>")


def test_a_broken_folder_is_named_before_launch(folders, tmp_path):
    """Weights cut short, a git-lfs pointer where they should be, a shard the index names but the folder lacks, and
    a shard without the tensors its index places there: each one line naming the file (from headers only), never a
    traceback after launch."""
    sharded = tmp_path / "sharded"
    transformers.AutoModelForCausalLM.from_pretrained(folders["qwen3"], dtype=torch.float32).save_pretrained(
        sharded, max_shard_size="200KB")
    shutil.copy(folders["qwen3"] / "tokenizer.json", sharded / "tokenizer.json")
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 1

    def damaged(name, damage, source=folders["qwen3"]):
        folder = shutil.copytree(source, tmp_path / name)
        damage(folder)
        return str(config_error("model=hf", f"model.path={folder}", "+plugins=[checkpoint]"))

    weights = "model.safetensors"
    said = damaged("cut", lambda f: (f / weights).write_bytes((f / weights).read_bytes()[:5000]))
    assert said.startswith(f"model.path: {tmp_path / 'cut' / weights} is not a whole safetensors")  # the option set
    loaded = config_error("model=qwen3_tiny", "+plugins=[checkpoint]", f"plugins.checkpoint.load_path={tmp_path / 'cut'}")
    assert str(loaded).startswith(f"plugins.checkpoint.load_path: {tmp_path / 'cut' / weights} is not a whole")
    said = damaged("lfs", lambda f: (f / weights).write_text("version https://git-lfs.github.com/spec/v1\n"))
    assert said.endswith(f"is a git-lfs pointer, not the weights; fix: fetch them: git lfs pull in {tmp_path / 'lfs'}")
    said = damaged("missing", lambda f: (f / shards[0].name).unlink(), sharded)
    assert f"places tensors in {shards[0].name}, which {tmp_path / 'missing'} lacks" in said
    said = damaged("swapped", lambda f: shutil.copy(f / shards[1].name, f / shards[0].name), sharded)
    assert f"{shards[0].name} lacks " in said and "which model.safetensors.index.json places there" in said


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, 0, 1.0), (1.0, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.9),
                                                       (1.0, 1, 0.5)])
def test_sampling_filters_the_logits_as_transformers_warpers_do(temperature, top_k, top_p):
    """generate's temperature, top-k and top-p leave the same tokens, with the same probabilities, as transformers'
    warpers in the order its generate applies them."""
    from titan_checkpoint.generate import Sampling, filtered_scores

    logits = torch.randn(2048, generator=torch.Generator().manual_seed(3)) * 4
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    warpers += [transformers.TopKLogitsWarper(top_k)] if top_k else []
    warpers += [transformers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    expected = logits[None].clone()
    for warper in warpers:
        expected = warper(torch.zeros(1, 1, dtype=torch.long), expected)
    ours = filtered_scores(logits, Sampling(temperature, top_k, top_p))
    assert torch.equal(ours.isinf(), expected[0].isinf())
    assert (ours.isfinite().sum() < 2048) == bool(top_k or top_p < 1)  # a filter asked for leaves tokens out
    assert torch.allclose(ours.softmax(-1), expected[0].softmax(-1), atol=1e-7)


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def test_generate_chats_and_samples_as_transformers_does(folders, tmp_path):
    """--chat renders the text as a user's turn as transformers' apply_chat_template does (its ids, then its greedy
    continuation); a seeded sample repeats with its seed and differs from greedy; sampling options without a
    temperature, and --chat without a text, are one line."""
    folder = shutil.copytree(folders["qwen3"], tmp_path / "chat")
    (folder / "chat_template.jinja").write_text(CHATML)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    hf_tokenizer.chat_template = CHATML
    messages = [{"role": "user", "content": "Who are you?"}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokenizer = load_tokenizer(folder_config(folder, 32).tokenizer)
    with torch.no_grad():
        continued = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                                   eos_token_id=tokenizer.eos_id)[0, len(ids):].tolist()

    def generate(*args):
        return subprocess.run([sys.executable, "-m", "titan_checkpoint.generate", str(folder), "--new-tokens", "6",
                               *args], capture_output=True, text=True, timeout=300)

    chat = generate("--chat", "--text", "Who are you?", "--logits", str(tmp_path / "logits.pt"))
    assert chat.returncode == 0, chat.stderr
    assert torch.load(tmp_path / "logits.pt").shape[0] == len(ids)  # the prompt was the template's ids
    assert chat.stdout.rstrip("\n") == tokenizer.decode(continued)
    sampled = [generate("--text", "Once upon a time", "--temperature", "1.5", "--seed", str(seed)).stdout
               for seed in (1, 1, 2)]
    greedy = generate("--text", "Once upon a time").stdout
    assert sampled[0] == sampled[1] and len({sampled[0], sampled[2], greedy}) == 3
    for args, said in ((["--text", "hi", "--top-k", "5"], "--top-k: does nothing to greedy generation"),
                       (["--text", "hi", "--seed", "1"], "--seed: does nothing to greedy generation"),
                       (["--text", "hi", "--temperature", "1", "--top-p", "0"], "--top-p: 0.0 is out of range"),
                       (["--chat", "--token-ids", "1,2"], "--chat: sends a text as a user's turn")):
        done = generate(*args)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (args, done.stderr)
        assert lines[0].startswith(f"titan-checkpoint: error: {said}"), (args, lines)
