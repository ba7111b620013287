"""The plan: order, conflicts and every kind of bad input, each refused in the launcher with exit code 2 (tables
of bad values are checked in this process, where the launcher finds them: a launch costs seconds a row)."""

import itertools
import re

import pytest

from titan_core.testing import TINY, config_error, error_line, merged, run_job

DRY = [*TINY, "launch.dry_run=true"]


def plan_lines(result) -> list[str]:
    """The plan's lines, without what follows them (what is on, and the estimate, measured on this machine)."""
    lines = result.stdout[result.stdout.index("titan-core plan:"):].splitlines()
    return [lines[0], *itertools.takewhile(lambda line: line.startswith("  "), lines[1:])]


def test_order_is_stage_then_name_whatever_the_command_line_order(tmp_path, fake_plugins):
    env = fake_plugins({
        "late": ("Declaration(stage=300)", ""),
        "early_b": ("Declaration(stage=100)", ""),
        "early_a": ("Declaration(stage=100)", ""),
        "observer": ("Declaration()", ""),
    })
    orders = ["[fsdp,late,observer,early_b,early_a]", "[observer,early_a,fsdp,early_b,late]"]
    plans = [plan_lines(run_job([*DRY, f"+plugins={order}", "plugins.fsdp.degree=2"], tmp_path / str(i), env=env))
             for i, order in enumerate(orders)]
    assert plans[0] == plans[1]
    names = [line.split()[1] for line in plans[0][1:]]
    assert names == ["early_a", "early_b", "late", "fsdp", "observer"]
    assert plans[0][0] == "titan-core plan: world 2 = dp_shard 2; model llama3"


def test_unknown_plugin_is_refused_before_hydra_composes(tmp_path):
    result = run_job([*DRY, "+plugins=[fsdp,nosuch]"], tmp_path, expect_success=False)
    assert result.returncode == 2
    assert "plugins=nosuch: no installed plugin is named 'nosuch'" in error_line(result)


def test_unknown_plugin_in_a_sweep_is_refused(tmp_path):
    result = run_job([*DRY, "-m", "+plugins=[fsdp],[nosuch]"], tmp_path, expect_success=False)
    assert result.returncode == 2
    assert "no installed plugin is named 'nosuch'" in error_line(result)


def test_two_distributions_with_one_plugin_name(tmp_path, fake_plugins):
    env = fake_plugins({"fsdp": ("Declaration()", "")}, distribution="impostor")
    result = run_job([*DRY, "+plugins=[fsdp]"], tmp_path, expect_success=False, env=env)
    assert result.returncode == 2
    line = error_line(result)
    assert "two installed distributions register 'fsdp' in titan_core.plugins" in line
    assert "titan-fsdp" in line and "impostor" in line


def test_two_plugins_providing_one_capability(tmp_path, fake_plugins):
    env = fake_plugins({"othershard": ("Declaration(provides=frozenset({'data_parallel_sharding'}))", "")})
    result = run_job([*DRY, "+plugins=[fsdp,othershard]", "plugins.fsdp.degree=2"], tmp_path,
                     expect_success=False, env=env)
    assert result.returncode == 2
    assert "plugins=[fsdp,othershard]: both provide 'data_parallel_sharding'" in error_line(result)


def test_missing_required_capability(tmp_path, fake_plugins):
    env = fake_plugins({"needy": ("Declaration(requires=frozenset({'compile'}))", "")})
    result = run_job([*DRY, "+plugins=[needy]"], tmp_path, expect_success=False, env=env)
    assert result.returncode == 2
    assert "plugins.needy: requires 'compile', which no enabled plugin provides" in error_line(result)


def test_one_mesh_dimension_sized_by_two_plugins(tmp_path, fake_plugins):
    env = fake_plugins({"shard2": ("Declaration(mesh={'dp_shard': 2})", "")})
    result = run_job([*DRY, "+plugins=[fsdp,shard2]", "plugins.fsdp.degree=2"], tmp_path,
                     expect_success=False, env=env)
    assert result.returncode == 2
    assert "mesh dimension 'dp_shard' is already sized" in error_line(result)


def test_override_of_a_plugin_that_is_not_enabled(tmp_path):
    result = run_job([*DRY, "++plugins.fsdp.degree=2"], tmp_path, expect_success=False)
    assert result.returncode == 2
    assert "plugins.fsdp: is set but the plugin is not enabled; fix: enable it with +plugins=[fsdp]" in error_line(result)


