"""``model.path``: a job that starts from a Hugging Face folder takes its model and tokenizer from the folder.

The folder's ``config.json`` gives the model's options through the model plugin of its family (the
``hf_model_options`` hook), so nobody re-types them; an option set otherwise that disagrees with the file would
build another model silently (a RoPE base, a norm epsilon and a routing rule change no tensor's shape), so it is
refused. The folder's ``tokenizer.json`` and special tokens replace the built-in tokenizer. Its weights are loaded
by the plugin that loads checkpoints; a job without one would train from random weights, so it is refused too.

``model.path`` (and ``tokenizer.path``) may also name a model on the Hugging Face hub (``Qwen/Qwen3-0.6B``): its
files (config, safetensors weights, tokenizer) are downloaded once into huggingface_hub's cache, with its progress
bars, and the job reads the cached folder; offline, or with the hub out of reach, a model already in the cache is
read from there, and one that is not is one line naming the id and the cache.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pluggy
from huggingface_hub import constants as hub_constants
from huggingface_hub import snapshot_download
from omegaconf import DictConfig, OmegaConf, open_dict

import titan_core.hookspecs as hookspecs
from titan_core.capabilities import CHECKPOINTING
from titan_core.errors import ConfigError
from titan_core.job.schema import core_defaults
from titan_core.discovery import installed_models, model_name, plugin_object
from titan_core.plugins import Registry

FIELD = "model.path"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # organisation/name, as a hub names a model
CORE_KEYS = ("name", "path")  # the model section's keys that are the core's, not the family's
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"]
MODEL_FILES = ["config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json", *TOKENIZER_FILES]
logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # its retry and cache chatter: the one line says it


def from_hub(name: str, field: str, files: list[str]) -> Path:
    """The local folder of hub model ``name``: huggingface_hub's cached snapshot, downloaded first (only ``files``)
    when missing and the hub can be reached."""
    try:
        return Path(snapshot_download(name, allow_patterns=files))
    except Exception as error:  # offline, unreachable, unknown or gated id: huggingface_hub's many kinds of error
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ConfigError(field, f"{name} is not in the hub cache ({hub_constants.HF_HUB_CACHE}) and could not be "
                          f"downloaded ({reason})", f"download it where the hub can be reached (huggingface-cli "
                          f"download {name}), or set {field}=<a local folder>") from None


def local_or_hub(path: str, field: str, files: list[str]) -> str:
    """``path`` as given, or the cached folder of the hub model it names when no such local path exists (a missing
    file such as ``tokenizer.json`` stays a missing file, named as such)."""
    if Path(path).expanduser().exists() or not HUB_ID.fullmatch(path) or path.endswith(".json"):
        return path
    return str(from_hub(path, field, files))


def apply_model_folder(config) -> None:
    """Fill ``config.model`` and ``config.tokenizer`` in place from the folder ``model.path`` names (nothing
    when it is null). Applying it twice changes nothing, so every process of a job may apply it."""
    tokenizer = config.get("tokenizer") or {}
    if isinstance(tokenizer.get("path"), str):
        with open_dict(config):
            config.tokenizer.path = local_or_hub(tokenizer["path"], "tokenizer.path", TOKENIZER_FILES)
    model = config.get("model") or {}
    path = model.get("path")
    if path is None:
        if "path" in model and model.get("name") is None:
            raise ConfigError(FIELD, "model=hf starts from a Hugging Face folder and none is named",
                              "set model.path=<folder> (or pick a model preset)")
        return
    if not isinstance(path, str) or not path:
        raise ConfigError(FIELD, f"{path!r} is not a folder path", "set model.path to a Hugging Face model folder")
    path = local_or_hub(path, FIELD, MODEL_FILES)
    folder = Path(path).expanduser()
    hf_config = read_config_json(folder)
    options = folder_options(hf_config, config.model.get("name"), folder)
    for key, value in config.model.items():
        if key not in CORE_KEYS and key in options and value is not None and value != options[key]:
            raise ConfigError(f"model.{key}", f"{value!r} disagrees with {options[key]!r} in {folder / 'config.json'}",
                              f"drop model.{key} to take the folder's value (or use another folder)")
    with open_dict(config):
        config.model = {**config.model, **options, "path": path}
        config.tokenizer = folder_tokenizer(config.tokenizer, folder)


def folder_config(folder: str | Path, seq_len: int, model: str | None = None) -> DictConfig:
    """The ``model``, ``tokenizer`` and ``training.seq_len`` sections a job starting from the Hugging Face
    ``folder`` gets (its model built by the plugin ``model`` names, else by the one reading its model_type), for
    tools that train nothing (``model_description``, ``build_meta_model``, ``load_tokenizer`` take it)."""
    config = OmegaConf.create({"model": {"name": model, "path": str(folder)}, "tokenizer": core_defaults()["tokenizer"],
                               "training": {"seq_len": seq_len}})
    apply_model_folder(config)
    return config


def read_config_json(folder: Path) -> dict:
    file = folder / "config.json"
    if folder.is_file():
        raise ConfigError(FIELD, f"{folder} is a file, not a Hugging Face model folder",
                          f"set model.path={folder.parent}" if folder.name == "config.json" else
                          "point model.path at the folder holding config.json and the weights")
    if not file.is_file():
        raise ConfigError(FIELD, f"{folder} has no config.json", "point model.path at a Hugging Face model folder")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(FIELD, f"cannot read {file} ({error})", "fix or replace the folder's config.json") from None


def folder_options(hf_config: dict, name: str | None, folder: Path) -> dict:
    """The options of the one model plugin that reads ``hf_config``: the one ``name`` selects, else whichever
    installed one claims the file."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    models = installed_models()
    if name is not None:
        models = {name: models[model_name({"model": {"name": name}})]}
    for model, entry_point in models.items():
        try:
            manager.register(plugin_object(entry_point), name=model)
        except pluggy.PluginValidationError as error:
            raise ConfigError(f"model.{model}", f"model plugin '{model}' does not fit the hook contract: {error}",
                              "fix its hook implementations (see titan_core.hookspecs)") from None
    answers = [answer for answer in manager.hook.hf_model_options(hf_config=hf_config, selected=name is not None)
               if answer is not None]
    model_type = hf_config.get("model_type")
    if not answers:
        readers = f"model '{name}'" if name else f"any installed model plugin ({', '.join(sorted(models))})"
        raise ConfigError(FIELD, f"{folder / 'config.json'} is model_type '{model_type}', which {readers} does not read",
                          "install the model plugin of its family" + (", or set model.name=null" if name else ""))
    if len(answers) > 1:
        names = sorted(str(a.get("name")) for a in answers)
        raise ConfigError(FIELD, f"model plugins {', '.join(names)} all read model_type '{model_type}'",
                          f"choose one with model.name={names[0]}")
    return answers[0]


