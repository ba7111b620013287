"""Every numeric field of the core's config: one bad value each is refused with the one-line error naming the
field, before anything starts; the defaults pass."""

import socket
from pathlib import Path

import pytest

from titan_core.errors import ConfigError
from titan_core.job.checks import NUMBERS, check_numbers
from titan_core.testing import compose as config, config_error as refusal, merged


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
    "metrics.progress_every_s": "-1",
    "metrics.peak_tflops": "nan",
    "metrics.profile_steps": "[3,2]",
    "validation.every": "-2",
    "data.prefetch": "-1",
    "validation.batches": "0",
    "validation.holdout_every": "1",
    "launch.world_size": "0",
    "launch.max_restarts": "-1",
    "launch.cpu_threads_per_worker": "true",
    "launch.init_timeout_s": "0",
    "launch.hang_timeout_s": "-5",
    "launch.stop_timeout_s": "0",
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
    check_numbers(config("training.max_norm=null", "metrics.peak_tflops=null", "launch.world_size=4",
                         "metrics.profile_steps=[2,2]"))


@pytest.mark.parametrize("argv, message", [
    (["plugins.ep.degree=2"], "plugins.ep: is set but the plugin is not enabled; fix: enable it with +plugins=[ep]"),
    (["-m", "plugins.fsdp.degree=2,4"], "plugins.fsdp: is set but the plugin is not enabled"),
    (["model=qwen3_tin"], "model: no model preset is named 'qwen3_tin' (presets: 405B, 70B, 8B, debug,"),
    (["training.steps=["], "command line: no viable alternative at input '['; fix: see docs/config.md; Hydra's"),
    (["+training.steps=3"], "command line: Could not append to config. An item is already at 'training.steps'.; "
                            "fix: drop the '+'"),
    (["plugins=[fsdp]"], "command line: Could not override 'plugins'. No match in the defaults list.; fix: to "
                         "append to your default list use +plugins=['fsdp']"),
    (["hydra.foo=1"], "command line: Could not override 'hydra.foo'."),
    (["~training"], "training: is the core's and cannot be removed"),
])
def test_what_hydra_would_dump_is_one_line_before_it_composes(argv, message):
    from titan_core.job.command_line import check_command_line

    with pytest.raises(ConfigError) as error:
        check_command_line(argv)
    assert str(error.value).startswith(message), error.value


@pytest.mark.parametrize("argv", [["+plugins=[ep,fsdp]", "plugins.ep.degree=2"], ["-m", "model=tiny,qwen3_moe_tiny"],
                                  ["--config-name=mine", "plugins.fsdp.degree=2"], ["hydra.run.dir=/tmp/x"],
                                  ["++training.extra=1"]])
def test_enabled_plugins_known_presets_and_own_configs_pass(argv):
    from titan_core.job.command_line import check_command_line

    check_command_line(argv)


