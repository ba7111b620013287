"""Checkpoints: exact resume, resharding between plans, crashes mid-run and mid-save, guards.

Faults are injected by a throwaway plugin installed for the test (``faults``): it kills a rank with
SIGKILL after a step, freezes it with SIGSTOP, raises on it, kills it inside the checkpoint writer, turns
one step's logits into NaN, or makes deleting a folder wait until training is over.
"""

import json
import re

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
import torch
from omegaconf import OmegaConf

from titan_core.testing import TINY, error_line, install_plugins, run_job

pytestmark = pytest.mark.slow

STEPS = 8
BASE = [*TINY, f"training.steps={STEPS}"]
# A plan: the plugins beside checkpoint, and their options.
ONE = ((), ())
FSDP2 = (("fsdp",), ("plugins.fsdp.degree=2",))
ASYNC = ("plugins.checkpoint.async_save=true",)
# Resharded runs reduce in another order than the single process: the parity harness's fp32 bounds.
RESHARD_TOLERANCE = 1e-5

FAULTS = """
import os
import shutil
import signal
import threading

from titan_core import Declaration, hookimpl

calls = {"batches": 0}
training_over = threading.Event()


def armed(options, step):
    return (step == options.at_step and int(os.environ.get("RANK", 0)) == options.rank
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


@hookimpl
def declare():
    return Declaration()


@hookimpl
def on_step_end(step, config):
    options = config.plugins.faults
    if step == config.training.steps:
        training_over.set()
    if not armed(options, step):
        return
    if options.kind == "slow_delete":  # a filesystem where deleting takes until training ends, or 60 s
        delete = shutil.rmtree

        def slow_delete(path, *args, **kwargs):
            if not training_over.wait(timeout=60):
                raise TimeoutError(f"training waited for the deletion of {path}")
            calls.setdefault("deleted", []).append(path)
            return delete(path, *args, **kwargs)
        shutil.rmtree = slow_delete
    if options.kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if options.kind == "stop":  # hung: alive, holding its sockets, answering nothing
        os.kill(os.getpid(), signal.SIGSTOP)
    if options.kind == "raise":
        raise RuntimeError(f"injected failure after step {step}")
    if options.kind == "kill_in_save":  # this step's checkpoint writer dies before it writes a byte
        from torch.distributed.checkpoint import FileSystemWriter

        FileSystemWriter.write_data = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)


@hookimpl
def batch_context(model_parts, config):
    calls["batches"] += 1
    options = config.plugins.faults
    if options.kind != "nan_loss" or not armed(options, calls["batches"]):
        return None
    return model_parts[-1].register_forward_hook(lambda module, args, output: output * float("nan"))
"""


def job(plan, *options, faults: bool = False) -> list[str]:
    """The command line of a checkpointed run under ``plan`` (plus the fault plugin if asked)."""
    extra, plan_options = plan
    names = ["checkpoint", *extra, *(["faults"] if faults else [])]
    return [*BASE, f"+plugins=[{','.join(names)}]", *plan_options, *options]


@pytest.fixture
def faults(tmp_path):
    """``faults(kind, at_step, rank)`` -> (environment, overrides) arming the fault plugin."""
    env = install_plugins(tmp_path / "site", {"faults": (FAULTS, "kind: kill\nat_step: 5\nrank: 0\n")})

    def arm(kind: str, at_step: int, rank: int = 0) -> tuple[dict, list[str]]:
        return env, [f"plugins.faults.kind={kind}", f"plugins.faults.at_step={at_step}", f"plugins.faults.rank={rank}"]
    return arm


def losses_by_step(result) -> dict[int, float]:
    """The loss of each step; a step logged twice (before a crash and after the resume) keeps its last."""
    return {m["step"]: m["loss"] for m in result.metrics}


