"""Several jobs training one model (docs/writing-plugins.md, "Several jobs training one model"): a plugin written from
that section alone places each job in a replica group and wraps the optimizer the step calls. Two jobs of one
process, groups 0 and 1 of 2, read step by step the rows one job alone reads, split between them; a wrapper that
skips every update leaves the weights as initialized while each step still calls it."""

import json

import pytest

from titan_core.testing import TINY, install_plugins, run_job

WATCH = """
import json

from titan_core import Declaration, hookimpl


class SkipEvery:
    def __init__(self, optimizer, skip):
        self.optimizer, self.skip, self.calls = optimizer, skip, {"zero_grad": 0, "step": 0}

    def zero_grad(self):
        self.calls["zero_grad"] += 1
        self.optimizer.zero_grad()

    def step(self):
        self.calls["step"] += 1
        if not self.skip:
            self.optimizer.step()


class Watch:
    def __init__(self):
        self.rows, self.steps = [], None

    @hookimpl
    def declare(self, plugin_config):
        if plugin_config.group is None:
            return Declaration()
        return Declaration(replica_group=(plugin_config.group, plugin_config.groups))

    @hookimpl
    def wrap_optimizer(self, optimizer, state, plugin_config):
        \"\"\"watch: the step's optimizer calls counted, every update skipped when asked.\"\"\"
        self.steps = SkipEvery(optimizer, plugin_config.skip)
        return self.steps

    @hookimpl
    def batch_context(self, inputs, micro_batch):
        \"\"\"watch: the rows this job trains on.\"\"\"
        self.rows.append(inputs.tolist())

    @hookimpl
    def on_train_end(self, run_dir):
        \"\"\"watch: what was seen, in the run dir.\"\"\"
        (run_dir / "watched.json").write_text(json.dumps({"rows": self.rows, "calls": self.steps.calls}))
"""


@pytest.fixture
def watching(tmp_path):
    return install_plugins(tmp_path / "site", {"watch": (WATCH, "group: null\ngroups: 1\nskip: false\n")},
                           distribution="watch-plugin", plugin_objects={"watch": "Watch"})


def test_two_replica_groups_split_each_global_batch_and_a_wrapped_optimizer_steps_them(tmp_path, watching):
    one = run_job([*TINY, "+plugins=[watch]"], tmp_path / "one", env=watching)
    groups = [run_job([*TINY, "+plugins=[watch]", f"plugins.watch.group={index}", "plugins.watch.groups=2",
                       "plugins.watch.skip=true"], tmp_path / f"group{index}", env=watching) for index in (0, 1)]
    assert "replica group 1 of 2" in groups[1].stdout
    alone, first, second = (json.loads((job.run_dir / "watched.json").read_text()) for job in (one, *groups))
    assert len(alone["rows"]) == 5 and all(len(rows) == 8 for rows in alone["rows"])
    for step, rows in enumerate(alone["rows"]):
        assert first["rows"][step] + second["rows"][step] == rows, step
    assert first["calls"] == second["calls"] == alone["calls"] == {"zero_grad": 5, "step": 5}
    unmoved, trained = groups[0].final_weights(), one.final_weights()
    for name, tensor in unmoved.items():
        assert (tensor == groups[1].final_weights()[name]).all(), name  # both as initialized from the one seed
    assert all((tensor != trained[name]).any() for name, tensor in unmoved.items() if "norm" not in name)
