"""Every numeric field of the core's config: one bad value each is refused with the one-line error naming the
field, before anything starts; the defaults pass."""

import pytest
from hydra import compose, initialize_config_module

from titan_core.errors import ConfigError
from titan_core.run import NUMBERS, check_numbers


def config(*overrides):
    with initialize_config_module("titan_core.conf", version_base=None):
        return compose("config", overrides=list(overrides))


BAD = {
    "training.max_norm": "-1.0",  # clipping to a negative norm would reverse every gradient
    "training.seed": "-3",
    "optimizer.lr": "0",
    "optimizer.betas": "[0.9,1.5]",
    "optimizer.eps": "-1e-8",
    "optimizer.weight_decay": "-0.1",
    "lr_scheduler.warmup_steps": "2.5",
    "lr_scheduler.min_lr_ratio": "1.5",
    "metrics.log_every": "0",
    "metrics.peak_tflops": "nan",
    "launch.world_size": "0",
    "launch.max_restarts": "-1",
    "launch.cpu_threads_per_worker": "true",
}


def test_every_numeric_field_has_a_bad_value_here():
    assert set(BAD) == {field for field, _, _ in NUMBERS}


@pytest.mark.parametrize("field", sorted(BAD))
def test_a_bad_value_is_refused_naming_the_field(field):
    with pytest.raises(ConfigError) as error:
        check_numbers(config(f"{field}={BAD[field]}"))
    assert str(error.value).startswith(f"{field}: ") and "; fix: set " in str(error.value), error.value


def test_the_defaults_and_the_nulls_pass():
    check_numbers(config())
    check_numbers(config("training.max_norm=null", "metrics.peak_tflops=null", "launch.world_size=4"))


@pytest.mark.parametrize("argv, message", [
    (["plugins.ep.degree=2"], "plugins.ep: is set but the plugin is not enabled; fix: enable it with +plugins=[ep]"),
    (["-m", "plugins.fsdp.degree=2,4"], "plugins.fsdp: is set but the plugin is not enabled"),
    (["model=qwen3_tin"], "model: no model preset is named 'qwen3_tin' (presets: 405B, 70B, 8B, debug,"),
])
def test_what_hydra_would_dump_is_one_line_before_it_composes(argv, message):
    from titan_core.run import check_command_line

    with pytest.raises(ConfigError) as error:
        check_command_line(argv)
    assert str(error.value).startswith(message), error.value


@pytest.mark.parametrize("argv", [["+plugins=[ep,fsdp]", "plugins.ep.degree=2"], ["-m", "model=tiny,qwen3_moe_tiny"],
                                  ["--config-name=mine", "plugins.fsdp.degree=2"]])
def test_enabled_plugins_known_presets_and_own_configs_pass(argv):
    from titan_core.run import check_command_line

    check_command_line(argv)