def folder_tokenizer(tokenizer, folder: Path) -> dict:
    """``tokenizer`` with the folder's tokenizer.json and special tokens where it keeps the core's defaults."""
    defaults = core_defaults()["tokenizer"]
    tokenizer = dict(tokenizer)
    if tokenizer["path"] == defaults["path"]:
        if not (folder / "tokenizer.json").is_file():
            raise ConfigError("tokenizer.path", f"{folder} has no tokenizer.json and the built-in tokenizer's ids are "
                              "other text than the model's", "set tokenizer.path to the model's tokenizer.json")
        tokenizer["path"] = str(folder)
    settings = folder / "tokenizer_config.json"
    special = json.loads(settings.read_text()) if settings.is_file() else {}
    eos = token_text(special.get("eos_token"))
    # A model without a begin-of-text token (Qwen) was pretrained on documents its end-of-text token separates.
    bos = token_text(special.get("bos_token")) or eos
    for key, value in (("bos_token", bos), ("eos_token", eos)):
        if value is not None and tokenizer[key] == defaults[key]:
            tokenizer[key] = value
    return tokenizer


def token_text(token) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or a record holding it as ``content``."""
    return token.get("content") if isinstance(token, dict) else token


def check_weights_loader(config, registry: Registry) -> None:
    """A job starting from a folder has a plugin that loads its weights."""
    if (config.get("model") or {}).get("path") is not None and registry.owner("load_checkpoint") is None:
        raise ConfigError(FIELD, "no enabled plugin loads checkpoints, so the folder's weights would not be loaded "
                          "and the model would train from random weights",
                          f"add a plugin that provides '{CHECKPOINTING}' (implements load_checkpoint) to +plugins=[...]")