def assert_same_weights(weights: dict, expected: dict, tolerance: float = 0.0) -> None:
    assert weights.keys() == expected.keys()
    for name, tensor in expected.items():
        diff = (weights[name] - tensor).abs().max().item()
        assert diff <= tolerance, f"{name} differs by {diff:.2e}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """``uninterrupted(plan, *options)``: the run without faults, computed once per command line."""
    cache = {}

    def run(plan=ONE, *options):
        command = job(plan, *options)
        if tuple(command) not in cache:
            cache[tuple(command)] = run_job(command, tmp_path_factory.mktemp("whole"))
        return cache[tuple(command)]
    return run


@pytest.mark.parametrize("plan, options", [(ONE, ()), (ONE, ASYNC),
                                           (FSDP2, (*ASYNC, "plugins.checkpoint.async_writer=process"))],
                         ids=["one-process", "one-process-async", "fsdp2-async-process"])
def test_stopped_run_resumes_bit_for_bit(tmp_path, faults, uninterrupted, plan, options):
    env, fault = faults("kill", at_step=7)
    options = (*options, "plugins.checkpoint.interval=2")
    logged = ("metrics.tensorboard=true",)
    stopped = run_job(job(plan, *options, *logged, *fault, faults=True), tmp_path, env=env, expect_success=False)
    assert stopped.returncode != 0 and max(losses_by_step(stopped)) == 7
    # Saving step 6 waited for step 4's save; step 6's own may have been cut short (asynchronous), or have
    # finished writing but not been renamed, which the next start publishes (files.recover).
    folders = [p.name for p in (tmp_path / "checkpoints").iterdir()]
    assert "step-4" in folders, folders
    finished = [p.name.removesuffix(".partial") for p in (tmp_path / "checkpoints").iterdir()
                if (p / ".metadata").is_file()]
    newest = max(int(name.split("-")[1]) for name in finished)

    resumed = run_job(job(plan, *options, *logged), tmp_path)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"checkpoints/step-{newest}: continuing after step {newest}" in log
    whole = uninterrupted(plan, *options)
    assert losses_by_step(resumed) == losses_by_step(whole)
    # Each step logged once: the resumed run cut what its stopped attempt logged past the checkpoint, and TensorBoard
    # reads the stopped attempt's points past it as purged.
    assert [m["step"] for m in resumed.metrics] == [m["step"] for m in whole.metrics]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(m["step"], pytest.approx(m["loss"]))
                                                                   for m in resumed.metrics]
    assert_same_weights(resumed.final_weights(), whole.final_weights())


def damage(shard, how: str) -> None:
    data = shard.read_bytes()
    if how == "flip-a-byte":
        middle = len(data) // 2
        data = data[:middle] + bytes([data[middle] ^ 0x01]) + data[middle + 1:]
    else:
        data = data[:len(data) // 2]
    shard.write_bytes(data)


@pytest.mark.parametrize("how", ["flip-a-byte", "truncate"])
def test_a_damaged_checkpoint_is_skipped_for_the_newest_intact_one(tmp_path, how):
    options = ("plugins.checkpoint.interval=2", "plugins.checkpoint.keep_latest_k=0")
    whole = run_job(job(ONE, *options), tmp_path)
    expected = whole.final_weights()
    shard = sorted((tmp_path / "checkpoints" / "step-8").glob("__0_*.distcp"))[0]
    damage(shard, how)

    resumed = run_job(job(ONE, *options), tmp_path)  # the same run started again: step 8 is damaged, 6 is not
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert f"skipping damaged checkpoint {tmp_path / 'checkpoints' / 'step-8'}: {shard}: " in log
    assert "checkpoints/step-6: continuing after step 6" in log
    assert [m["step"] for m in resumed.metrics][-2:] == [7, 8]
    assert_same_weights(resumed.final_weights(), expected)


def test_no_intact_checkpoint_is_one_line(tmp_path):
    options = ("plugins.checkpoint.interval=4", "training.steps=4")
    run_job(job(ONE, *options), tmp_path)
    shard = sorted((tmp_path / "checkpoints" / "step-4").glob("__0_*.distcp"))[0]
    damage(shard, "flip-a-byte")
    failed = run_job(job(ONE, *options), tmp_path, expect_success=False)
    assert failed.returncode == 2
    assert error_line(failed) == (f"titan-core: error: plugins.checkpoint: every checkpoint to resume from is damaged "
                                  f"(newest: {shard}: contents differ from when it was saved (checksum)); fix: restore "
                                  "the files from a copy, or start afresh in another run dir")


def test_logged_loss_is_restart_invariant(tmp_path, faults, uninterrupted):
    # Resumed after step 4, mid-way through the logging window of steps 4-6: step 6 must log what the
    # uninterrupted run logged (a mean over the window since the restart would not).
    env, fault = faults("kill", at_step=5)
    options = ("plugins.checkpoint.interval=4", "metrics.log_every=3")
    run_job(job(ONE, *options, *fault, faults=True), tmp_path, env=env, expect_success=False)
    resumed = run_job(job(ONE, *options), tmp_path)
    whole = uninterrupted(ONE, *options)
    assert losses_by_step(resumed) == losses_by_step(whole) and len(losses_by_step(whole)) == 3
    step6 = [m for m in resumed.metrics if m["step"] == 6]
    assert len(step6) == 1 and "loss_avg" not in step6[0] and "loss_avg" in whole.metrics[1]


def test_checkpoints_move_between_plans(tmp_path, uninterrupted):
    """fsdp4 -> fsdp2 -> tp2, fsdp2 -> pp2 -> one process: each run continues the single-process run's losses
    from the checkpoint it loads and ends at its weights. (HSDP with a resume: the stack matrix pairs hsdp with
    save-resume; fsdp 2 -> one process: every model family's conformance; out of expert parallel: plugins/ep/tests.)"""
    reference = uninterrupted()
    expected_losses = losses_by_step(reference)
    plans = {
        "fsdp4": ((("fsdp",), ("plugins.fsdp.degree=4",)), None),
        "fsdp2": (FSDP2, "fsdp4/checkpoints/step-2"),
        "tp2": ((("tp",), ("plugins.tp.degree=2",)), "fsdp2/checkpoints/step-4"),
        "pp2": ((("pp",), ("plugins.pp.degree=2",)), "fsdp2/checkpoints/step-4"),
        "one-from-pp2": (ONE, "pp2/checkpoints/step-6"),
    }
    for name, (plan, source) in plans.items():
        load = [f"plugins.checkpoint.load_path={tmp_path / source}"] if source else []
        result = run_job(job(plan, *load, "plugins.checkpoint.interval=2", "plugins.checkpoint.keep_latest_k=0"),
                         tmp_path / name)
        first = int(source.rsplit("-", 1)[1]) + 1 if source else 1
        losses = losses_by_step(result)
        assert sorted(losses) == list(range(first, STEPS + 1)), name
        worst = max(abs(losses[s] - expected_losses[s]) for s in losses)
        print(f"{name} from {source}: max loss diff {worst:.2e}")
        assert worst <= RESHARD_TOLERANCE, name
        assert_same_weights(result.final_weights(), reference.final_weights(), RESHARD_TOLERANCE)


def test_killed_worker_restarts_and_finishes_like_an_uninterrupted_run(tmp_path, faults, uninterrupted):
    env, fault = faults("kill", at_step=5, rank=1)
    options = ("plugins.checkpoint.interval=2", "launch.max_restarts=1")
    result = run_job(job(FSDP2, *options, *fault, faults=True), tmp_path, env=env)
    assert "checkpoints/step-4: continuing after step 4" in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_weights(result.final_weights(), uninterrupted(FSDP2, *options).final_weights())


def test_a_hung_rank_times_out_and_the_restarted_job_finishes_like_an_uninterrupted_run(tmp_path, faults,
                                                                                      uninterrupted):
    env, fault = faults("stop", at_step=5, rank=1)
    options = ("plugins.checkpoint.interval=2", "launch.max_restarts=1")
    result = run_job(job(FSDP2, *options, *fault, "launch.hang_timeout_s=2", faults=True), tmp_path, env=env)
    assert ("titan-core: rank 0 failed: " in result.stderr and "Timed out waiting 2000ms" in result.stderr
            and "launch.hang_timeout_s=2" in result.stderr), result.stderr[-3000:]  # rank 0 gave up on rank 1
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "Traceback" in log and "checkpoints/step-4: continuing after step 4" in log
    assert_same_weights(result.final_weights(), uninterrupted(FSDP2, *options).final_weights())


def test_a_rank_that_fails_ends_the_job_without_the_others_waiting(tmp_path, faults):
    env, fault = faults("raise", at_step=3, rank=0)
    # Rank 1 goes on into step 4's collectives; a job held until its timeout would overrun run_job's.
    result = run_job(job(FSDP2, *fault, "launch.hang_timeout_s=3600", faults=True), tmp_path, env=env,
                     expect_success=False, timeout=120)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.startswith("titan-core:")]
    assert lines[0].startswith("titan-core: rank 0 failed: RuntimeError: injected failure after step 3; "
                               "traceback in "), result.stderr[-3000:]
    assert any(line.startswith("titan-core: worker rank 0 failed (exit code 1)") for line in lines), lines
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_writer_killed_mid_save_leaves_the_previous_checkpoint(tmp_path, faults, uninterrupted):
    env, fault = faults("kill_in_save", at_step=4, rank=1)
    options = ("plugins.checkpoint.interval=2", "launch.max_restarts=1")
    result = run_job(job(FSDP2, *options, *fault, faults=True), tmp_path, env=env)
    log = (tmp_path / "logs" / "rank0.log").read_text()
    assert "step-4.partial, an incomplete save" in log
    assert "checkpoints/step-2: continuing after step 2" in log
    assert_same_weights(result.final_weights(), uninterrupted(FSDP2, *options).final_weights())


