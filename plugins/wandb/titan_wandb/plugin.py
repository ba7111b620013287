"""Weights & Biases: rank 0's config, run record and logged metrics in a W&B run.

One W&B run per training run: started before the first step with the resolved config and ``run.json`` (under
the ``run`` key), a point per logged step (training, validation and plugins' metrics, W&B's step = the
training step), ended finished, preempted or failed. A resumed training run continues its W&B run: the id is
kept in the run dir (``wandb.json``), which a restart shares. ``mode=offline`` writes the run under ``dir``
for ``wandb sync`` later: clusters without internet, and this project's tests.

Checked before launch: ``dir`` can be written (W&B would fall back to a temporary folder without a word), and a
run asked to go online (``mode=online``, or ``WANDB_MODE=online``) has a login: ``WANDB_API_KEY``, an identity
token file, or the key ``wandb login`` keeps in the netrc file. A failure once training runs stops the tracking,
not the training: one warning line, and ``metrics.jsonl`` keeps every step.
"""

from __future__ import annotations

import json
import logging
import netrc
import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from omegaconf import DictConfig, OmegaConf

from titan_core import ConfigError, hookimpl, text_or_null

logging.getLogger("wandb").setLevel(logging.WARNING)  # its import and start-up chatter, kept off the console
import wandb  # noqa: E402

MODES = (None, "online", "offline", "disabled")
TEXT = ("entity", "name", "group", "dir")  # options whose default is null
RUN_ID_FILE = "wandb.json"
DEFAULT_HOST = "https://api.wandb.ai"
log = logging.getLogger("titan_core")


class WandbTracker:
    """The W&B run of this training run, on rank 0 only (None elsewhere and before the start)."""

    def __init__(self) -> None:
        self.run: wandb.Run | None = None

    @hookimpl
    def validate(self, plugin_config: DictConfig) -> None:
        """wandb: refuse a mode W&B does not have, names that are not text, a folder that cannot be written and an
        online run without a login."""
        if plugin_config.mode not in MODES:
            raise ConfigError("plugins.wandb.mode", f"{plugin_config.mode!r} is not a W&B mode",
                              "use online, offline or disabled (or null: W&B's own setting)")
        for key in TEXT:
            text_or_null(plugin_config[key], f"plugins.wandb.{key}")
        if plugin_config.dir is not None:
            folder = Path(plugin_config.dir).expanduser()
            existing = next(p for p in (folder, *folder.parents) if p.exists())
            if not existing.is_dir() or not os.access(existing, os.W_OK):
                wrong = "is not a folder" if not existing.is_dir() else "cannot be written"
                raise ConfigError("plugins.wandb.dir", f"{existing} {wrong} (W&B would write to a temporary folder "
                                  "instead)", "point it at a folder this job can write, or null for the run dir")
        if (plugin_config.mode or os.environ.get("WANDB_MODE")) == "online":
            host = urlparse(os.environ.get("WANDB_BASE_URL", DEFAULT_HOST)).hostname
            if not logged_in(host):
                raise ConfigError("plugins.wandb.mode", f"online needs a W&B login for {host}, and there is none "
                                  "(no WANDB_API_KEY, no identity token file, no key in the netrc file)",
                                  "run wandb login (or set WANDB_API_KEY), or set plugins.wandb.mode=offline and "
                                  "wandb sync later")

    @hookimpl
    def start_tracking(self, run_dir: Path, run: dict[str, Any], first_step: int, config: DictConfig,
                       plugin_config: DictConfig) -> None:
        """wandb: start the W&B run (continue it when resumed) with the config and the run record."""
        ids = run_dir / RUN_ID_FILE
        resumed = first_step > 1 and ids.exists()
        run_id = json.loads(ids.read_text())["id"] if resumed else uuid.uuid4().hex[:12]
        self._tracking("start", lambda: self._start(run_dir, run, config, plugin_config, run_id, resumed))
        ids.write_text(json.dumps({"id": run_id}) + "\n")

    def _start(self, run_dir: Path, run: dict[str, Any], config: DictConfig, plugin_config: DictConfig, run_id: str,
               resumed: bool) -> None:
        self.run = wandb.init(
            project=plugin_config.project, entity=plugin_config.entity, name=plugin_config.name or run_dir.name,
            group=plugin_config.group, tags=list(plugin_config.tags), mode=plugin_config.mode,
            dir=str(Path(plugin_config.dir or run_dir)), id=run_id, resume="allow" if resumed else None,
            config={**OmegaConf.to_container(config, resolve=True), "run": run}, reinit="create_new",
            settings=wandb.Settings(silent=True, console="off"))

    @hookimpl
    def on_step_end(self, step: int, metrics: dict[str, float]) -> None:
        """wandb: send a logged step's values."""
        if self.run is not None and metrics:
            run = self.run
            self._tracking(f"step {step}", lambda: run.log({key: value for key, value in metrics.items()
                                                             if key != "step"}, step=step))

    @hookimpl
    def on_train_end(self, preempted: bool) -> None:
        """wandb: end the run, marked preempted when a signal stopped training (it resumes in the same run)."""
        if self.run is not None:
            if preempted:
                self._tracking("the preemption", self.run.mark_preempting)
            self._finish(exit_code=0)

    @hookimpl
    def on_error(self, error: BaseException) -> None:
        """wandb: end the run as failed, the failure's line in its summary's ``error`` (another rank's, when that one
        failed first)."""
        if self.run is not None:
            self.run.summary["error"] = one_line(error)
            self._finish(exit_code=1)

    def _finish(self, exit_code: int) -> None:
        run = self.run
        if run is not None:
            self._tracking("the end", lambda: run.finish(exit_code=exit_code))
        self.run = None

    def _tracking(self, what: str, call: Callable[[], Any]) -> None:
        """Run one exchange with W&B; a failure stops the tracking, never the training, in one line."""
        try:
            call()
        except Exception as error:
            self.run = None
            log.warning("plugins.wandb: tracking stopped at %s (%s); training goes on, metrics.jsonl keeps every step",
                        what, one_line(error))


def one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[-1]}"


def logged_in(host: str | None) -> bool:
    """Whether W&B has credentials for ``host``: its API key or identity token file in the environment, or the key
    ``wandb login`` writes into the netrc file (``NETRC``, else ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        return netrc.netrc(os.environ.get("NETRC") or None).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False
