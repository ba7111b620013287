"""Pipeline schedules against one process: same per-step losses and final weights on the tiny Llama.

The tiny model has 4 blocks: the single-stage schedules run 2 stages of 2 blocks at pp 2, the looped
and V schedules 4 stages of 1 block (2 per rank).
"""

import importlib.util

import pytest
import torch

from titan_core.testing import TINY, compare, run_job

pytestmark = pytest.mark.slow

FP32_LOSS_TOLERANCE = 1e-5
# Micro-batching changes only the summation order of the gradients (a few ulps); Adam's division by
# sqrt(v) turns that into weight differences around 1e-6 after 5 steps at lr 1e-3 (measured <= 1.6e-6, with TP).
FP32_WEIGHT_TOLERANCE = 1e-5
SCHEDULES = ["GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"]

needs_tp = pytest.mark.skipif(importlib.util.find_spec("titan_tp") is None, reason="plugin tp is not installed")
needs_cp = pytest.mark.skipif(importlib.util.find_spec("titan_cp") is None, reason="plugin cp is not installed")


def check(report):
    assert report.max_loss_diff <= FP32_LOSS_TOLERANCE, report
    assert report.max_param_diff <= FP32_WEIGHT_TOLERANCE, report


# GPipe and Interleaved1F1B at pp 2 are cases of every model's conformance run.
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s not in ("GPipe", "Interleaved1F1B")])
def test_schedule_parity_pp2(titan_parity, schedule):
    check(titan_parity(["+plugins=[pp]", "plugins.pp.degree=2", f"plugins.pp.schedule={schedule}"]))


def test_uneven_stages_grad_accumulation_and_logged_metrics(titan_reference, tmp_path):
    # Stages of 1 and 3 blocks, 2 grad-accum steps of 2 micro-batches: gradients must add up across
    # schedule steps exactly as one process's full batch. Rank 0 logs, the last stage (rank 1) holds
    # the loss: the logged loss and grad norm must still be those of the whole model.
    result = run_job([*TINY, "+plugins=[pp]", "plugins.pp.first_stage_fewer_layers=2", "plugins.pp.microbatches=2",
                      "training.grad_accum_steps=2"], tmp_path)
    reference = titan_reference()
    report = compare(result, reference)
    print(f"parity uneven stages, grad accumulation: {report}")
    check(report)
    held = [{name.split(".")[1] for name in torch.load(tmp_path / "final_weights" / f"rank{r}.pt")
             if name.startswith("layers.")} for r in range(2)]
    assert held == [{"0"}, {"1", "2", "3"}], held
    norms = [(m["grad_norm"], r["grad_norm"]) for m, r in zip(result.metrics, reference.metrics)]
    assert all(abs(a - b) <= 1e-6 * b for a, b in norms), norms


@pytest.mark.parametrize("schedule", ["1F1B", "ZBVZeroBubble"])
def test_pp2_fsdp2(titan_parity, schedule):
    check(titan_parity(["+plugins=[pp,fsdp]", "plugins.fsdp.degree=2", f"plugins.pp.schedule={schedule}"]))


@needs_tp
def test_pp2_tp2(titan_parity):
    check(titan_parity(["+plugins=[pp,tp]", "plugins.tp.degree=2", "plugins.pp.schedule=Interleaved1F1B"]))


@needs_tp
def test_pp2_fsdp2_tp2(titan_parity):
    check(titan_parity(["+plugins=[pp,fsdp,tp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2"]))


@needs_tp
@needs_cp
def test_pp2_fsdp2_tp2_cp2(titan_parity):
    check(titan_parity(["+plugins=[pp,fsdp,tp,cp]", "plugins.fsdp.degree=2", "plugins.tp.degree=2",
                        "plugins.cp.degree=2"]))


ONE_F_ONE_B = "0F0,0F1,0B0,0F2,0B1,0F3,0B2,0B3\n,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3\n"
# The same with each backward split into input and weight halves, the weight halves deferred (zero bubble).
HALVES = ("0F0,0F1,0I0,0F2,0I1,0W0,0F3,0I2,0W1,0I3,0W2,0W3\n"
          ",1F0,1I0,1W0,1F1,1I1,1W1,1F2,1I2,1W2,1F3,1I3,1W3\n")


def interleaved_file(path) -> str:
    """Torch's own Interleaved1F1B order at pp 2, 2 stages a rank, 4 micro-batches, written as a schedule file."""
    from omegaconf import OmegaConf

    from titan_pp.costs import torch_order
    from titan_pp.layout import stage_layout

    defaults = OmegaConf.load(importlib.util.find_spec("titan_pp.conf").submodule_search_locations[0]
                              + "/plugins/pp.yaml").pp
    layout = stage_layout(OmegaConf.merge(defaults, {"schedule": "Interleaved1F1B", "microbatches": 4}), 4, 2)
    rows = [",".join("" if a is None else str(a) for a in torch_order("Interleaved1F1B", layout, rank))
            for rank in range(2)]
    path.write_text("\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("name", ["1F1B", "halves", "interleaved"])
def test_a_schedule_file_runs_like_one_process(titan_parity, tmp_path, name):
    """A pipeline-order file (TorchTitan's custom CSV schedules) run by torch's pipeline runtime: 1F1B's actions,
    the same with backward in input and weight halves, and torch's Interleaved1F1B order over 4 stages, each
    against one process."""
    path = tmp_path / f"{name}.csv"
    if name == "interleaved":
        interleaved_file(path)
    else:
        path.write_text(ONE_F_ONE_B if name == "1F1B" else HALVES)
    check(titan_parity(["+plugins=[pp]", "plugins.pp.degree=2", "plugins.pp.microbatches=4",
                        f"plugins.pp.schedule_csv={path}"]))
    # Each rank ran the file's actions: 8 of 1F1B's (4 forwards, 4 backwards), 12 in halves, 16 on two stages.
    actions = {"1F1B": 8, "halves": 12, "interleaved": 16}[name]
    for rank in range(2):
        log = (tmp_path / "run" / "logs" / f"rank{rank}.log").read_text()
        assert f"pp: torch's pipeline runtime runs the {actions} actions of {path} on this rank" in log


def test_a_schedule_file_under_fsdp_and_full_checkpointing_runs_like_one_process(titan_parity, tmp_path):
    """pp 2 x fsdp 2 with full activation checkpointing, the schedule from 1F1B's file: torch's runtime adds the
    FSDP unshards and reshards to the file's actions."""
    path = tmp_path / "1F1B.csv"
    path.write_text(ONE_F_ONE_B)
    check(titan_parity(["+plugins=[pp,fsdp,ac]", "plugins.fsdp.degree=2", "plugins.ac.mode=full",
                        "plugins.pp.degree=2", "plugins.pp.microbatches=4", f"plugins.pp.schedule_csv={path}"]))