def test_slow_deletions_never_hold_up_training(tmp_path, faults, uninterrupted):
    # Every deletion of an old checkpoint waits until the last step has ended: on the training thread the
    # run would stop at its first deletion; in the background they all finish before the job ends.
    env, fault = faults("slow_delete", at_step=1)
    options = ("plugins.checkpoint.interval=1", "plugins.checkpoint.keep_latest_k=2")
    result = run_job(job(ONE, *options, *fault, faults=True), tmp_path, env=env, timeout=300)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [f"step-{STEPS - 1}", f"step-{STEPS}"]
    assert "could not delete" not in (tmp_path / "logs" / "rank0.log").read_text()
    assert_same_weights(result.final_weights(), uninterrupted(ONE, *options).final_weights())


def test_nan_loss_stops_before_any_save(tmp_path, faults):
    # Step 5 is not logged: the core learns of its NaN when the checkpoint of step 6 asks, before writing it.
    env, fault = faults("nan_loss", at_step=5)
    result = run_job(job(ONE, "plugins.checkpoint.interval=2", "metrics.log_every=4", *fault, faults=True), tmp_path,
                     env=env, expect_success=False)
    assert result.returncode == 1
    assert "titan-core: stopped: loss is nan at step 5" in result.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-2", "step-4"]


