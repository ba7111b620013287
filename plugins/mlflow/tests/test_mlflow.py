"""The MLflow tracker on a local file store, read back through MLflow's own client against metrics.jsonl."""

import json
import os
import socket

import pytest
from mlflow.tracking import MlflowClient

from titan_core.testing import TINY, config_error, install_plugins, run_job

pytestmark = pytest.mark.slow
OPTIONS = (*TINY, "training.steps=4", "validation.every=2", "plugins.mlflow.experiment=smoke",
           "plugins.mlflow.tags={team: llm}")
FAIL = '''
import torch.distributed as dist
from titan_core import hookimpl

@hookimpl
def on_step_end(step, plugin_config):
    if step == plugin_config.at_step and dist.get_rank() == plugin_config.rank:
        raise RuntimeError(f"injected failure after step {step}")
'''


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A local MLflow store and a client of it (MLflow 3 opens a folder store only when asked to)."""
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = f"file:{tmp_path / 'mlruns'}"
    return uri, MlflowClient(tracking_uri=uri)


def tracked_run(client, run_dir):
    return client.get_run(json.loads((run_dir / "mlflow.json").read_text())["run_id"])


def test_a_run_and_its_resume_are_one_mlflow_run_with_every_logged_value(tmp_path, store):
    uri, client = store
    # Two ranks under fsdp: only rank 0 tracks (a second rank's run would be a second run of the experiment).
    command = ["+plugins=[mlflow,checkpoint,fsdp]", *OPTIONS, "plugins.fsdp.degree=2",
               f"plugins.mlflow.tracking_uri={uri}"]
    first = run_job(command, tmp_path / "run")
    resumed = run_job([*command, "training.steps=6"], tmp_path / "run")  # the step-4 checkpoint, two steps more
    run = tracked_run(client, tmp_path / "run")
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert client.get_experiment(run.info.experiment_id).name == "smoke"
    assert [r.info.run_id for r in client.search_runs([run.info.experiment_id])] == [run.info.run_id]
    assert run.data.params["training.steps"] == "4" and run.data.params["model.name"] == "llama3"  # as it started
    tags = run.data.tags
    assert tags["team"] == "llm" and tags["titan_core.plugins"] == "fsdp,checkpoint,mlflow"
    assert tags["titan_core.world_size"] == "2" and tags["titan_core.run_dir"] == str(tmp_path / "run")
    artifacts = client.download_artifacts(run.info.run_id, "", str(tmp_path / "artifacts"))
    for first_step, steps in ((1, 4), (5, 6)):
        record = json.loads(open(os.path.join(artifacts, f"start-step-{first_step}", "run.json")).read())
        assert f"training.steps={steps}" in record["overrides"] or steps == 4
        assert f"steps: {steps}" in open(os.path.join(artifacts, f"start-step-{first_step}", "config.yaml")).read()
    logged = {m["step"]: m for m in first.metrics + resumed.metrics}
    for key in set().union(*logged.values()) - {"step"}:
        history = {point.step: point.value for point in client.get_metric_history(run.info.run_id, key)}
        assert history == {step: pytest.approx(m[key], rel=1e-12) for step, m in logged.items() if key in m}, key
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "validation_loss")) == [2, 4, 6]


def test_a_failed_run_ends_its_mlflow_run_failed(tmp_path, store):
    uri, client = store
    env = install_plugins(tmp_path / "site", {"fail": (FAIL, "at_step: 2\nrank: 0\n")})
    result = run_job(["+plugins=[mlflow,fail]", *OPTIONS, "training.steps=3", f"plugins.mlflow.tracking_uri={uri}"],
                     tmp_path / "run", env=env, expect_success=False)
    assert result.returncode == 1 and "injected failure after step 2" in result.stderr
    run = tracked_run(client, tmp_path / "run")
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]  # step 2 failed in fail's hook
    assert run.data.tags["titan_core.error"] == "RuntimeError: injected failure after step 2"


def test_rank_0s_tracker_records_the_failing_ranks_own_error(tmp_path, store):
    """Rank 1 fails; rank 0's collectives break ("Connection closed by peer"). Rank 0's on_error receives rank 1's
    line, which its tracker records, not gloo's."""
    uri, client = store
    env = install_plugins(tmp_path / "site", {"fail": (FAIL, "at_step: 2\nrank: 1\n")})
    result = run_job(["+plugins=[mlflow,fail,fsdp]", *OPTIONS, "training.steps=3", "plugins.fsdp.degree=2",
                      f"plugins.mlflow.tracking_uri={uri}"], tmp_path / "run", env=env, expect_success=False)
    assert result.returncode == 1 and "rank 1 failed: RuntimeError: injected failure after step 2" in result.stderr
    run = tracked_run(client, tmp_path / "run")
    assert run.info.status == "FAILED"
    assert run.data.tags["titan_core.error"] == "RankFailed: rank 1: RuntimeError: injected failure after step 2"