# Values each option of every shipped plugin refuses (options without a default: a wrong kind too), with the
# base a plugin needs to be planned at all.
SFT_DATA = Path(__file__).parents[1] / "plugins" / "sft" / "tests" / "data"
PLUGIN_BAD = {
    "plugins.ac.mode": "partial", "plugins.ac.every": "0", "plugins.ac.save_ops": "[not_an_op]",
    "plugins.ac.matmuls": ("half", "2"),
    "plugins.checkpoint.folder": "7", "plugins.checkpoint.interval": "-1", "plugins.checkpoint.keep_latest_k": "-1",
    "plugins.checkpoint.async_save": "1", "plugins.checkpoint.async_writer": "fork",
    "plugins.checkpoint.load_path": ("/nonexistent/run", "7"),
    "plugins.checkpoint.load_parts": "[weights]", "plugins.checkpoint.final_model_only": "yes",
    "plugins.checkpoint.export_dtype": "int8", "plugins.checkpoint.export_hf": "2",
    "plugins.chunked_loss.chunk_tokens": "0",
    "plugins.compile.backend": "nope", "plugins.compile.mode": "fast", "plugins.compile.fullgraph": "1",
    "plugins.compile.compile_loss": "no",
    "plugins.cp.degree": "0", "plugins.cp.rotate_method": "ring", "plugins.cp.load_balance": "1",
    "plugins.ep.degree": "0",
    "plugins.float8.recipe": "fp4", "plugins.float8.filter_fqns": "output",
    "plugins.float8.fsdp_float8_all_gather": "1",
    "plugins.fsdp.degree": "0", "plugins.fsdp.replicate_degree": "0", "plugins.fsdp.param_dtype": "int8",
    "plugins.fsdp.reduce_dtype": "float64", "plugins.fsdp.reshard_after_forward": "sometimes",
    "plugins.fsdp.cpu_offload": "1", "plugins.fsdp.prefetch": "-1", "plugins.fsdp.reduce_gradients": "sometimes",
    "plugins.pp.degree": "0", "plugins.pp.schedule": "Zigzag", "plugins.pp.microbatches": ("0", "abc"),
    "plugins.pp.stages_per_rank": ("0", "1.5"), "plugins.pp.layers_per_stage": ("0", "true"), "plugins.pp.first_stage_fewer_layers": "-1",
    "plugins.pp.last_stage_fewer_layers": "2.5", "plugins.pp.placement": ("zigzag", "7"),
    "plugins.pp.schedule_csv": ("/nonexistent/schedule.csv", "7"),
    "plugins.simplefsdp.degree": "-2", "plugins.simplefsdp.replicate_degree": "0",
    "plugins.simplefsdp.param_dtype": "int8", "plugins.simplefsdp.reduce_dtype": "half",
    "plugins.tp.degree": "abc", "plugins.tp.sequence_parallel": "1", "plugins.tp.loss_parallel": "2",
    "plugins.tp.async_tp": "maybe",
    "plugins.wandb.project": "7", "plugins.wandb.entity": "7", "plugins.wandb.name": "7", "plugins.wandb.group": "7",
    "plugins.wandb.tags": "smoke", "plugins.wandb.mode": "cloud", "plugins.wandb.dir": "7",
    "plugins.mlflow.tracking_uri": "7", "plugins.mlflow.experiment": "7", "plugins.mlflow.run_name": "7",
    "plugins.mlflow.tags": "[llm]",
    "plugins.lora.rank": "0", "plugins.lora.alpha": "0", "plugins.lora.dropout": "1.0", "plugins.lora.rslora": "1",
    "plugins.lora.targets": ("[attn]", "[]"), "plugins.lora.init_from": ("/nonexistent/adapter", "7"),
    "plugins.lora.export": "2", "plugins.lora.base_dtype": ("float16", "7"),
    "plugins.overrides.modules": ("[fused_mlp]", "[]", "fused_swiglu"), "plugins.overrides.activation": ("triton", "7"),
    "plugins.ft.lighthouse": ("localhost", "http://localhost:9", "7"), "plugins.ft.replica_group": ("2", "-1", "x"),
    "plugins.ft.group_count": "0", "plugins.ft.min_replicas": ("0", "3"), "plugins.ft.mode": "async",
    "plugins.ft.sync_every": ("0", "5"), "plugins.ft.outer_lr": ("0", "0.5"), "plugins.ft.outer_momentum": "1.0",
    "plugins.ft.quorum_timeout_s": "0", "plugins.ft.timeout_s": "-5", "plugins.ft.connect_timeout_s": "inf",
    "plugins.ft.may_differ": ("[trainng.steps]", "training.steps"),
    "plugins.muon.lr": "0", "plugins.muon.weight_decay": "-1", "plugins.muon.momentum": "1.0",
    "plugins.muon.nesterov": "1", "plugins.muon.adjust_lr": "moonlight", "plugins.muon.ns_steps": ("0", "2.5"),
    "plugins.muon.ns_coefficients": "[1,2]", "plugins.muon.ns_dtype": "float16", "plugins.muon.eps": "0",
    "plugins.muon.momentum_dtype": "int8",
    "plugins.sft.path": ("/nonexistent/chat.jsonl", str(SFT_DATA / "chatml.jinja")), "plugins.sft.name": "7",
    "plugins.sft.split": "7", "plugins.sft.messages_field": ("7", "conversation"),
    "plugins.sft.chat_template": ("/nonexistent/template.jinja", "7"), "plugins.sft.packing": "1",
    "plugins.sft.holdout_every": ("1", "-3"), "plugins.sft.bad_rows": "ignore",
}
# Something answering where ft's lighthouse is said to be: its options are checked after the lighthouse answers.
LISTENING = socket.create_server(("localhost", 0))
PLUGIN_BASE = {"ep": ["model=qwen3_moe_tiny", "+plugins=[fsdp,ep]"], "simplefsdp": ["+plugins=[simplefsdp]"],
               "fsdp": ["+plugins=[fsdp]"],
               "ft": ["+plugins=[fsdp,ft]", f"plugins.ft.lighthouse=http://localhost:{LISTENING.getsockname()[1]}"],
               "sft": ["+plugins=[fsdp,sft]", f"plugins.sft.path={SFT_DATA / 'chat.jsonl'}",
                       f"plugins.sft.chat_template={SFT_DATA / 'chatml.jinja'}", "training.attention_mask=block_causal",
                       "tokenizer.path=builtin", "training.seq_len=256"]}
