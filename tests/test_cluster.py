"""Jobs of several nodes: a SLURM allocation through Hydra's submitit launcher, and torchrun's multi-node
rendezvous, each trained like one process."""

import socket
import subprocess
import sys

import pytest

from titan_core.launch.cluster import PORTS, Nodes, job_nodes, workers_per_node
from titan_core.errors import ConfigError
from titan_core.job.command_line import check_command_line
from titan_core.testing import TINY, JobResult, compare, merged

FP32_TOLERANCE = 1e-5  # as fsdp's own parity tests: a wrong rank order or data split is off by far more

SLURM_NODE_1_OF_2 = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "4242", "SLURM_JOB_NUM_NODES": "2",
                     "SLURM_NTASKS": "2", "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
                     "SLURM_JOB_NODELIST": "gpu[07-08]"}


def test_a_slurm_node_finds_its_index_and_the_first_node(monkeypatch):
    for key, value in SLURM_NODE_1_OF_2.items():
        monkeypatch.setenv(key, value)
    nodes = job_nodes()
    assert nodes.count == 2 and nodes.index == 1 and nodes.run_id == "submitit-4242"
    host, port = nodes.rendezvous.split(":")
    assert host == "gpu07" and int(port) in PORTS
    assert workers_per_node(16, nodes) == 8


def test_more_than_one_task_per_node_is_refused(monkeypatch):
    for key, value in {**SLURM_NODE_1_OF_2, "SLURM_NTASKS": "16"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ConfigError, match=r"^hydra\.launcher\.tasks_per_node: 8 tasks per node.*fix: set "
                                          r"hydra\.launcher\.tasks_per_node=1"):
        job_nodes()


def test_a_world_that_does_not_split_over_the_nodes_is_refused():
    with pytest.raises(ConfigError, match=r"^launch\.world_size: a world of 3 rank\(s\) does not split over 2"):
        workers_per_node(3, Nodes(2, 0, "gpu07:20000", "x"))


@pytest.mark.parametrize("argv, message", [
    (["hydra/launcher=slurm"], "hydra/launcher: Hydra hands the jobs of a multirun to a launcher; without -m"),
])
def test_a_launcher_without_multirun_is_refused(argv, message, monkeypatch):
    with pytest.raises(ConfigError) as error:
        check_command_line(argv)
    assert str(error.value).startswith(message)
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")  # a login node
    check_command_line(["-m", *argv])


def test_the_slurm_launcher_off_a_cluster_is_one_line(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(ConfigError) as error:
        check_command_line(["-m", "hydra/launcher=slurm"])
    assert str(error.value).startswith("hydra/launcher: this machine has no SLURM (no sbatch on the PATH)")


@pytest.mark.slow
def test_a_submitit_job_trains_two_ranks_like_one_process(tmp_path, titan_reference):
    # submitit's local executor runs the job as it would on a SLURM node: one task, which starts the workers.
    command = [sys.executable, "-m", "titan_core.run", "-m", "hydra/launcher=submitit_local",
               "hydra.launcher.timeout_min=10", *merged(TINY, ["+plugins=[fsdp]", "plugins.fsdp.degree=2"]),
               f"hydra.sweep.dir={tmp_path}"]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert list((tmp_path / ".submitit").iterdir()), "the job did not go through submitit"
    report = compare(JobResult(tmp_path / "0", 0, "", ""), titan_reference())
    assert report.max_loss_diff <= FP32_TOLERANCE and report.max_param_diff <= FP32_TOLERANCE, report


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_two_torchrun_nodes_train_like_one_process(tmp_path, titan_reference):
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", f"--node-rank={node}",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", "-m", "titan_core.run",
         *merged(TINY, ["+plugins=[fsdp]", "plugins.fsdp.degree=-1"])],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    run_dir = tmp_path / "outputs" / "torchrun-two-nodes"
    assert '"nodes": 2' in (run_dir / "run.json").read_text()
    report = compare(JobResult(run_dir, 0, "", ""), titan_reference())
    assert report.max_loss_diff <= FP32_TOLERANCE and report.max_param_diff <= FP32_TOLERANCE, report
