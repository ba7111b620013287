"""ft: replica groups on torchft. Two groups of fsdp 2 train as one process on the same global batch; a group
killed mid-run leaves the other training (no restart, no checkpoint), and started again it takes the live state from
its peer and ends with the very same weights and data position; a hung group is dropped; LocalSGD and DiLoCo keep the
groups' weights together at each synchronization; the lighthouse unreachable is one line before launch."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import titan_ft  # noqa: F401  (quiets torchft's Rust logs, before torchft is imported)
import torch
from torchft._torchft import LighthouseServer

from titan_core.testing import (LOSS_TOL, PARAM_TOL, TINY, JobResult, config_error, error_line, install_plugins,
                                merged, run_job)

# Each step sleeps, so that a fault lands mid-run on any machine; the last rank may die in the middle of its n-th
# step; the data position is written at the end.
PACED = """
import contextlib
import json
import os
import signal
import time

import torch.distributed as dist

from titan_core import hookimpl

STEPS_HERE = [0]  # steps this worker began (a group joining late starts at its peers' step)


@contextlib.contextmanager
def dying():
    yield
    os.kill(os.getpid(), signal.SIGKILL)  # a lost GPU mid-step: its forward and backward done, its collectives not


@hookimpl
def batch_context(micro_batch, plugin_config):
    STEPS_HERE[0] += micro_batch == 0
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if STEPS_HERE[0] == plugin_config.kill_at and dist.get_rank() == dist.get_world_size() - 1 and first_attempt:
        return dying()
    return None


@hookimpl
def on_step_end(plugin_config):
    time.sleep(plugin_config.seconds)


@hookimpl
def on_train_end(state, run_dir):
    if dist.get_rank() == 0:
        position = {key: value.tolist() if hasattr(value, "tolist") else value
                    for key, value in state.dataloader.state_dict().items()}
        (run_dir / "data_position.json").write_text(json.dumps(position))
"""


@pytest.fixture
def lighthouse():
    """Start torchft's lighthouse in this process: ``lighthouse(min_replicas)`` gives its address."""
    servers = []

    def start(min_replicas: int) -> str:
        servers.append(LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                                        heartbeat_timeout_ms=3000))
        return servers[-1].address()

    yield start
    for server in servers:
        server.shutdown()


@pytest.fixture
def paced(tmp_path):
    return install_plugins(tmp_path / "site", {"paced": (PACED, "seconds: 0.3\nkill_at: 0\n")},
                           distribution="paced-plugin")


class Group:
    """One replica group's job, started in its own session so that a test can kill or stop all of its processes."""

    def __init__(self, overrides, run_dir: Path, env: dict | None = None):
        self.result = JobResult(run_dir, -1, "", "")
        run_dir.mkdir(parents=True, exist_ok=True)
        self.output = (run_dir.parent / f"{run_dir.name}.out").open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "titan_core.run", *merged(overrides), f"hydra.run.dir={run_dir}"],
            stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})})

    def steps(self) -> list[int]:
        try:
            return [m["step"] for m in self.result.metrics]
        except (json.JSONDecodeError, FileNotFoundError):  # a line being written
            return []

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None or condition(), f"{self.result.run_dir.name} exited: {self.log()}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.log()}"
            time.sleep(0.2)

    def signal(self, sig: signal.Signals) -> None:
        os.killpg(self.process.pid, sig)

    def finish(self, timeout: float = 180) -> JobResult:
        returncode = self.process.wait(timeout)
        self.output.close()
        assert returncode == 0, f"{self.result.run_dir.name} exited {returncode}: {self.log()}"
        return self.result

    def log(self) -> str:
        return (self.result.run_dir.parent / f"{self.result.run_dir.name}.out").read_text()[-3000:]


def groups_of(address: str, plugins: str, *extra: str) -> list[str]:
    return [*TINY, f"+plugins=[{plugins}]", f"plugins.ft.lighthouse={address}", "plugins.ft.timeout_s=5", *extra]


@pytest.mark.parametrize("plan", [("ft,fsdp", "plugins.fsdp.degree=2"), ("ft,pp", "plugins.pp.degree=2"),
                                  ("ft,tp", "plugins.tp.degree=2"), ("ft,cp", "plugins.cp.degree=2")],
                         ids=["fsdp2", "pp2", "tp2", "cp2"])
