"""The planner's --recommend: the plans that fit ranked by speed and printed as runs accept them, each at the expert
load given, LoRA kept, and one line when nothing fits."""

import importlib.util
from pathlib import Path

import pytest

from titan_core.errors import ConfigError
from titan_core.planner.hardware import hardware_profile
from titan_core.testing import compose

# What the planner's tests share, loaded by path as tracked_rank.py is (tests/ is not on the path).
spec = importlib.util.spec_from_file_location("planner_cases", Path(__file__).with_name("planner_cases.py"))
cases = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cases)
SMALL = cases.SMALL


def test_recommend_ranks_the_plans_that_fit_and_they_run_as_printed(tmp_path):
    from titan_core.launch.cluster import job_nodes
    from titan_core.planner.cli import recommendations
    from titan_core.launch.prepare import prepare

    text = recommendations(["--hardware", "a100", "--recommend", *SMALL, "launch.world_size=4",
                            "+plugins=[fsdp,tp,ac]", "plugins.ac.save_ops=[mm]"])
    header, *lines = text.splitlines()
    # fsdp (one option on one node) x tp (off, 2: the tiny model's 2 key/value heads) x ac (off, selective keeping
    # all matmuls or every other, full)
    assert header.startswith("titan-core: the 5 fastest of 8 plans that fit 4 x a100")
    speeds = [float(line.split(" tokens/s/device")[0].replace(",", "")) for line in lines]
    assert speeds == sorted(speeds, reverse=True)
    for line in lines:
        overrides = line.split("python -m titan_core.run ")[1].split()
        assert overrides[:len(SMALL)] == list(SMALL)
        # The user's setting stays with its plugin where it acts (refused by run where it would do nothing).
        assert ("plugins.ac.save_ops=[mm]" in overrides) == ("plugins.ac.mode=selective_op" in overrides)
        prepare(compose(*overrides), job_nodes())  # a printed plan is one run accepts


def test_recommend_plans_every_candidate_at_the_load_given():
    """The plan command's --expert-load reaches every plan --recommend tries: each, routed as unevenly as given,
    holds more (what its experts keep) and runs no faster (the tiny model's step is the host's: its extra FLOPs
    do not show) than evenly routed. --expert-load-peak (the busiest micro-batch's) moves the memory alone. ep
    offers its degrees (off, 2, 4: the tiny model's 8 experts on 4 ranks), which --recommend tries with each of
    ac's choices (it tried ep at the degree given alone before ep had plan_options)."""
    from titan_core.planner.cli import split_flags
    from titan_core.planner.recommend import recommend

    def plans(*flags):
        chosen = split_flags([*flags, *SMALL, "model=qwen3_moe_tiny", "launch.world_size=4", "+plugins=[fsdp,ep,ac]",
                              "plugins.ep.degree=2"])
        best, tried = recommend(compose(*chosen.overrides), hardware_profile("a100"), 256, chosen.expert_load,
                                chosen.expert_load_peak, top=12)
        assert tried == 3 * 4  # fsdp x ep (off, 2, 4) x ac (off, 2 selective, full)
        return {candidate.overrides: candidate for candidate in best}
    even, uneven, peaked = plans(), plans("--expert-load", "2"), plans("--expert-load-peak", "2")
    assert even.keys() == uneven.keys() == peaked.keys() and len(even) == 12
    assert {"plugins.ep.degree=4" in plan for plan in even} == {True, False}
    for plan, candidate in even.items():
        assert uneven[plan].memory_gib > candidate.memory_gib, plan
        assert uneven[plan].tokens_per_device <= candidate.tokens_per_device, plan
        assert peaked[plan].memory_gib == uneven[plan].memory_gib, plan
        assert peaked[plan].tokens_per_device == candidate.tokens_per_device, plan


def test_recommend_keeps_lora_and_tries_its_base_dtypes_and_the_chunked_loss():
    """LoRA is what trains, so --recommend never leaves it out; it tries its frozen linears in float32 and in
    bfloat16 (less memory, the bfloat16 compute rounding them anyway), and the chunked loss off and on."""
    from titan_core.planner.recommend import recommend

    best, tried = recommend(compose(*SMALL, "launch.world_size=1", "+plugins=[lora,ac,chunked_loss]"),
                            hardware_profile("h100"), 256, top=16)
    assert tried == 2 * 4 * 2  # lora's base dtypes x ac's four x chunked loss off and on
    assert len(best) == tried and all("lora" in c.overrides[0] for c in best)
    by_base = {dtype: min(c.memory_gib for c in best if f"plugins.lora.base_dtype={dtype}" in c.overrides)
               for dtype in ("float32", "bfloat16")}
    assert by_base["bfloat16"] < by_base["float32"]


def test_recommend_says_when_nothing_fits():
    from titan_core.planner.cli import recommendations

    with pytest.raises(ConfigError) as error:
        recommendations(["--hardware", "a100", "--recommend", "model=8B", "training.seq_len=8192",
                         "training.global_batch_size=8", "launch.world_size=1", "+plugins=[fsdp]"])
    assert error.value.field == "launch.world_size" and "none of the 1 plans" in str(error.value)