def test_degrees_that_do_not_match_the_torchrun_world(tmp_path):
    env = {"TORCHELASTIC_RUN_ID": "check", "WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}
    result = run_job([*DRY, "+plugins=[fsdp]", "plugins.fsdp.degree=2"], tmp_path, expect_success=False, env=env)
    assert result.returncode == 2
    assert "the degrees multiply to 2 but WORLD_SIZE from torchrun is 4" in error_line(result)


def test_fill_degree_without_a_world_size_on_cpu(tmp_path):
    result = run_job([*DRY, "+plugins=[fsdp]"], tmp_path, expect_success=False)
    assert result.returncode == 2
    assert error_line(result).startswith("titan-core: error: plugins.fsdp.degree: -1 needs a world size")


def test_fill_degree_takes_the_configured_world(tmp_path):
    result = run_job([*DRY, "+plugins=[fsdp]", "plugins.fsdp.replicate_degree=2", "launch.world_size=4"], tmp_path)
    assert "titan-core plan: world 4 = dp_replicate 2 x dp_shard 2" in result.stdout


def test_batch_that_does_not_split_over_data_parallel_ranks(tmp_path):
    result = run_job([*DRY, "+plugins=[fsdp]", "plugins.fsdp.degree=3"], tmp_path, expect_success=False)
    assert result.returncode == 2
    assert "training.global_batch_size: 8 sequences do not split over 3" in error_line(result)


def test_model_shapes_that_do_not_divide():
    for override, message in [("model.n_heads=3", "model.n_heads: dim 64 is not divisible by n_heads 3"),
                              ("model.n_kv_heads=3", "model.n_kv_heads: n_heads 4 is not divisible by n_kv_heads 3"),
                              ("model.vocab_size=100", "model.vocab_size: 100 is smaller than the tokenizer's 264")]:
        assert message in str(config_error(*DRY, override))


def test_missing_and_empty_data(tmp_path, data_dir):
    (data_dir / "empty.jsonl").write_text("")
    (data_dir / "blank.jsonl").write_text('{"text": ""}\n')
    cases = [(tmp_path / "nowhere", "data.path: {} does not exist"),
             (data_dir / "empty.jsonl", "data.path: {} is empty"),
             (data_dir / "blank.jsonl", "data.path: {} holds no non-empty document")]
    for path, message in cases:
        assert message.format(path) in str(config_error(*DRY, "data.source=local", f"data.path={path}"))


def test_wrong_text_field(tmp_path, data_dir):
    (data_dir / "docs.jsonl").write_text('{"body": "some text"}\n')
    result = run_job([*DRY, "data.source=local", f"data.path={data_dir}"], tmp_path / "run", expect_success=False)
    assert result.returncode == 2
    assert "data.text_field: the documents have no field 'text'" in error_line(result)


def test_unreadable_tokenizer_file(tmp_path):
    broken = tmp_path / "tokenizer.json"
    broken.write_text("{not json")
    for path in (broken, tmp_path / "missing.json"):
        assert re.search(rf"tokenizer.path: cannot read a tokenizer from {re.escape(str(path))} \(.+\); fix: ",
                         str(config_error(*DRY, f"tokenizer.path={path}")))


def test_nothing_is_written_for_refused_input(tmp_path):
    run_dir = tmp_path / "refused"
    result = run_job([*DRY, "model.n_heads=3"], run_dir, expect_success=False)
    assert result.returncode == 2
    assert not (run_dir / "config.yaml").exists()


@pytest.mark.parametrize("preset, option", [
    ("tiny", "n_kv_heads=0"), ("tiny", "rope_theta=-1.0"), ("qwen3_tiny", "head_dim=0"),
    ("qwen3_moe_tiny", "num_key_value_heads=0"), ("deepseek_v3_tiny", "kv_lora_rank=0"),
    ("deepseek_v3_tiny", "beta_fast=0.0"), ("gpt_oss_tiny", "original_max_position_embeddings=0"),
    ("qwen3_moe_tiny", "moe_intermediate_size=0"), ("deepseek_v3_tiny", "moe_intermediate_size=0"),
    ("gpt_oss_tiny", "moe_intermediate_size=0"), ("qwen3_moe_tiny", "num_experts=0"),
])
def test_a_model_size_rank_or_factor_that_is_not_positive_is_refused(preset, option):
    """Every family validates its sizes, ranks and factors where it reads them: a zero-width latent (DeepSeek-V3's
    kv_lora_rank=0) once trained with only torch's "zero-element tensors" warning."""
    name, value = option.split("=")
    error = config_error(*merged(DRY, [f"model={preset}", f"model.{option}"]))
    assert str(error).startswith(f"model.{name}: {float(value) if '.' in value else int(value)!r} is not a positive "
                                 "number; fix: set model.")