def test_two_groups_train_as_one_process(plan, lighthouse, titan_reference, tmp_path):
    """No fault: groups 0 and 1, each fsdp 2 (or a pipeline of 2 stages, tensor or context parallel 2) on its half of
    every global batch, end with the one-process weights; the mean of their losses (each its own rows' mean, the rows alike in tokens) is the one
    process's loss."""
    address = lighthouse(2)
    jobs = [Group(groups_of(address, *plan, f"plugins.ft.replica_group={index}"), tmp_path / f"group{index}")
            for index in (0, 1)]
    first, second = (job.finish() for job in jobs)
    reference = titan_reference()
    assert [m["ft_groups"] for m in first.metrics] == [2.0] * 5
    for name, tensor in reference.final_weights().items():
        assert (first.final_weights()[name] - tensor).abs().max() <= PARAM_TOL, name
        assert torch.equal(first.final_weights()[name], second.final_weights()[name]), name
    means = [(a + b) / 2 for a, b in zip(first.losses, second.losses)]
    assert max(abs(m - r) for m, r in zip(means, reference.losses)) <= LOSS_TOL
    assert min(abs(a - b) for a, b in zip(first.losses, second.losses)) > 1e-3  # each group read its own rows


def paced_groups(address: str, env: dict, folder: Path) -> tuple[list[str], Group, Group]:
    """Groups 0 and 1 of 30 paced steps, given back once group 1 has logged its step 5."""
    overrides = groups_of(address, "ft,paced", "training.steps=30")
    first, second = (Group([*overrides, f"plugins.ft.replica_group={index}"], folder / f"group{index}", env)
                     for index in (0, 1))
    second.wait_for(lambda: len(second.steps()) >= 5, "group 1's step 5")
    first.wait_for(lambda: len(first.steps()) >= 2, "group 0's steps")  # both in the quorum (either may start late)
    return overrides, first, second


def assert_together(survivor: JobResult, recovered: JobResult) -> None:
    """The surviving group logged each step once from the one it joined at, and never restarted; both end with equal
    weights and data positions."""
    steps = [m["step"] for m in survivor.metrics]
    assert steps == list(range(steps[0], 31)), steps
    assert (survivor.run_dir / "logs" / "rank0.log").read_text().count("rank 0 of ") == 1
    for name, tensor in survivor.final_weights().items():
        assert torch.equal(tensor, recovered.final_weights()[name]), name
    positions = [json.loads((run / "data_position.json").read_text()) for run in (survivor.run_dir, recovered.run_dir)]
    assert positions[0] == positions[1]


@pytest.mark.slow
def test_a_killed_group_leaves_the_other_training_and_recovers_from_it(lighthouse, paced, tmp_path):
    """SIGKILL group 1 at step 5: group 0 trains on alone; group 1 started again (no checkpoint plugin: nothing to
    resume from) joins at the step group 0 is at and takes its weights, optimizer, schedule and data position."""
    overrides, first, second = paced_groups(lighthouse(1), paced, tmp_path)
    second.signal(signal.SIGKILL)
    first.wait_for(lambda: any(m["ft_groups"] == 1.0 for m in first.result.metrics[5:]), "group 0 alone")
    again = Group([*overrides, "plugins.ft.replica_group=1"], tmp_path / "group1_again", paced)
    first, again = first.finish(), again.finish()
    assert again.metrics[0]["step"] > 5, again.metrics[0]
    groups = [m["ft_groups"] for m in first.metrics]
    assert 1.0 in groups and groups[-1] == 2.0, groups
    assert_together(first, again)


@pytest.mark.slow
def test_a_hung_group_is_dropped_and_rejoins_when_it_wakes(lighthouse, paced, tmp_path):
    """SIGSTOP group 1 at step 5: group 0 drops it (the lighthouse's heartbeat timeout, then the collective's) and
    trains on; woken with SIGCONT, group 1 finds its step left behind, takes group 0's state and both end equal."""
    _, first, second = paced_groups(lighthouse(1), paced, tmp_path)
    second.signal(signal.SIGSTOP)
    first.wait_for(lambda: sum(m["ft_groups"] == 1.0 for m in first.result.metrics[5:]) >= 3, "group 0 alone")
    second.signal(signal.SIGCONT)
    first, second = first.finish(), second.finish()
    steps = [m["step"] for m in second.metrics]
    assert steps[-1] == 30 and any(b - a > 1 for a, b in zip(steps, steps[1:])), steps  # it slept through some
    assert_together(first, second)


