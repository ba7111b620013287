"""The ledger (titan_core.planner.Ledger), tried by a pricing module an outsider wrote from docs/writing-plugins.md's
"What your plugin costs" section alone (below as written, its first line excepted): each of its entries reaches the
plan's totals exactly, on each kind of rank, as the plugins after it left the plan."""

import json
import subprocess
import sys
import textwrap

import pytest

from titan_core.testing import error_line, install_plugins

# Written by a helper given only that section and the start of writing-plugins.md, asked for an imaginary
# "activation offload" plugin: frees `fraction` of what the rank's blocks keep, a pinned buffer across steps, the
# copies as device traffic, an all-reduce of 8 bytes per block, 2 FLOPs per trained element; refuses fraction > 1.
OFFLOAD = '# titan_offload/costs.py\n"""offload\'s pricing, for the planner (registered under the `titan_core.costs` entry point as `offload`).\n\nActivation offload to host: a `fraction` of what each block keeps for backward is moved to host memory\nand brought back for backward, through a pinned staging buffer of `pinned_mib` MiB on the device.\n"""\nfrom titan_core import ConfigError, hookimpl\n\nMIB = 1 << 20\nCHECKSUM_FLOPS_PER_PARAM = 2      # matrix-product checksum: 2 FLOPs per trained parameter element\nALLREDUCE_BYTES_PER_BLOCK = 8     # the bookkeeping all-reduce: 8 bytes per block the rank runs\n\n\ndef _saved_per_microbatch(rank, fraction):\n    """Bytes of one micro-batch\'s saved activations that this rank moves to host."""\n    per_token = sum(rank.model.block_saved[i] for i in rank.blocks)\n    return fraction * per_token * rank.tokens\n\n\n@hookimpl\ndef estimate_costs(ledger, plugin_config, hardware):   # launching process, nothing built, plan order\n    """offload: frees `fraction` of the blocks\' saved activations; a pinned staging buffer (held);\n    copies to host and back (device traffic); a per-step all-reduce over dp_shard; a checksum\'s matmuls."""\n    fraction = float(plugin_config.fraction)\n    pinned_mib = int(plugin_config.pinned_mib)\n\n    if fraction > 1:\n        raise ConfigError("plugins.offload.fraction",\n                          f"is the share of saved activations moved to host, at most 1, not {fraction}",\n                          "set plugins.offload.fraction to a value between 0 and 1 (1.0 offloads everything)")\n    if fraction < 0:\n        raise ConfigError("plugins.offload.fraction",\n                          f"is the share of saved activations moved to host, at least 0, not {fraction}",\n                          "set plugins.offload.fraction to a value between 0 and 1 (0 offloads nothing)")\n    if pinned_mib < 0:\n        raise ConfigError("plugins.offload.pinned_mib",\n                          f"is a buffer size in MiB, not {pinned_mib}",\n                          "set plugins.offload.pinned_mib to 0 or more")\n\n    # 1. the saving: what the blocks keep for backward, less the offloaded share, one micro-batch\'s tokens,\n    #    alive through forward and backward (when=None). Read blocks/tokens inside the function so a\n    #    pipeline\'s or FSDP\'s later decisions are seen.\n    ledger.add_memory("activations",\n                      lambda rank: -_saved_per_microbatch(rank, fraction),\n                      "activations offloaded to host")\n\n    # 2. the pinned staging buffer on the device, kept across steps.\n    ledger.add_memory("buffers", pinned_mib * MIB, "pinned staging buffer", when="held")\n\n    # 3. copies to host and back: 2x the saved bytes per micro-batch, every micro-batch of the step.\n    ledger.add_traffic(lambda rank: 2 * _saved_per_microbatch(rank, fraction) * rank.microbatches,\n                       "copying activations to host and back")\n\n    # 4. one small all-reduce per optimizer step over dp_shard, not overlapped.\n    ledger.add_collective("offload all-reduce", ("dp_shard",),\n                          lambda rank: ALLREDUCE_BYTES_PER_BLOCK * len(rank.blocks),\n                          overlapped=False, calls=1)\n\n    # 5. the checksum\'s matrix products: 2 FLOPs per trained parameter element the rank keeps, per step.\n    ledger.add_flops(lambda rank: CHECKSUM_FLOPS_PER_PARAM * rank.trained_params, "offload checksum")\n\n\n@hookimpl\ndef plan_options(model, world_size, hardware):        # --recommend: the settings worth trying\n    return [None, {"fraction": 0.5}, {"fraction": 1.0}]   # None: the plan may leave the plugin out\n'

SMALL = ["--hardware", "a100", "model=tiny", "tokenizer.path=bytes", "training.seq_len=64",
         "training.global_batch_size=8"]

