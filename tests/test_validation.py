"""Validation: held-out documents evaluated every N steps and at the end, the same under every parallel plan as
in one process, without touching the training stream."""

import json
import math

import pytest

from titan_core.data import every_nth
from titan_core.testing import TINY, compare, error_line, install_plugins, run_job

VALIDATE = ("validation.every=2", "validation.batches=2")  # after steps 2, 4 and the last, 5
FP32_TOLERANCE = 1e-5  # as the training parity tests; a rank evaluating other rows is off by ~1e-2


def validation_losses(result) -> dict[int, float]:
    return {m["step"]: m["validation_loss"] for m in result.metrics if "validation_loss" in m}


def test_holding_out_splits_the_stream_in_two_disjoint_parts():
    documents = [f"doc {i}" for i in range(10)]
    held = [d for i, d in enumerate(documents) if every_nth(4, held=True)(i)]
    kept = [d for i, d in enumerate(documents) if every_nth(4, held=False)(i)]
    assert held == ["doc 0", "doc 4", "doc 8"] and sorted(held + kept) == sorted(documents)


def test_one_process_logs_validation_and_never_advances_the_training_stream(titan_reference, tmp_path):
    # Documents of its own: the training stream must be exactly the run's without validation.
    own = tmp_path / "validation.jsonl"
    own.write_text("".join(json.dumps({"text": f"held-out text number {i}. " * 20}) + "\n" for i in range(40)))
    result = run_job([*TINY, *VALIDATE, "validation.source=local", f"validation.path={own}"], tmp_path / "run")
    assert result.losses == titan_reference().losses
    losses = validation_losses(result)
    assert sorted(losses) == [2, 4, 5]
    assert losses[5] < losses[2]  # the model learns what the held-out text shares with training text
    last = result.metrics[-1]
    assert last["validation_perplexity"] == pytest.approx(math.exp(last["validation_loss"]), rel=1e-6)
    assert f"| validation loss {losses[5]:.4f} (perplexity" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("plan", [
    ["+plugins=[fsdp]", "plugins.fsdp.degree=2"],
    ["+plugins=[tp]", "plugins.tp.degree=2"],
    ["+plugins=[cp]", "plugins.cp.degree=2"],
    ["+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.schedule=Interleaved1F1B"],
    ["+plugins=[pp,fsdp]", "plugins.pp.degree=2", "plugins.fsdp.degree=2", "plugins.pp.schedule=DualPipeV"],
], ids=["fsdp2", "tp2", "cp2", "pp2-interleaved", "pp2xfsdp2-dualpipev"])
def test_every_plan_validates_like_one_process(titan_reference, tmp_path, plan):
    reference = titan_reference(VALIDATE)  # held out of the training data (validation.source=null)
    result = run_job([*TINY, *VALIDATE, *plan], tmp_path)
    expected, measured = validation_losses(reference), validation_losses(result)
    assert sorted(measured) == sorted(expected) == [2, 4, 5]
    assert max(abs(measured[s] - expected[s]) for s in expected) <= FP32_TOLERANCE, (measured, expected)
    report = compare(result, reference)  # and training itself is untouched by the evaluations
    assert report.max_loss_diff <= FP32_TOLERANCE and report.max_param_diff <= FP32_TOLERANCE, report


# An outsider's schedule, written from the build_schedule docstring; EVALUATE is its evaluate, or nothing.
OUTSIDER_SCHEDULE = """
import torch

from titan_core import hookimpl


class OwnSchedule:
    def __init__(self, model, loss_fn):
        self.model, self.loss_fn = model, loss_fn

    def run(self, inputs, labels, model_kwargs):
        loss = self.loss_fn(self.model(inputs, **model_kwargs), labels)
        loss.backward()
        return loss.detach()
EVALUATE

@hookimpl
def build_schedule(model_parts, loss_fn):
    \"\"\"ownschedule: forward and backward of the single model part.\"\"\"
    return OwnSchedule(model_parts[0], loss_fn)
"""
EVALUATE = """
    def evaluate(self, inputs, labels, model_kwargs):
        return self.loss_fn(self.model(inputs, **model_kwargs), labels)
"""


def test_an_outsiders_schedule_validates_like_the_cores(titan_reference, tmp_path):
    env = install_plugins(tmp_path / "site", {"ownschedule": (OUTSIDER_SCHEDULE.replace("EVALUATE", EVALUATE), "")})
    result = run_job([*TINY, *VALIDATE, "+plugins=[ownschedule]"], tmp_path / "run", env=env)
    assert validation_losses(result) == validation_losses(titan_reference(VALIDATE))


def test_a_schedule_that_cannot_evaluate_is_refused(tmp_path):
    env = install_plugins(tmp_path / "site", {"ownschedule": (OUTSIDER_SCHEDULE.replace("EVALUATE", ""), "")})
    result = run_job([*TINY, *VALIDATE, "+plugins=[ownschedule]"], tmp_path / "run", expect_success=False, env=env)
    assert error_line(result).startswith("titan-core: error: validation.every: the schedule OwnSchedule (from a "
                                         "plugin's build_schedule) has no evaluate(")