@pytest.mark.slow
def test_a_group_that_loses_a_rank_restarts_by_itself_and_recovers_from_its_peer(lighthouse, paced, tmp_path):
    """Group 1 of fsdp 2 loses its rank 1 in the middle of its 5th step (SIGKILL after backward, as a lost GPU):
    group 0's averaging with it fails and that step is not committed; group 1's launcher restarts both its workers
    (launch.max_restarts=1), whose new manager finds the group behind and takes group 0's state (served while group
    0 runs forward); group 0 never stops, and both end equal."""
    overrides = groups_of(lighthouse(1), "ft,fsdp,paced", "plugins.fsdp.degree=2", "training.steps=30",
                          "plugins.ft.may_differ=[plugins.paced]")  # group 1's fault is a test's option
    first = Group([*overrides, "plugins.ft.replica_group=0"], tmp_path / "group0", paced)
    second = Group([*overrides, "plugins.ft.replica_group=1", "plugins.paced.kill_at=5", "launch.max_restarts=1"],
                   tmp_path / "group1", paced)
    first, second = first.finish(), second.finish()
    assert first.metrics[-1]["ft_skipped_steps"] >= 1, first.metrics[-1]
    assert "GET /checkpoint" not in (tmp_path / "group0.out").read_text()  # its server logs requests at debug
    # Two attempts; the second began at step 0 (metrics.jsonl then keeps no later line) and joined at group 0's step.
    assert (second.run_dir / "logs" / "rank0.log").read_text().count("rank 0 of 2 on cpu") == 2
    steps = [m["step"] for m in second.metrics]
    assert steps == list(range(steps[0], 31)) and steps[0] > 5, steps
    assert_together(first, second)


@pytest.mark.slow
def test_a_killed_group_of_fsdp_with_checkpoints_resumes_its_own_then_takes_the_live_state(lighthouse, paced, tmp_path):
    """ft x fsdp 2 x checkpoint (every 2 steps): group 1 killed at step 5 and started again by the same command
    resumes its own step-4 checkpoint, finds itself behind group 0 at its first quorum and takes the live state
    instead; both end equal, and group 1's checkpoints go on from the step it joined at."""
    overrides = groups_of(lighthouse(1), "ft,fsdp,checkpoint,paced", "plugins.fsdp.degree=2", "training.steps=30",
                          "plugins.checkpoint.interval=2")
    first, second = (Group([*overrides, f"plugins.ft.replica_group={index}"], tmp_path / f"group{index}", paced)
                     for index in (0, 1))
    second.wait_for(lambda: (tmp_path / "group1" / "checkpoints" / "step-4").is_dir(), "group 1's step-4 checkpoint")
    second.signal(signal.SIGKILL)
    first.wait_for(lambda: any(m["ft_groups"] == 1.0 for m in first.result.metrics[4:]), "group 0 alone")
    again = Group([*overrides, "plugins.ft.replica_group=1"], tmp_path / "group1", paced)
    first, again = first.finish(), again.finish()
    assert "checkpoints/step-4: continuing after step 4" in (tmp_path / "group1" / "logs" / "rank0.log").read_text()
    # Its log keeps the steps its checkpoint holds (from 1, or from the step it first joined group 0 at), then the
    # ones it trained once it joined again.
    steps = [m["step"] for m in again.metrics]
    kept = [step for step in steps if step <= 4]
    joined = steps[len(kept):]
    assert kept == list(range(kept[0], 5)) and joined[0] > 6 and joined == list(range(joined[0], 31)), steps
    assert_together(first, again)
    assert (tmp_path / "group1" / "checkpoints" / "step-30").is_dir()