def test_tags_that_are_not_a_mapping_are_refused_before_launch():
    assert str(config_error("+plugins=[mlflow]", *TINY, "plugins.mlflow.tags=[llm]")) == (
        "plugins.mlflow.tags: ['llm'] is not a mapping; fix: give names and values, e.g. "
        "'plugins.mlflow.tags={team: llm}'")


def test_a_store_that_cannot_track_is_refused_before_launch(tmp_path, monkeypatch):
    """A folder store under a file, a database the installed client cannot serve (MLflow's own default is a SQLite
    file: this client is mlflow-skinny), a server that does not answer: each was a traceback after the workers
    started, or minutes of retries. One line before launch naming the option."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "a-file").write_text("")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cases = {f"file:{tmp_path / 'a-file' / 'mlruns'}": f"file:{tmp_path / 'a-file' / 'mlruns'}: {tmp_path / 'a-file'} "
                                                        "is not a folder",
             "sqlite:///runs.db": "sqlite:///runs.db is a sqlite database, which the installed MLflow client "
                                  "(mlflow-skinny, without SQLAlchemy) cannot serve",
             "null": "MLflow's default store sqlite:///",
             f"http://127.0.0.1:{port}": f"no tracking server answers at http://127.0.0.1:{port} within 3 s"}
    for uri, words in cases.items():
        error = config_error("+plugins=[mlflow]", *TINY, f"plugins.mlflow.tracking_uri={uri}")
        assert error.field == "plugins.mlflow.tracking_uri" and words in str(error), str(error)


SERVER_GONE = '''
from mlflow.tracking import MlflowClient
from titan_core import hookimpl


@hookimpl
def after_init():
    """servergone: the tracking server stops answering once the first step is logged."""
    log_batch = MlflowClient.log_batch

    def failing(self, run_id, metrics=(), **kwargs):
        if any(metric.step >= 2 for metric in metrics):
            raise ConnectionError("the tracking server closed the connection")
        return log_batch(self, run_id, metrics=metrics, **kwargs)
    MlflowClient.log_batch = failing
'''


def test_a_tracking_failure_mid_run_stops_the_tracking_not_the_training(tmp_path, store):
    uri, client = store
    env = install_plugins(tmp_path / "site", {"servergone": (SERVER_GONE, "")}, "server-gone")
    result = run_job(["+plugins=[mlflow,servergone]", *OPTIONS, "validation.every=0",
                      f"plugins.mlflow.tracking_uri={uri}"], tmp_path / "run", env=env)
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4]  # trained to the end, every step in metrics.jsonl
    warnings = [line for line in result.stdout.splitlines() if "plugins.mlflow: tracking stopped" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "plugins.mlflow: tracking stopped at step 2 (ConnectionError: the tracking server closed the connection); "
        "training goes on, metrics.jsonl keeps every step")
    run = tracked_run(client, tmp_path / "run")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [1]