# Prints, for a plan with the outsider's plugin and the same plan without it, what each kind of rank holds and
# takes; and for the plan with it, the outsider's entries as the planner evaluated them on each rank.
MEASURE = textwrap.dedent("""
    import json, sys
    from titan_core.planner.cli import job_estimate
    from titan_core.planner.estimate import evaluated
    with_it, without = json.loads(sys.argv[1]), json.loads(sys.argv[2])

    def ranks(argv):
        _, result = job_estimate(argv)
        return [dict(memory=rank.memory(), seconds=rank.step_seconds(), blocks=rank.blocks,
                     saved=sum(rank.facts.block_saved[i] for i in rank.blocks), tokens=rank.microbatch_tokens,
                     microbatches=rank.microbatches_per_step(), held=rank.held_params(),
                     trained=rank.trained_params(), stepping=rank.memory() == rank.step_peak(),
                     matmul_tflops=rank.hardware.matmul_tflops(), memory_gbps=rank.hardware.memory_gbps,
                     terms={what: evaluated(nbytes, rank) for _, what, nbytes, plugin, _ in rank.memory_terms
                            if plugin == "offload"},
                     traffic=[evaluated(n, rank) for _, n, plugin in rank.traffic_terms if plugin == "offload"],
                     flops=[evaluated(f, rank) for _, f, plugin in rank.flops_terms if plugin == "offload"],
                     collectives=[(c.dims, evaluated(c.bytes, rank), rank.collective_calls(c))
                                  for c in rank.collectives if c.plugin == "offload"])
                for rank in result.each_rank()]
    print(json.dumps([ranks(with_it), ranks(without)]))
""")


def measured(env, plugins: str, *options: str):
    argv = [*SMALL, "launch.world_size=2", *options]
    done = subprocess.run([sys.executable, "-c", MEASURE,
                           json.dumps([*argv, f"+plugins=[{plugins}]", "plugins.offload.fraction=0.5",
                                       "plugins.offload.pinned_mib=16"]),
                           json.dumps([*argv, f"+plugins=[{plugins.replace('offload,', '')}]"])],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def install(tmp_path):
    return install_plugins(tmp_path / "site", {"offload": ("", "fraction: 0.0\npinned_mib: 0\n")}, "offload-plugin",
                           costs={"offload": OFFLOAD})


def test_an_outsiders_ledger_entries_reach_the_plan_as_the_plugins_after_it_left_it(tmp_path):
    """Placed before fsdp 2, the outsider's FLOPs count the half of the parameters fsdp leaves each rank; each entry
    changes its part of the memory peak and of the step by exactly what it says."""
    env = install(tmp_path)
    [rank], [plain] = measured(env, "offload,fsdp", "plugins.fsdp.degree=2")
    assert rank["trained"] == rank["held"] / 2  # fsdp, after it, sharded what its function reads
    assert rank["flops"] == [2 * rank["held"] / 2]
    saving = 0.5 * rank["saved"] * rank["tokens"]
    assert saving > 0 and rank["terms"] == {"activations offloaded to host": -saving,
                                            "pinned staging buffer": 16 * 2**20}
    assert not rank["stepping"] and not plain["stepping"]  # both peaks in backward, where the saving counts
    assert rank["memory"]["activations"] == plain["memory"]["activations"] - saving
    assert rank["memory"]["buffers"] == plain["memory"]["buffers"] + 16 * 2**20
    assert rank["traffic"] == [2 * saving * rank["microbatches"]]
    assert rank["seconds"]["matmul"] - plain["seconds"]["matmul"] == \
        pytest.approx(rank["flops"][0] / (rank["matmul_tflops"] * 1e12), rel=1e-9)
    assert rank["seconds"]["elementwise"] - plain["seconds"]["elementwise"] == \
        pytest.approx(rank["traffic"][0] / (rank["memory_gbps"] * 1e9), rel=1e-9)
    assert rank["collectives"] == [[["dp_shard"], 8 * len(rank["blocks"]), 1]]


def test_an_outsiders_ledger_is_read_on_each_pipeline_rank(tmp_path):
    """Under a pipeline of 2 stages each rank's entries read its own blocks; the plugin, placed before pp, never
    knew of them."""
    env = install(tmp_path)
    ranks, plains = measured(env, "offload,pp", "plugins.pp.degree=2")
    assert [rank["blocks"] for rank in ranks] == [plain["blocks"] for plain in plains] and len(ranks) == 2
    assert ranks[0]["blocks"] != ranks[1]["blocks"]
    for rank, plain in zip(ranks, plains):
        saving = 0.5 * rank["saved"] * rank["tokens"]
        assert rank["terms"]["activations offloaded to host"] == -saving
        assert rank["collectives"] == [[["dp_shard"], 8 * len(rank["blocks"]), 1]]
        assert rank["traffic"] == [2 * saving * rank["microbatches"]]


def test_an_outsiders_refusal_and_entries_are_what_the_plan_command_prints(tmp_path):
    env = install(tmp_path)
    done = subprocess.run([sys.executable, "-m", "titan_core.planner", *SMALL, "+plugins=[offload]",
                           "plugins.offload.fraction=0.5", "plugins.offload.pinned_mib=16"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "offload: pinned staging buffer 16.00 MiB (across steps)" in done.stdout
    assert "offload: activations offloaded to host -" in done.stdout
    assert "matrix products offload: offload checksum: " in done.stdout
    assert "memory traffic offload: copying activations to host and back: " in done.stdout
    assert "not counted" not in done.stdout
    refused = subprocess.run([sys.executable, "-m", "titan_core.planner", *SMALL, "+plugins=[offload]",
                              "plugins.offload.fraction=1.5"], capture_output=True, text=True, env=env, timeout=300)
    assert refused.returncode == 2
    assert error_line(refused).startswith("titan-core: error: plugins.offload.fraction: "), refused.stderr


def test_the_ledger_is_eleven_members():
    """The surface a plugin's pricing reads and writes stays small: widening it is a decision, made here."""
    from titan_core.planner import Ledger
    assert sorted(name for name in dir(Ledger) if not name.startswith("_")) == [
        "add_collective", "add_flops", "add_memory", "add_traffic", "blocks", "convert_for_trace", "kept_params",
        "microbatches", "model", "tokens", "trained_params"]