@pytest.mark.slow
def test_the_groups_go_through_submitit_as_a_sweep_over_the_group_index(lighthouse, titan_reference, tmp_path):
    """docs/plugins/ft.md's SLURM recipe, on submitit's local executor: one submitted job per group, which meet at
    the lighthouse and train as one process."""
    command = [sys.executable, "-m", "titan_core.run", "-m", "hydra/launcher=submitit_local",
               "hydra.launcher.timeout_min=10", *groups_of(lighthouse(2), "ft"), "plugins.ft.replica_group=0,1",
               f"hydra.sweep.dir={tmp_path}"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert len(list((tmp_path / ".submitit").iterdir())) >= 2
    groups = [JobResult(tmp_path / str(index), 0, "", "") for index in (0, 1)]
    for name, tensor in titan_reference().final_weights().items():
        assert (groups[0].final_weights()[name] - tensor).abs().max() <= PARAM_TOL, name
        assert torch.equal(groups[0].final_weights()[name], groups[1].final_weights()[name]), name


def test_local_sgd_and_diloco_bring_the_groups_together_at_each_synchronization(lighthouse, tmp_path):
    """sync_every=2 over 6 steps: 3 synchronizations committed, the groups' weights equal after the last, and each
    mode's weights its own (LocalSGD averages the weights, DiLoCo steps an outer optimizer on their change)."""
    address, ends = lighthouse(2), {}
    for mode in ("local_sgd", "diloco"):
        jobs = [Group(groups_of(address, "ft", "training.steps=6", f"plugins.ft.mode={mode}", "plugins.ft.sync_every=2",
                                f"plugins.ft.replica_group={index}"), tmp_path / f"{mode}{index}") for index in (0, 1)]
        first, second = (job.finish() for job in jobs)
        assert [m["ft_commits"] for m in first.metrics][1::2] == [1.0, 2.0, 3.0]
        ends[mode] = first.final_weights()
        for name, tensor in ends[mode].items():
            assert torch.equal(tensor, second.final_weights()[name]), name
    name = "layers.0.attention.wq.weight"
    assert (ends["local_sgd"][name] - ends["diloco"][name]).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["sync", "local_sgd"])
def test_a_group_started_with_other_options_stops_in_one_line_and_the_other_trains_on(mode, lighthouse, paced,
                                                                                       tmp_path):
    """Group 1 with another learning rate: compared at the first quorum it takes part in (a step's under sync, a
    synchronization's under local_sgd), it exits 2 with one line naming the optimizer's options, before any average
    with it is committed; group 0 (ahead on the tie) says so once and trains to the end alone."""
    overrides = groups_of(lighthouse(1), "ft,paced", "training.steps=20", f"plugins.ft.mode={mode}",
                          *(["plugins.ft.sync_every=2"] if mode == "local_sgd" else []))
    first = Group([*overrides, "plugins.ft.replica_group=0"], tmp_path / "group0", paced)
    second = Group([*overrides, "plugins.ft.replica_group=1", "optimizer.lr=2e-3"], tmp_path / "group1", paced)
    assert second.process.wait(180) == 2, second.log()
    lines = [line for line in second.log().splitlines() if "error" in line.lower()]
    assert lines == ["titan-core: error: optimizer: replica group 1 runs other optimizer options than group 0 (1 of 2 "
                     "groups run those); fix: start every group with the same options but plugins.ft.replica_group "
                     "(list an option that does not change what trains in plugins.ft.may_differ)"], second.log()
    result = first.finish()
    assert [m["step"] for m in result.metrics][-1] == 20 and result.metrics[-1]["ft_groups"] == 1.0
    console = (tmp_path / "group0.out").read_text()
    assert console.count("ft: replica group 1 runs other optimizer options than this group: it stops") == 1


def test_the_parts_compared_leave_out_what_a_group_lists_in_may_differ():
    """Two jobs apart in their seed share every part once both list training.seed, and only then; the group's own
    index and lighthouse never count."""
    from omegaconf import OmegaConf
    from titan_ft.agreement import PARTS, digests, shared_parts

    class Plan:
        mesh_shape, names = {"dp_shard": 2}, ["fsdp", "ft"]

    def job(seed, group, may_differ=()):
        config = OmegaConf.create({"training": {"seed": seed, "steps": 5}, "optimizer": {"lr": 1e-3},
                                   "metrics": {"log_every": group + 1},
                                   "plugins": {"ft": {"replica_group": group, "lighthouse": f"http://h{group}:1",
                                                      "may_differ": list(may_differ)}}})
        return digests(shared_parts(config, Plan, list(may_differ)))

    apart = [part for part, a, b in zip(PARTS, job(0, 0), job(1, 1)) if a != b]
    assert apart == ["training"]
    assert job(0, 0, ["training.seed"]) == job(1, 1, ["training.seed"])