def test_seed_checkpoint_into_a_sharded_plan_and_final_export(tmp_path):
    seed = run_job(job(ONE, "training.steps=0", "plugins.checkpoint.final_model_only=true"), tmp_path / "seed")
    seed_dir = seed.run_dir / "checkpoints" / "weights-step-0"
    assert (seed_dir / ".metadata").is_file()
    from_seed = run_job(job(FSDP2, f"plugins.checkpoint.load_path={seed_dir}", "plugins.checkpoint.final_model_only=true",
                            "plugins.checkpoint.export_dtype=bfloat16", "plugins.checkpoint.export_hf=true"),
                        tmp_path / "sharded")
    fresh = run_job(job(ONE), tmp_path / "fresh")
    assert losses_by_step(from_seed).keys() == losses_by_step(fresh).keys()
    assert max(abs(a - b) for a, b in zip(from_seed.losses, fresh.losses)) <= RESHARD_TOLERANCE

    from titan_checkpoint.convert import main as convert, read_model_weights

    final = from_seed.run_dir / "checkpoints" / f"weights-step-{STEPS}"
    weights = read_model_weights(final)
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert_same_weights(weights, {k: v.bfloat16() for k, v in from_seed.final_weights().items()})
    convert([str(final), str(tmp_path / "model.pt")])
    assert_same_weights(torch.load(tmp_path / "model.pt", weights_only=True), weights)
    hf = from_seed.run_dir / "checkpoints" / f"hf-step-{STEPS}"
    assert json.loads((hf / "config.json").read_text())["num_hidden_layers"] == 4
    # Each of the 2 ranks read and wrote about half of the weights, as one file of the folder's two.
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == ["model-00001-of-00002.safetensors",
                                                         "model-00002-of-00002.safetensors"]
    shares = [int(re.search(r"export: (\d+) bytes", (from_seed.run_dir / "logs" / f"rank{r}.log").read_text())[1])
              for r in (0, 1)]
    assert sum(shares) == sum(t.nbytes for t in weights.values()) and max(shares) <= 0.6 * sum(shares), shares
    from titan_checkpoint.hf import import_hf
    from titan_core import load_tokenizer
    from titan_core import model_description

    config = OmegaConf.load(from_seed.run_dir / "config.yaml")
    _, imported = import_hf(hf, model_description(config, load_tokenizer(config.tokenizer).vocab_size).hf)
    assert_same_weights(imported, weights)


