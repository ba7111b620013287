"""The config's schema is its defaults: each option takes the kind of value its shipped default has.

The files a user reads are the schema: the core's ``conf/config.yaml``, each plugin's
``plugins/<name>.yaml`` and a model family's presets (``model/<preset>.yaml`` with the same ``name``).
A default of ``true`` wants true or false, ``2`` an integer, ``1.0`` a number, ``"inductor"`` a string,
``[a, b]`` a list of such items; a default of null leaves the kind to the owner's ``validate``. Reading
the files, not dataclasses, keeps plugin code out of composition (Hydra's structured configs would
import every installed plugin to compose a config) and gives a third-party plugin its schema for free.
Ranges and choices stay with the owner: the core's ``titan_core.run``, a plugin's ``validate``.
"""

from __future__ import annotations

import difflib
from functools import cache
from importlib.metadata import entry_points
from importlib.resources import files
from importlib.resources.abc import Traversable

from omegaconf import OmegaConf

from titan_core.errors import ConfigError
from titan_core.discovery import distribution_name

CONF_GROUP = "titan_core.conf"
CORE_CONF = "titan_core.conf"
CORE_SECTIONS = ("training", "optimizer", "lr_scheduler", "data", "validation", "tokenizer", "metrics", "launch",
                 "testing")
# Core options whose null is meaningful although their default is not.
CORE_NULLABLE = ("training.max_norm",)


def conf_packages() -> list:
    """The config packages of the core and of the installed distributions: a distribution whose code is gone (an
    editable install whose folder moved) is one line naming it, not a traceback."""
    packages = [files(CORE_CONF)]
    for ep in entry_points(group=CONF_GROUP):
        try:
            packages.append(files(ep.value))
        except ModuleNotFoundError as error:
            raise ConfigError(f"plugins.{ep.name}", f"the installed distribution {distribution_name(ep)} names the "
                              f"config package '{ep.value}', which cannot be imported ({error})",
                              f"reinstall {distribution_name(ep)} (pip install -e <its folder>) or pip uninstall "
                              f"{distribution_name(ep)}") from None
    return packages


def option_files(group: str) -> dict:
    """The ``<group>/<name>.yaml`` files (``plugins``, ``model``) that the core and the installed
    distributions ship, by name."""
    found: dict[str, Traversable] = {}
    for package in conf_packages():
        folder = package.joinpath(group)
        if folder.is_dir():
            found |= {f.name[:-5]: f for f in folder.iterdir() if f.name.endswith(".yaml")}
    return found


def _load(file) -> dict:
    return OmegaConf.to_container(OmegaConf.create(file.read_text()))


@cache
def core_defaults() -> dict:
    return _load(files(CORE_CONF).joinpath("config.yaml"))


def plugin_defaults(name: str) -> dict:
    return _load(option_files("plugins")[name]).get(name) or {}


def default_preset() -> str:
    return next(entry["model"] for entry in core_defaults()["defaults"] if isinstance(entry, dict))


def family_defaults(family: str | None) -> tuple[dict, set[str]]:
    """Every option of the model family's presets, each with its first non-null value among them, and the
    options some preset leaves null (null is meaningful there)."""
    merged: dict = {}
    nullable = set()
    presets = option_files("model")  # each call reads every distribution's metadata
    for preset in sorted(presets):
        options = _load(presets[preset])
        if options.get("name") == family:
            for key, value in options.items():
                if merged.get(key) is None:
                    merged[key] = value
                if value is None:
                    nullable.add(f"model.{key}")
    return merged, nullable


def preset_family(preset: str) -> str | None:
    file = option_files("model").get(preset)
    return None if file is None else _load(file).get("name")


def _kind(default) -> str:
    if isinstance(default, bool):
        return "true or false"
    if isinstance(default, int):
        return "an integer"
    if isinstance(default, float):
        return "a number"
    if isinstance(default, str):
        return "a string"
    if isinstance(default, dict):
        return "a mapping"
    item = f" of {_kind(default[0]).split(' ', 1)[1]}s" if default and not isinstance(default[0], bool) else ""
    return f"a list{item}"


def show(value) -> str:
    """``value`` written as on the command line."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return f"[{','.join(map(show, value[:2]))}{',...' if len(value) > 2 else ''}]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{show(v)}" for k, v in list(value.items())[:2]) + (",...}" if len(value) > 2 else "}")
    return str(value)


def _fits(value, default) -> bool:
    if isinstance(default, bool):
        return isinstance(value, bool)
    if isinstance(default, int):
        return isinstance(value, int) and not isinstance(value, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(default, str):
        return isinstance(value, str)
    if isinstance(default, list):
        return isinstance(value, list) and (not default or all(_fits(v, default[0]) for v in value))
    return isinstance(value, dict)  # a mapping: checked key by key


def check_kinds(values: dict, defaults: dict, prefix: str, nullable=()) -> None:
    """Every option in ``values`` whose default is set has a value of the default's kind (or null, for the
    ``nullable`` fields)."""
    for key, default in defaults.items():
        field, value = f"{prefix}.{key}", values.get(key)
        if default is None or key not in values or value is None and field in nullable:
            continue
        if isinstance(default, dict) and isinstance(value, dict):
            check_kinds(value, default, field, nullable)
        elif not _fits(value, default):
            kind = _kind(default)
            quote = f" (quote it: {field}=\"'{value}'\")" if kind == "a string" and value is not None else ""
            raise ConfigError(field, f"{value!r} is not {kind}", f"set {field} to {kind}, e.g. {show(default)}{quote}")


def check_config_kinds(config) -> None:
    """The core's sections, each enabled plugin's options and the model's, against their defaults."""
    values = OmegaConf.to_container(config, resolve=True)
    core = core_defaults()
    for section in CORE_SECTIONS:
        check_kinds(values.get(section) or {}, core[section], section, CORE_NULLABLE)
    for name, options in (values.get("plugins") or {}).items():
        if name in option_files("plugins"):
            check_kinds(options, plugin_defaults(name), f"plugins.{name}")
    model = values.get("model") or {}
    defaults, nullable = family_defaults(model.get("name"))
    check_kinds(model, defaults, "model", nullable)


def check_key(key: str, preset: str) -> None:
    """A dotted command-line key names an existing option; else one line with the nearest one.

    ``preset`` is the model preset the command line selects (its family's options are the model's).
    """
    parts = key.split(".")
    if parts[0] == "plugins" and len(parts) > 2:
        if parts[1] not in option_files("plugins"):
            return  # an unknown plugin is reported by name elsewhere
        options, path = plugin_defaults(parts[1]), parts[:2]
        parts = parts[2:]
    elif parts[0] == "model" and len(parts) > 1:
        family = preset_family(preset)
        if family is None or parts[1:] == ["path"]:
            return  # a folder's family, known once its config.json is read, refuses what it does not know
        options, path = family_defaults(family)[0], parts[:1]
        parts = parts[1:]
    elif parts[0] in ("hydra", "plugins", "model", "defaults"):
        return
    else:
        options, path = {s: core_defaults()[s] for s in CORE_SECTIONS}, []
    for part in parts:
        if not isinstance(options, dict) or not options:
            return  # below a list or an open mapping, anything goes
        if part not in options:
            parent = ".".join(path) or "the config"
            near = difflib.get_close_matches(part, list(options), n=1)
            fix = (f"did you mean {'.'.join([*path, near[0]])}?" if near else
                   f"use one of {', '.join(sorted(options))}")
            raise ConfigError(".".join([*path, part]), f"is not an option of {parent}",
                              f"{fix} (a key of your own needs +{key}=...)")
        options, path = options[part], [*path, part]