TINY_WORLD = ["model=tiny", "tokenizer.path=bytes", "training.seq_len=32", "launch.world_size=4"]


def test_every_option_of_every_shipped_plugin_has_a_bad_value_here():
    from titan_core.job.schema import option_files, plugin_defaults

    shipped = {f"plugins.{name}.{key}" for name in option_files("plugins") for key in plugin_defaults(name)}
    assert set(PLUGIN_BAD) == shipped - {f"plugins.{name}._plugin_" for name in option_files("plugins")}


@pytest.mark.parametrize("field, value", [(field, value) for field, values in sorted(PLUGIN_BAD.items())
                                          for value in ((values,) if isinstance(values, str) else values)])
def test_a_bad_plugin_option_is_refused_naming_it(field, value):
    plugin = field.split(".")[1]
    base = PLUGIN_BASE.get(plugin, [f"+plugins=[fsdp,{plugin}]"])
    error = refusal(*merged(TINY_WORLD, base), f"{field}={value}")
    assert error.field == field, error


def every_option(group: str) -> list[tuple[str, object]]:
    """(field, default) of every option with a default in the core's sections or the model families."""
    from titan_core.job.schema import CORE_SECTIONS, core_defaults, family_defaults, option_files, preset_family

    if group == "core":
        return [(f"{s}.{k}", v) for s in CORE_SECTIONS for k, v in core_defaults()[s].items() if v is not None]
    families = sorted({preset_family(p) for p in option_files("model")} - {None})  # hf: the folder says
    return [(f"model.{k}", v, family) for family in families for k, v in family_defaults(family)[0].items()
            if v is not None and k != "name"]


@pytest.mark.parametrize("field, default", every_option("core"))
def test_a_core_option_of_another_kind_is_refused(field, default):
    wrong = "'7'" if not isinstance(default, str) else "7"
    assert refusal(*TINY_WORLD, f"{field}={wrong}").field == field


@pytest.mark.parametrize("field, default, family", every_option("model"))
def test_a_model_option_of_another_kind_is_refused(field, default, family):
    from titan_core.job.schema import check_config_kinds, option_files, preset_family

    preset = next(p for p in sorted(option_files("model")) if preset_family(p) == family)
    wrong = "'7'" if not isinstance(default, str) else "7"
    with pytest.raises(ConfigError) as error:
        check_config_kinds(config(f"model={preset}", f"{field}={wrong}"))
    assert error.value.field == field