def test_model_of_another_shape_is_refused_before_launch(tmp_path):
    run_job(job(ONE, "training.steps=1"), tmp_path / "small")
    result = run_job(job(ONE, "model.dim=128", f"plugins.checkpoint.load_path={tmp_path / 'small' / 'checkpoints'}"),
                     tmp_path / "big", expect_success=False)
    line = error_line(result)
    assert "plugins.checkpoint.load_path: tensor tok_embeddings.weight is [264, 64] in" in line, line
    assert "but [264, 128] in this model" in line


def test_pickled_entries_are_never_loaded(tmp_path):
    import torch.distributed.checkpoint as dcp

    dcp.save({"step": 5}, checkpoint_id=str(tmp_path / "pickled"), no_dist=True)
    result = run_job(job(ONE, f"plugins.checkpoint.load_path={tmp_path / 'pickled'}"), tmp_path / "run",
                     expect_success=False)
    assert "stores step as a pickled object" in error_line(result)


@pytest.mark.parametrize("override, message", [
    ("plugins.checkpoint.interval=-1", "plugins.checkpoint.interval: -1 is not an integer >= 0"),
    ("plugins.checkpoint.export_dtype=fp8", "plugins.checkpoint.export_dtype: unknown dtype 'fp8'"),
    ("plugins.checkpoint.load_path=/nonexistent", "plugins.checkpoint.load_path: /nonexistent is not a checkpoint"),
])
def test_bad_options_are_refused_before_launch(tmp_path, override, message):
    result = run_job(job(ONE, "launch.dry_run=true", override), tmp_path, expect_success=False)
    assert message in error_line(result)


def test_partial_loading_takes_only_the_parts_asked_for(tmp_path, uninterrupted):
    """Weights and Adam moments from a fsdp2 checkpoint, a fresh schedule, data position and step count."""
    whole = uninterrupted(FSDP2, "plugins.checkpoint.interval=4")
    saved = whole.run_dir / "checkpoints" / "step-4"
    partial = run_job(job(ONE, f"plugins.checkpoint.load_path={saved}", "plugins.checkpoint.load_parts=[model,optimizer]",
                          "training.steps=2"), tmp_path / "partial")
    fresh = run_job(job(ONE, "training.steps=2"), tmp_path / "fresh")
    assert [m["step"] for m in partial.metrics] == [1, 2]
    assert [m["lr"] for m in partial.metrics] == [m["lr"] for m in fresh.metrics]  # the schedule starts again
    # The same first batch (data from the start), but trained weights: a lower loss than from init.
    assert partial.losses[0] < fresh.losses[0] - 1e-2, (partial.losses, fresh.losses)
    assert "continuing after step 0 (model, optimizer)" in (tmp_path / "partial" / "logs" / "rank0.log").read_text()


def test_unknown_part_is_refused(tmp_path):
    result = run_job([*BASE, "launch.dry_run=true", "+plugins=[checkpoint]", "plugins.checkpoint.load_parts=[model,rng]"],
                     tmp_path, expect_success=False)
    assert "plugins.checkpoint.load_parts: unknown part 'rng'" in error_line(result)


def test_a_plugin_objects_state_is_saved_with_the_training_state(tmp_path):
    """The Qwen3-MoE model plugin keeps its idle-expert counts on its object (titan_core.Stateful): every checkpoint
    holds them, under plugins.<name>, read back here from the files."""
    import torch.distributed.checkpoint as dcp

    run_job([*TINY, "model=qwen3_moe_tiny", "training.steps=2", "+plugins=[checkpoint]"], tmp_path)
    saved = {"plugins.qwen3_moe.idle": torch.full((3, 8), -1.0), "plugins.qwen3_moe.last_step": torch.tensor(-1),
             "plugins.qwen3_moe.warned": torch.ones(3, 8, dtype=torch.bool)}
    dcp.load(saved, checkpoint_id=str(tmp_path / "checkpoints" / "step-2"), no_dist=True)
    assert int(saved["plugins.qwen3_moe.last_step"]) == 2  # the last logged step
    assert saved["plugins.qwen3_moe.idle"].min() >= 0 and not saved["plugins.qwen3_moe.warned"].any()