@pytest.mark.parametrize("mode", ["local_sgd", "diloco"])
def test_a_killed_group_recovers_at_a_synchronization_under_local_sgd_and_diloco(mode, lighthouse, paced, tmp_path):
    """Group 1 killed at step 5 and started again: under LocalSGD and DiLoCo the groups meet only at their
    synchronizations (every 2 steps), where the restarted group finds itself behind and takes group 0's state (what it
    trained alone before is dropped); both end with the same weights and data position."""
    overrides = groups_of(lighthouse(1), "ft,paced", "training.steps=30", f"plugins.ft.mode={mode}",
                          "plugins.ft.sync_every=2")
    first, second = (Group([*overrides, f"plugins.ft.replica_group={index}"], tmp_path / f"group{index}", paced)
                     for index in (0, 1))
    second.wait_for(lambda: len(second.steps()) >= 5, "group 1's step 5")
    second.signal(signal.SIGKILL)
    first.wait_for(lambda: any(m["ft_groups"] == 1.0 for m in first.result.metrics[5:]), "group 0 alone")
    again = Group([*overrides, "plugins.ft.replica_group=1"], tmp_path / "group1_again", paced)
    first, again = first.finish(), again.finish()
    # Started again, it trains alone until its first synchronization (sync_every - 1 steps logged), which it joins at
    # group 0's step.
    steps = [m["step"] for m in again.metrics]
    joined = [step for step in steps if step > 5]
    assert joined == list(range(joined[0], 31)) and steps[:-len(joined)] == [1], steps
    assert first.metrics[-1]["ft_groups"] == 2.0
    assert_together(first, again)


def test_the_lighthouse_unreachable_is_one_line_before_launch(tmp_path):
    """Exit 2 and one line naming the option, before any worker starts (no rank log written)."""
    result = run_job([*TINY, "+plugins=[ft]", "plugins.ft.lighthouse=http://localhost:9"], tmp_path / "run",
                     expect_success=False)
    line = error_line(result)
    assert line.startswith("titan-core: error: plugins.ft.lighthouse: nothing answers at http://localhost:9"), line
    assert not (tmp_path / "run" / "logs").exists()
    assert "is not http://<host>:<port>" in str(config_error(*TINY, "+plugins=[ft]", "plugins.ft.lighthouse=localhost"))


def test_the_planner_prices_the_all_reduce_between_groups_on_the_network(tmp_path):
    """8B under fsdp 8 in each of 4 groups: each rank sends 2 x 3/4 of its float32 gradient shard (3.74 GiB) per step,
    at the H100 profile's network bandwidth (not NVLink's, though the group fits in a node), and the plan says which
    group it is."""
    answering = socket.create_server(("localhost", 0))
    planned = subprocess.run([sys.executable, "-m", "titan_core.planner", "--hardware", "h100", "model=8B",
                              "training.seq_len=2048", "training.global_batch_size=64", "launch.world_size=8",
                              "+plugins=[ft,fsdp]", "plugins.fsdp.degree=8", "plugins.ft.group_count=4",
                              f"plugins.ft.lighthouse=http://localhost:{answering.getsockname()[1]}"],
                             capture_output=True, text=True, timeout=300)
    answering.close()
    assert planned.returncode == 0, planned.stderr
    assert "replica group 0 of 4" in planned.stdout
    assert ("collective ft: gradients averaged across 4 replica groups over replica groups: 5.61 GiB per step at "
            "50 GB/s") in planned.stdout, planned.stdout
    assert "ft: gradient bucket 64.00 MiB" in planned.stdout
    # 4 rows of 8 float64 digests, ring-priced: 2 x 3/4 x 256 bytes
    assert "collective ft: the groups' options compared over replica groups: 384 B per step" in planned.stdout
