"""Weights & Biases: rank 0's config, run record and logged metrics in a W&B run.

One W&B run per training run: started before the first step with the resolved config and ``run.json`` (under
the ``run`` key), a point per logged step (training, validation and plugins' metrics, W&B's step = the
training step), ended finished, preempted or failed. A resumed training run continues its W&B run: the id is
kept in the run dir (``wandb.json``), which a restart shares. ``mode=offline`` writes the run under ``dir``
for ``wandb sync`` later: clusters without internet, and this project's tests.
"""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_core import ConfigError, hookimpl, text_or_null

logging.getLogger("wandb").setLevel(logging.WARNING)  # its import and start-up chatter, kept off the console
import wandb  # noqa: E402

MODES = (None, "online", "offline", "disabled")
TEXT = ("entity", "name", "group", "dir")  # options whose default is null
RUN_ID_FILE = "wandb.json"


class WandbTracker:
    """The W&B run of this training run, on rank 0 only (None elsewhere and before the start)."""

    def __init__(self) -> None:
        self.run: wandb.Run | None = None

    @hookimpl
    def validate(self, plugin_config: DictConfig) -> None:
        """wandb: refuse a mode W&B does not have, and names that are not text."""
        if plugin_config.mode not in MODES:
            raise ConfigError("plugins.wandb.mode", f"{plugin_config.mode!r} is not a W&B mode",
                              "use online, offline or disabled (or null: W&B's own setting)")
        for key in TEXT:
            text_or_null(plugin_config[key], f"plugins.wandb.{key}")

    @hookimpl
    def start_tracking(self, run_dir: Path, run: dict[str, Any], first_step: int, config: DictConfig,
                       plugin_config: DictConfig) -> None:
        """wandb: start the W&B run (continue it when resumed) with the config and the run record."""
        ids = run_dir / RUN_ID_FILE
        resumed = first_step > 1 and ids.exists()
        run_id = json.loads(ids.read_text())["id"] if resumed else uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=plugin_config.project, entity=plugin_config.entity, name=plugin_config.name or run_dir.name,
            group=plugin_config.group, tags=list(plugin_config.tags), mode=plugin_config.mode,
            dir=str(Path(plugin_config.dir or run_dir)), id=run_id, resume="allow" if resumed else None,
            config={**OmegaConf.to_container(config, resolve=True), "run": run}, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"))
        ids.write_text(json.dumps({"id": run_id}) + "\n")

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """wandb: send a logged step's values."""
        if self.run is not None and metrics:
            self.run.log({key: value for key, value in metrics.items() if key != "step"}, step=step)

    @hookimpl
    def on_train_end(self, preempted: bool) -> None:
        """wandb: end the run, marked preempted when a signal stopped training (it resumes in the same run)."""
        if self.run is not None:
            if preempted:
                self.run.mark_preempting()
            self._finish(exit_code=0)

    @hookimpl
    def on_error(self, error: BaseException) -> None:
        """wandb: end the run as failed, the failure's line in its summary's ``error`` (another rank's, when that one
        failed first)."""
        if self.run is not None:
            self.run.summary["error"] = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"
            self._finish(exit_code=1)

    def _finish(self, exit_code: int) -> None:
        run, self.run = self.run, None
        run.finish(exit_code=exit_code)
