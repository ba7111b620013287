"""The command line, checked before Hydra composes it: what Hydra would refuse with a multi-line dump (an
option of a plugin that is not enabled, a preset that does not exist, a misspelled key, bad override
syntax) is refused in one line; and the job config composed from it, as the launcher composes it."""

from __future__ import annotations

import importlib.util
import shutil

from hydra import compose, initialize_config_module
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.plugins import Plugins
from hydra.errors import HydraException, OverrideParseException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from titan_core.errors import ConfigError
from titan_core.job.run_dir import default_run_dir
from titan_core.job.schema import (CONF_GROUP, CORE_SECTIONS, check_config_kinds, check_key, default_preset,
                                   option_files)
from titan_core.job.searchpath import PluginConfigSearchPath
from titan_core.discovery import installed_plugins

# Hydra's flags that take a value, which may follow as the next argument (``--cfg job``).
VALUE_FLAGS = ("--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn", "--config-dir",
               "-cd", "--info", "-i", "--experimental-rerun")
# Flags that bring a config of the user's own, which may enable plugins or add presets the command line does not show.
OWN_CONFIG_FLAGS = ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp")


def register_with_hydra() -> None:
    """Put the installed plugins' options on Hydra's search path and define the run dir's resolver (both
    idempotent): before anything composes the config."""
    OmegaConf.register_new_resolver("titan_run_dir", default_run_dir, replace=True)
    Plugins.instance().register(PluginConfigSearchPath)


def composed(overrides: list[str], checked: bool = True):
    """The job config of a command line's overrides, composed as the launcher composes it; with ``checked``,
    the command line and every option's kind are checked first (one-line ConfigErrors)."""
    if checked:
        check_command_line(overrides)
    register_with_hydra()
    with initialize_config_module("titan_core.conf", version_base=None):
        config = compose("config", overrides=list(overrides))
    if checked:
        check_config_kinds(config)
    return config


def config_options(group: str) -> set[str]:
    """Names of the ``<group>/<name>.yaml`` options (``plugins``, ``model``) that the core and the installed
    distributions ship."""
    return set(option_files(group))


def check_plugin_names(names) -> None:
    """Fail on a requested plugin that is not installed, before Hydra tries to compose it."""
    installed, options = installed_plugins(), config_options("plugins")
    for name in names:
        if name not in installed:
            known = ", ".join(sorted(installed)) or "none"
            raise ConfigError(f"plugins={name}", f"no installed plugin is named '{name}' (installed: {known})",
                              f"install the distribution that provides it, or pick one of: {known}")
        if name not in options:
            raise ConfigError(f"plugins={name}", f"plugin '{name}' is installed but ships no plugins/{name}.yaml",
                              f"add a '{CONF_GROUP}' entry point to its distribution pointing at its conf package")


def override_args(argv: list[str]) -> list[str]:
    """The overrides of a command line: its arguments that are neither flags nor a flag's value."""
    return [arg for before, arg in zip([None, *argv], argv) if not arg.startswith("-") and before not in VALUE_FLAGS]


def _overrides(argv: list[str]) -> list:
    try:
        return OverridesParser.create().parse_overrides(override_args(argv))
    except OverrideParseException as error:
        raise ConfigError("command line", _first_line(error), "see docs/config.md; Hydra's override grammar: "
                          "https://hydra.cc/docs/advanced/override_grammar/basic") from None


def _first_line(error: Exception) -> str:
    return next(line.strip() for line in f"{error}\n{type(error).__name__}".splitlines() if line.strip())


def check_composes(argv: list[str]) -> None:
    """Whatever else Hydra would refuse to compose (appending a key that exists, overriding the plugin list
    without ``+``, an unknown ``hydra.*`` key), in one line with Hydra's own hint."""
    try:
        composed(override_args(argv), checked=False)
    except (HydraException, OmegaConfBaseException) as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        hint = next((line for line in lines[1:] if line.startswith("To ")), None)
        fix = (hint[0].lower() + hint[1:] if hint else "drop the '+' to change an option that exists"
               if "already at" in str(error) else "see docs/config.md")
        raise ConfigError("command line", lines[0] if lines else type(error).__name__, fix) from None


def _names(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    items = value if isinstance(value, list) else getattr(value, "list", [])
    return [n for item in items for n in _names(item)]


def requested_plugins(argv: list[str]) -> list[str]:
    """Plugin names in ``plugins=`` overrides of the command line, sweeps included."""
    return [n for o in _overrides(argv) if o.key_or_group == "plugins" for n in _names(o.value())]


def check_command_line(argv: list[str]) -> None:
    """What Hydra would refuse with a multi-line dump, refused in one line before it composes anything: an
    option of a plugin that is not enabled, a model preset that does not exist, a plugin not installed, a
    misspelled key (with the nearest real one)."""
    plugins = requested_plugins(argv)
    check_plugin_names(plugins)
    if any(arg.split("=")[0] in OWN_CONFIG_FLAGS for arg in argv):
        return
    presets = [p for o in _overrides(argv) if o.key_or_group == "model" for p in _names(o.value())]
    for override in _overrides(argv):
        key = override.key_or_group
        changes = not (override.is_add() or override.is_force_add() or override.is_delete())
        if override.is_delete() and key.split(".")[0] in CORE_SECTIONS:
            raise ConfigError(key, "is the core's and cannot be removed", f"set it instead ({key}=...)")
        if key.startswith("plugins.") and changes and key.split(".")[1] not in plugins:
            name = key.split(".")[1]
            raise ConfigError(f"plugins.{name}", "is set but the plugin is not enabled",
                              f"enable it with +plugins=[{name}] (or remove the override)")
        if key == "model" and changes:
            known = config_options("model")
            for preset in _names(override.value()):
                if preset not in known:
                    raise ConfigError("model", f"no model preset is named '{preset}' (presets: "
                                      f"{', '.join(sorted(known))})", "pick one of them, or install the model "
                                      "plugin that ships it")
        if changes and "." in key:
            for preset in presets or [default_preset()]:
                check_key(key, preset)
    multirun = any(arg in ("-m", "--multirun") for arg in argv)
    check_launcher(argv, multirun)
    if not multirun:  # a sweep's values compose one job at a time
        check_composes(argv)


def check_launcher(argv: list[str], multirun: bool) -> None:
    """A Hydra launcher (SLURM through submitit) is installed and gets the jobs: only a multirun has it run them."""
    launcher = next((o for o in _overrides(argv) if o.key_or_group == "hydra/launcher"), None)
    if launcher is None:
        return
    if not multirun and not any(arg.split("=")[0] in ("--cfg", "-c") for arg in argv):
        raise ConfigError("hydra/launcher", "Hydra hands the jobs of a multirun to a launcher; without -m this job "
                          "would run here", "add -m")
    if str(launcher.value()) in ("slurm", "submitit_slurm", "submitit_local") and \
            importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is None:
        raise ConfigError("hydra/launcher", "SLURM jobs go through Hydra's submitit launcher, which is not "
                          "installed", "pip install 'titan-trainer[slurm]'")
    if str(launcher.value()) in ("slurm", "submitit_slurm") and shutil.which("sbatch") is None:
        raise ConfigError("hydra/launcher", "this machine has no SLURM (no sbatch on the PATH) to submit the jobs to",
                          "run the command on the cluster's login node, or drop hydra/launcher to run here")