@pytest.mark.parametrize("key, suggestion", [
    ("training.stesp", "training.steps"), ("plugins.tp.degre", "plugins.tp.degree"), ("model.dimm", "model.dim"),
    ("optimiser.lr", "optimizer"), ("model.hidden_sise", "model.hidden_size"),
])
def test_a_misspelled_key_names_the_nearest_option(key, suggestion):
    argv = ["+plugins=[tp]", "model=qwen3_tiny"] if key.endswith("sise") else ["+plugins=[tp]"]
    error = refusal(*argv, f"{key}=2")
    assert str(error).startswith(f"{key.split('.')[0] if key.startswith('optimiser') else key}: is not an option")
    assert f"did you mean {suggestion}" in str(error), error


def test_null_is_taken_only_where_it_means_something():
    from titan_core.job.schema import check_config_kinds

    check_config_kinds(config("training.max_norm=null", "model.vocab_size=null", "model=8B"))
    assert refusal(*TINY_WORLD, "training.seq_len=null").field == "training.seq_len"


# The core's other fields: one command line each that is refused naming the field.
CORE_BAD = {
    "training.steps": ["training.steps=-1"], "training.global_batch_size": ["training.global_batch_size=0"],
    "training.seq_len": ["training.seq_len=0"], "training.grad_accum_steps": ["training.grad_accum_steps=0"],
    "training.deterministic": ["training.deterministic=1"], "training.attention_mask": ["training.attention_mask=full"],
    "optimizer.implementation": ["optimizer.implementation=adam"],
    "optimizer.state_dtype": ["optimizer.state_dtype=float16"], "lr_scheduler.decay": ["lr_scheduler.decay=step"],
    "data.source": ["data.source=s3"], "data.path": ["data.source=local", "data.path=/nonexistent/corpus"],
    "data.split": ["data.split=7"], "data.text_field": ["data.text_field=[text]"],
    "data.mixture": ["data.mixture=[{path:/nonexistent,weight:1}]"], "data.shuffle": ["data.shuffle=true"],
    "validation.source": ["validation.every=2", "validation.source=builtin"],
    "validation.path": ["validation.every=2", "validation.source=local", "validation.path=/nonexistent/held-out"],
    "validation.split": ["validation.split=7"], "validation.text_field": ["validation.text_field=[text]"],
    "tokenizer.path": ["tokenizer.path=/nonexistent/tokenizer.json"], "tokenizer.bos_token": ["tokenizer.bos_token=1"],
    "tokenizer.eos_token": ["tokenizer.eos_token=false"], "metrics.tensorboard": ["metrics.tensorboard=yes"],
    "launch.device": ["launch.device=tpu"], "launch.backend": ["launch.device=cpu", "launch.backend=nccl"],
    "launch.dry_run": ["launch.dry_run=1"], "testing.save_final_weights": ["testing.save_final_weights=1"],
    "launch.check_memory": ["launch.check_memory=1"], "lr_scheduler.decay_steps": ["lr_scheduler.decay_steps=100000"],
    "lr_scheduler.decay_shape": ["lr_scheduler.decay_shape=exp"], "data.damaged": ["data.damaged=ignore"],
    "training.compute_dtype": ["training.compute_dtype=float16"],
    "optimizer.no_weight_decay": ["optimizer.no_weight_decay=[norms]"],
    "optimizer.lr_multipliers": ["optimizer.lr_multipliers=7"],
}
# Read only with data.source=hub, where the Hub judges it (offline, the data.path line names the dataset).
HUB_ONLY = {"data.name", "validation.name"}


def test_every_core_field_has_a_bad_value_here():
    from titan_core.job.schema import CORE_SECTIONS, core_defaults

    fields = {f"{section}.{key}" for section in CORE_SECTIONS for key in core_defaults()[section]}
    assert set(BAD) | set(CORE_BAD) | HUB_ONLY == fields


@pytest.mark.parametrize("field", sorted(CORE_BAD))
def test_a_bad_core_value_is_refused_naming_the_field(field):
    overrides = [o for o in TINY_WORLD if not o.startswith("launch.world_size")]
    assert refusal(*overrides, *CORE_BAD[field]).field == field
