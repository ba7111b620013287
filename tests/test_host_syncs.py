"""A step that logs nothing never makes the host wait for the device: no ``.item()``, ``.tolist()``, ``float()``
or truth test of a tensor anywhere in it (on a GPU each is a sync that stops the CPU from queueing the next
step); a logged step and a checkpoint still stop a NaN before it is written."""

import json

import pytest

from titan_core.testing import TINY, install_plugins, run_job

# A plugin written as an outsider would: it counts, on every rank, the tensor reads of the host from the end
# of step `after` to the end of the next step (a whole step: data, forward, backward, clipping, optimizer).
PROBE = """
import json
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

from titan_core import hookimpl

READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
         torch.Tensor.__int__, torch.Tensor.__index__}


class CountReads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS:
            caller = sys._getframe(1).f_code
            self.reads.append(f"{func.__name__} in {caller.co_name} ({caller.co_filename})")
        return func(*args, **(kwargs or {}))


counting = []


@hookimpl
def on_step_end(step, config):
    \"\"\"syncprobe: count the host's reads of tensors during the step after `after`.\"\"\"
    if step == config.plugins.syncprobe.after:
        counting.append(CountReads())
        counting[0].__enter__()
    elif counting and step == config.plugins.syncprobe.after + 1:
        counting[0].__exit__(None, None, None)
        with open(f"{config.plugins.syncprobe.out}/reads-rank{os.environ.get('RANK', '0')}.json", "w") as out:
            json.dump(counting[0].reads, out)
"""


@pytest.fixture
def probe(tmp_path):
    return install_plugins(tmp_path / "site", {"syncprobe": (PROBE, "after: 2\nout: null\n")})


@pytest.mark.parametrize("plan", [[], ["plugins.fsdp.degree=2"], ["plugins.tp.degree=2"], ["plugins.pp.degree=2"]],
                         ids=["one-process", "fsdp2", "tp2", "pp2"])
def test_a_step_that_logs_nothing_reads_no_tensor_on_the_host(tmp_path, probe, plan):
    plugins = ["syncprobe", *(name for name in ("fsdp", "tp", "pp")
                              if any(o.startswith(f"plugins.{name}") for o in plan))]
    run_job([*TINY, "training.steps=4", "metrics.log_every=4", f"+plugins=[{','.join(plugins)}]", *plan,
             f"plugins.syncprobe.out={tmp_path}"], tmp_path / "run", env=probe)
    ranks = sorted(tmp_path.glob("reads-rank*.json"))
    assert len(ranks) == (2 if plan else 1)
    for reads in ranks:
        # AdamW's step counters are host tensors on every device (torch's default, not capturable), and so is the
        # signal the ranks agree to stop on (titan_core.preemption, reduced on a gloo group): reading them never
        # waits for the device.
        device_reads = [r for r in json.loads(reads.read_text())
                        if not r.startswith(("item in _get_value", "item in agreed"))]
        assert device_reads == [], reads.name


def test_the_probe_sees_a_logged_step_read_its_loss(tmp_path, probe):
    # The same count on a logged step: the loss, grad norm and NaN check are read there (the probe works).
    run_job([*TINY, "training.steps=4", "metrics.log_every=1", "+plugins=[syncprobe]",
             f"plugins.syncprobe.out={tmp_path}"], tmp_path / "run", env=probe)
    reads = json.loads((tmp_path / "reads-rank0.json").read_text())
    assert any(r.startswith("tolist in check ") for r in reads), reads  # the NaN check
    assert any(r.startswith("item in log ") for r in reads), reads  # the grad norm
