"""Mesh dimensions a plugin defines: a new one that multiplies the world, one that borrows ranks of others
(as expert parallel borrows the data-parallel ranks), which dimensions carry different data, and the
one-line refusals. The plugin below is written from docs/writing-plugins.md alone."""

import json

import pytest

from titan_core.testing import TINY, error_line, install_plugins, run_job

MESH_PLUGIN = '''
import json
from pathlib import Path

import torch
import torch.distributed as dist

from titan_core import Declaration, MeshDimension, hookimpl


@hookimpl
def declare(plugin_config):
    return Declaration(stage=700, mesh={plugin_config.dim: plugin_config.size},
                       dimensions={plugin_config.dim: MeshDimension(after=plugin_config.after,
                                                                    borrows=tuple(plugin_config.borrows),
                                                                    data_parallel=plugin_config.data_parallel)},
                       options={plugin_config.dim: "size"})  # errors about its degree name plugins.meshprobe.size


@hookimpl
def apply_parallelism(mesh, plugin_config, plan):
    """meshprobe: all-reduce each rank's number over its dimension, and record what every sub-mesh holds."""
    dims = [plugin_config.dim, *plugin_config.also]
    ranks = {dim: dist.get_process_group_ranks(mesh.submesh(dim).get_group()) for dim in dims}
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total, group=mesh.submesh(plugin_config.dim).get_group())
    seen = {"ranks": ranks, "sum": total.item(), "dp_size": plan.dp_size,
            "dp_rank": mesh.local_rank(*plan.data_parallel_dims), "degree": plan.degree(plugin_config.dim)}
    Path(plugin_config.out, f"rank{dist.get_rank()}.json").write_text(json.dumps(seen))
'''
OPTIONS = "dim: extra\nsize: 2\nafter: null\nborrows: []\ndata_parallel: false\nalso: []\nout: .\n"


@pytest.fixture
def mesh_probe(tmp_path):
    return install_plugins(tmp_path / "site", {"meshprobe": (MESH_PLUGIN, OPTIONS)}, "mesh-probe")


def _probe(tmp_path, env, overrides):
    out = tmp_path / "seen"
    out.mkdir()
    result = run_job([*TINY, "training.steps=0", *overrides, f"plugins.meshprobe.out={out}"], tmp_path / "run", env=env)
    return result, [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]


@pytest.mark.slow
def test_a_new_data_parallel_dimension_gets_its_place_and_its_share_of_the_batch(tmp_path, mesh_probe):
    result, seen = _probe(tmp_path, mesh_probe, [
        "+plugins=[fsdp,meshprobe]", "plugins.fsdp.degree=2", "plugins.meshprobe.dim=replica",
        "plugins.meshprobe.after=dp_replicate", "plugins.meshprobe.data_parallel=true", "plugins.meshprobe.also=[dp_shard]"])
    assert "world 4 = replica 2 x dp_shard 2" in result.stdout
    # replica is outer: its groups are ranks 2 apart, dp_shard's neighbours
    assert [s["ranks"] for s in seen] == [{"replica": [0, 2], "dp_shard": [0, 1]}, {"replica": [1, 3], "dp_shard": [0, 1]},
                                          {"replica": [0, 2], "dp_shard": [2, 3]}, {"replica": [1, 3], "dp_shard": [2, 3]}]
    assert [s["sum"] for s in seen] == [2, 4, 2, 4]
    assert [(s["dp_size"], s["dp_rank"]) for s in seen] == [(4, 0), (4, 1), (4, 2), (4, 3)]


@pytest.mark.slow
def test_a_borrowing_dimension_reuses_ranks_and_leaves_the_rest(tmp_path, mesh_probe):
    result, seen = _probe(tmp_path, mesh_probe, [
        "+plugins=[fsdp,meshprobe]", "plugins.fsdp.degree=4", "plugins.meshprobe.dim=ep",
        "plugins.meshprobe.borrows=[dp_shard,cp]", "plugins.meshprobe.also=[ep_rest,dp_shard]"])
    assert "world 4 = dp_shard 4; ep 2 within dp_shard" in result.stdout  # the world is not multiplied
    assert [s["ranks"]["ep"] for s in seen] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [s["ranks"]["ep_rest"] for s in seen] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(s["ranks"]["dp_shard"] == [0, 1, 2, 3] for s in seen)
    assert [s["sum"] for s in seen] == [1, 1, 5, 5]
    assert [(s["dp_size"], s["dp_rank"], s["degree"]) for s in seen] == [(4, r, 2) for r in range(4)]


@pytest.mark.parametrize("overrides, message", [
    (["plugins.meshprobe.dim=dp_shard"],
     "plugins.meshprobe: defines mesh dimension 'dp_shard', which the core already defines; fix: enable only one "
     "of them, or name the dimension differently"),
    (["plugins.meshprobe.after=dp"],
     "plugins.meshprobe: places mesh dimension 'extra' after unknown dimension 'dp'; fix: use one of pp, "
     "dp_replicate, dp_shard, cp, tp"),
    # The error names the option the user set for the degree (its plugin's own name for it, Declaration.options)
    # and the option that sized the ranks it borrows.
    (["plugins.meshprobe.dim=ep", "plugins.meshprobe.borrows=[dp_shard,cp]", "plugins.meshprobe.size=3",
      "+plugins=[fsdp]", "plugins.fsdp.degree=4"],
     "plugins.meshprobe.size: ep degree 3 does not divide the 4 rank(s) of dp_shard x cp it borrows (dp_shard 4 "
     "from plugins.fsdp.degree); fix: set plugins.meshprobe.size to a divisor of 4, or enlarge dp_shard x cp"),
    (["plugins.meshprobe.dim=ep", "plugins.meshprobe.borrows=[dp_shard,cp]"],
     "plugins.meshprobe.size: ep degree 2 does not divide the 1 rank(s) of dp_shard x cp it borrows (no plugin "
     "sizes them); fix: set plugins.meshprobe.size to a divisor of 1, or enlarge dp_shard x cp"),
    (["plugins.meshprobe.dim=ep", "plugins.meshprobe.borrows=[dp]"],
     "plugins.meshprobe: mesh dimension 'ep' borrows 'dp', which is no mesh dimension that multiplies the world; "
     "fix: borrow from pp, dp_replicate, dp_shard, cp, tp"),
])
def test_refused_before_launch(tmp_path, mesh_probe, overrides, message):
    plugins = "+plugins=[fsdp,meshprobe]" if "+plugins=[fsdp]" in overrides else "+plugins=[meshprobe]"
    overrides = [o for o in overrides if o != "+plugins=[fsdp]"]
    result = run_job([*TINY, plugins, *overrides, "launch.dry_run=true"], tmp_path / "run", env=mesh_probe,
                     expect_success=False)
    assert error_line(result) == f"titan-core: error: {message}"
