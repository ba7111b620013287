"""MLflow: rank 0's config, run record and logged metrics in an MLflow run.

One MLflow run per training run, in ``experiment``: the resolved config as params (dotted keys), the run
record as tags (git commit, host, world) and as the artifact ``start-step-<N>/run.json`` with the config
(``config.yaml``) beside it, a point per logged step (training, validation and plugins' metrics, MLflow's
step = the training step), and the status FINISHED, KILLED (preempted: it resumes in the same run) or FAILED.
A resumed training run continues its MLflow run (the id is kept in the run dir, ``mlflow.json``); its params
stay those it started with, MLflow refusing changed ones, and the resumed config is the new start's artifact.

The client talks to ``tracking_uri``: a server, Databricks, or a local folder (``file:<folder>``). MLflow 3
keeps its folder store behind ``MLFLOW_ALLOW_FILE_STORE=true``; a ``file:`` URI named here sets it, the user
having asked for that store.

What can be known before launch is checked then: a folder store that cannot be written, a database store the
installed client cannot serve (mlflow-skinny has no SQLAlchemy, and MLflow's default store is a SQLite file), a
server that does not answer within seconds. A failure once training runs stops the tracking, not the training: one
warning line, and ``metrics.jsonl`` keeps every step (Lightning's choice). The client's retries are capped (2
retries, 10 s a request, unless set in the environment) so that a server gone mid-run costs seconds, not minutes.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from titan_core import ConfigError, hookimpl, text_or_null

logging.getLogger("mlflow").setLevel(logging.WARNING)  # its import and store chatter, kept off the console
import mlflow  # noqa: E402
from mlflow.entities import Metric, Param, RunStatus  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

log = logging.getLogger("titan_core")

RUN_ID_FILE = "mlflow.json"
PARAMS_PER_CALL = 100  # MLflow's limit for one log_batch
PARAM_CHARS = 6000  # MLflow's longest param value
DATABASES = ("sqlite", "postgresql", "mysql", "mssql")  # stores served through SQLAlchemy (the full mlflow package)
ANSWER_WITHIN_S = 3.0  # how long a tracking server may take to accept a connection before launch
CAPPED_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}  # MLflow's: 7, 120 s


def flat_params(config: DictConfig) -> dict[str, str]:
    """The config's leaves by dotted key, as MLflow params (lists as their text)."""
    params: dict[str, str] = {}

    def visit(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                visit(value, f"{prefix}{key}.")
        else:
            params[prefix[:-1]] = str(node)[:PARAM_CHARS]
    visit(OmegaConf.to_container(config, resolve=True), "")
    return params


class MlflowTracker:
    """The MLflow run of this training run, on rank 0 only (None elsewhere and before the start)."""

    def __init__(self) -> None:
        self.client: MlflowClient | None = None
        self.run_id: str | None = None

    @hookimpl
    def validate(self, plugin_config: DictConfig) -> None:
        """mlflow: refuse tags that are not a mapping of names to values, a URI or a name that is not text."""
        if plugin_config.tags is not None and not isinstance(plugin_config.tags, DictConfig):
            raise ConfigError("plugins.mlflow.tags", f"{plugin_config.tags} is not a mapping",
                              "give names and values, e.g. 'plugins.mlflow.tags={team: llm}'")
        for key in ("tracking_uri", "run_name"):  # their default is null
            text_or_null(plugin_config[key], f"plugins.mlflow.{key}")
        check_store(plugin_config.tracking_uri)

    @hookimpl
    def start_tracking(self, run_dir: Path, run: dict[str, Any], first_step: int, config: DictConfig,
                       plugin_config: DictConfig) -> None:
        """mlflow: start the MLflow run (continue it when resumed) with the config and the run record."""
        uri = plugin_config.tracking_uri
        if uri is not None and uri.startswith("file:"):
            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
        for variable, value in CAPPED_RETRIES.items():
            os.environ.setdefault(variable, value)
        client = self.client = MlflowClient(tracking_uri=uri)
        self._tracking("start", lambda: self._start(client, run_dir, run, first_step, config, plugin_config, uri))

    def _start(self, client: MlflowClient, run_dir: Path, run: dict[str, Any], first_step: int, config: DictConfig,
               plugin_config: DictConfig, uri: str | None) -> None:
        ids = run_dir / RUN_ID_FILE
        if first_step > 1 and ids.exists():
            self.run_id = json.loads(ids.read_text())["run_id"]
            client.update_run(self.run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            experiment = client.get_experiment_by_name(plugin_config.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(plugin_config.experiment))
            tags = {**run_tags(run, run_dir), **(plugin_config.tags or {})}
            self.run_id = client.create_run(experiment_id, run_name=plugin_config.run_name or run_dir.name,
                                            tags=tags).info.run_id
            params = [Param(key, value) for key, value in flat_params(config).items()]
            for start in range(0, len(params), PARAMS_PER_CALL):
                client.log_batch(self.run_id, params=params[start:start + PARAMS_PER_CALL])
            ids.write_text(json.dumps({"run_id": self.run_id, "tracking_uri": uri}) + "\n")
        folder = f"start-step-{first_step}"
        client.log_text(self.run_id, json.dumps(run, indent=2), f"{folder}/run.json")
        client.log_text(self.run_id, OmegaConf.to_yaml(config, resolve=True), f"{folder}/config.yaml")

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """mlflow: send a logged step's values."""
        if self.run_id is not None and metrics:
            client, run_id = self._tracked()
            now = int(time.time() * 1000)
            self._tracking(f"step {step}", lambda: client.log_batch(run_id, metrics=[
                Metric(key, float(value), now, step) for key, value in metrics.items() if key != "step"]))

    @hookimpl
    def on_train_end(self, preempted: bool) -> None:
        """mlflow: end the run, KILLED when a signal stopped training (it resumes in the same run)."""
        self._end(RunStatus.KILLED if preempted else RunStatus.FINISHED)

    @hookimpl
    def on_error(self, error: BaseException) -> None:
        """mlflow: end the run as failed, the failure's line in the tag titan_core.error (another rank's, when that
        one failed first)."""
        if self.run_id is not None:
            client, run_id = self._tracked()
            self._tracking("the failure", lambda: client.set_tag(run_id, "titan_core.error", error_line(error)))
        self._end(RunStatus.FAILED)

    def _end(self, status: int) -> None:
        if self.run_id is not None:
            client, run_id = self._tracked()
            self._tracking("the end", lambda: client.set_terminated(run_id, RunStatus.to_string(status)))
            self.run_id = None

    def _tracked(self) -> tuple[MlflowClient, str]:
        """The client and the id of the run being tracked (``run_id`` is set)."""
        # A run is started, and its id kept, only through the client start_tracking made.
        assert self.client is not None and self.run_id is not None
        return self.client, self.run_id

    def _tracking(self, what: str, call: Callable[[], Any]) -> None:
        """Run one exchange with the store; a failure stops the tracking, never the training, in one line."""
        try:
            call()
        except Exception as error:
            self.run_id = None
            log.warning("plugins.mlflow: tracking stopped at %s (%s); training goes on, metrics.jsonl keeps every step",
                        what, error_line(error))


def check_store(uri: str | None) -> None:
    """The store ``uri`` (null: MLflow's own) can be reached before launch: a folder that can be written, a database
    the installed client can serve, a server that answers."""
    field, named = "plugins.mlflow.tracking_uri", uri or f"MLflow's default store {mlflow.get_tracking_uri()}"
    uri = uri or mlflow.get_tracking_uri()
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0]
    if scheme in ("", "file"):
        folder = Path(parsed.path if scheme else uri).expanduser()
        existing = next(p for p in (folder, *folder.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            wrong = "is not a folder" if not existing.is_dir() else "cannot be written"
            raise ConfigError(field, f"{named}: {existing} {wrong}", "point it at a folder this job can write "
                              "(file:<folder>), or at a server")
    elif scheme in DATABASES and importlib.util.find_spec("sqlalchemy") is None:
        raise ConfigError(field, f"{named} is a {scheme} database, which the installed MLflow client (mlflow-skinny, "
                          "without SQLAlchemy) cannot serve", "set plugins.mlflow.tracking_uri=file:<folder> or a "
                          "server's http:// address, or pip install mlflow")
    elif scheme in ("http", "https"):
        try:
            socket.create_connection((parsed.hostname, parsed.port or (443 if scheme == "https" else 80)),
                                     timeout=ANSWER_WITHIN_S).close()
        except OSError as error:
            raise ConfigError(field, f"no tracking server answers at {uri} within {ANSWER_WITHIN_S:.0f} s "
                              f"({error.strerror or error})", "start the server, or point the option at one that "
                              "runs") from None


def error_line(error: BaseException) -> str:
    """The failure in one line (another rank's: ``RankFailed: rank 1: ValueError: ...``)."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"


def run_tags(run: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """The run record's facts a user filters runs by."""
    world = run.get("world", {})
    git = run.get("git") or {}
    return {"titan_core.run_dir": str(run_dir.resolve()), "titan_core.host": str(run.get("host", "")),
            "titan_core.world_size": str(world.get("size", "")), "titan_core.model": str(world.get("model", "")),
            "titan_core.plugins": ",".join(world.get("plugins", [])), "mlflow.source.git.commit": git.get("commit", "")}
