"""The W&B tracker, offline: the run's own files read back record by record (W&B's log format: 32 KiB blocks
of records with a 7-byte header, each record a protobuf), against the run's metrics.jsonl."""

import json
import struct
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from titan_core.testing import TINY, config_error, install_plugins, run_job

pytestmark = pytest.mark.slow
OPTIONS = (*TINY, "training.steps=4", "validation.every=2", "plugins.wandb.mode=offline", "plugins.wandb.tags=[smoke]")
TRACKED = (*OPTIONS, "+plugins=[wandb,checkpoint]")
BLOCK, HEADER = 32768, 7
FAIL = '''
from titan_core import hookimpl

@hookimpl
def on_step_end(step, plugin_config):
    if step == plugin_config.at_step:
        raise RuntimeError(f"injected failure after step {step}")
'''


def wandb_records(offline_run: Path) -> list:
    """Every record of an offline run's ``run-<id>.wandb`` file."""
    raw = next(offline_run.glob("run-*.wandb")).read_bytes()
    assert raw[:4] == b":W&B"
    records, pending, position = [], b"", HEADER  # after the file's own header
    while position + HEADER <= len(raw):
        if BLOCK - position % BLOCK < HEADER:  # a block's tail too short for a header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[position:position + HEADER])
        if kind == 0:
            break
        pending += raw[position + HEADER:position + HEADER + length]
        position += HEADER + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def read_run(offline_run: Path) -> dict:
    """The run's id, name, tags, config, logged points by step and exit code."""
    run = {"history": {}}
    for record in wandb_records(offline_run):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, tags=list(record.run.tags),
                       config={item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "history":
            point = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            run["history"][point["_step"]] = point
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


def offline_runs(run_dir: Path) -> list[dict]:
    return [read_run(folder) for folder in sorted((run_dir / "wandb").glob("offline-run-*"))]


def test_a_run_and_its_resume_are_one_wandb_run_with_every_logged_value(tmp_path):
    first = run_job(TRACKED, tmp_path)
    resumed = run_job([*TRACKED, "training.steps=6"], tmp_path)  # the step-4 checkpoint, two steps more
    started, continued = offline_runs(tmp_path)
    run_id = json.loads((tmp_path / "wandb.json").read_text())["id"]
    assert started["id"] == continued["id"] == run_id and started["name"] == tmp_path.name
    assert started["tags"] == ["smoke"] and started["exit_code"] == continued["exit_code"] == 0
    assert started["config"]["training"]["steps"] == 4 and continued["config"]["training"]["steps"] == 6
    assert "plugins.wandb.tags=[smoke]" in started["config"]["run"]["overrides"]
    assert started["config"]["run"]["world"]["plugins"] == ["checkpoint", "wandb"]
    assert sorted(started["history"]) == [1, 2, 3, 4] and sorted(continued["history"]) == [5, 6]
    logged = {m["step"]: m for m in first.metrics + resumed.metrics}
    for step, point in {**started["history"], **continued["history"]}.items():
        assert point["_step"] == step
        for key, value in logged[step].items() - {("step", step)}:
            assert point[key] == pytest.approx(value, rel=1e-12), (step, key)  # every value of metrics.jsonl
    assert {step for step, m in logged.items() if "validation_loss" in m} == {2, 4, 6}


def test_a_failed_run_ends_its_wandb_run_failed(tmp_path):
    env = install_plugins(tmp_path / "site", {"fail": (FAIL, "at_step: 2\n")})
    result = run_job([*OPTIONS, "+plugins=[wandb,fail]", "training.steps=3"], tmp_path / "run", env=env,
                     expect_success=False)
    assert result.returncode == 1 and [line for line in result.stderr.splitlines() if "titan-core" in line] == [
        "titan-core: rank 0 failed: RuntimeError: injected failure after step 2; "
        f"traceback in {tmp_path / 'run' / 'logs' / 'rank0.log'}"]
    [run] = offline_runs(tmp_path / "run")
    assert run["exit_code"] == 1 and sorted(run["history"]) == [1]  # step 2 failed in fail's hook, before wandb's


def test_a_mode_wandb_lacks_is_refused_before_launch():
    assert str(config_error(*TRACKED, "plugins.wandb.mode=cloud")) == ("plugins.wandb.mode: 'cloud' is not a W&B mode; "
                                                                       "fix: use online, offline or disabled (or null: "
                                                                       "W&B's own setting)")


def test_a_run_that_cannot_be_tracked_is_refused_before_launch(tmp_path, monkeypatch):
    """Online without a login (W&B prompted, or failed in the worker), a dir that cannot be written (W&B fell back to a
    temporary folder without a word): one line before launch naming the option."""
    for variable in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(variable, raising=False)
    (tmp_path / "netrc").write_text("machine example.org login user password secret\n")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    error = config_error(*TRACKED, "plugins.wandb.mode=online")
    assert str(error) == ("plugins.wandb.mode: online needs a W&B login for api.wandb.ai, and there is none (no "
                          "WANDB_API_KEY, no identity token file, no key in the netrc file); fix: run wandb login (or "
                          "set WANDB_API_KEY), or set plugins.wandb.mode=offline and wandb sync later")
    (tmp_path / "netrc").write_text("machine api.wandb.ai login user password key\n")  # as wandb login leaves it
    (tmp_path / "a-file").write_text("")
    error = config_error(*TRACKED, "plugins.wandb.mode=online", f"plugins.wandb.dir={tmp_path / 'a-file' / 'wandb'}")
    assert error.field == "plugins.wandb.dir" and f"{tmp_path / 'a-file'} is not a folder" in str(error)


SERVICE_GONE = '''
import wandb
from titan_core import hookimpl


@hookimpl
def after_init():
    """servicegone: W&B stops taking points once the first step is logged."""
    log = wandb.Run.log

    def failing(self, data, step=None, **kwargs):
        if step is not None and step >= 2:
            raise ConnectionError("the W&B service is gone")
        return log(self, data, step=step, **kwargs)
    wandb.Run.log = failing
'''


def test_a_tracking_failure_mid_run_stops_the_tracking_not_the_training(tmp_path):
    env = install_plugins(tmp_path / "site", {"servicegone": (SERVICE_GONE, "")}, "service-gone")
    result = run_job([*OPTIONS, "validation.every=0", "+plugins=[wandb,servicegone]"], tmp_path / "run", env=env)
    assert [m["step"] for m in result.metrics] == [1, 2, 3, 4]
    warnings = [line for line in result.stdout.splitlines() if "plugins.wandb: tracking stopped" in line]
    assert len(warnings) == 1 and warnings[0].endswith(
        "plugins.wandb: tracking stopped at step 2 (ConnectionError: the W&B service is gone); training goes on, "
        "metrics.jsonl keeps every step")
    [run] = offline_runs(tmp_path / "run")
    assert sorted(run["history"]) == [1]
