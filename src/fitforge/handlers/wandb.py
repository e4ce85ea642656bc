"""WandbHandler: a run's parameters and its epochs' history in Weights & Biases, written from a background thread."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, describe
from fitforge.reporting.hparams import ParamValue, check_params, run_params
from fitforge.reporting.tracking import FLUSH_SECS, BackgroundWriter, RunTracker, check_names

_MODES = ("online", "offline", "disabled")
_FLUSH_SETTING = "x_transaction_log_flush_interval"  # how often W&B's service writes the run's files (seconds)


class WandbHandler(RunTracker):
    """Track a fit as a Weights & Biases run: the run's parameters as its config, every history value of each
    training epoch (plotted over ``epoch``, from 1), and how the fit ended. It starts a run, or joins the active
    one (``wandb.run``), whose end it then leaves to its owner; a fit resumed from a checkpoint continues the run of
    the fit that saved it (the same id, ``resume="allow"``). A background thread hands the values to W&B, so no step
    waits for it. Needs ``pip install 'fitforge[wandb]'``; ``mode="offline"`` needs no
    account and no network (``wandb sync`` uploads the run later). docs/handlers.md (Experiment tracking) has the
    details.

    Args:
        project: the W&B project of a new run; None: W&B's (``WANDB_PROJECT``, else its default).
        run_name: the new run's display name (None: W&B makes one up).
        config: more config values (str keys; str, int, float or bool values), merged over the run's own.
        tags: tags of a new run.
        dir: the folder W&B writes its files under (None: ``WANDB_DIR``, else the working folder).
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: W&B's (``WANDB_MODE``, else online).
        flush_secs: the longest an epoch's values wait before they are in the run's files: W&B's service writes
            them this often (a process killed loses at most these seconds of values; online, W&B uploads them
            on its own schedule). Not applied when ``init_kwargs`` gives ``settings``.
        init_kwargs: more arguments of ``wandb.init`` (``entity``, ``group``, ``id``...).
    """

    def __init__(
        self,
        project: str | None = None,
        run_name: str | None = None,
        config: Mapping[str, ParamValue] | None = None,
        tags: Sequence[str] | None = None,
        dir: str | None = None,
        mode: str | None = None,
        flush_secs: float = FLUSH_SECS,
        init_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__(flush_secs)
        check_names("WandbHandler", project=project, run_name=run_name, dir=dir)
        if mode is not None and mode not in _MODES:
            raise FitforgeValueError(f"WandbHandler: mode must be one of {_MODES} or None, got {describe(mode)}")
        if tags is not None and (isinstance(tags, str) or not all(isinstance(tag, str) for tag in tags)):
            raise FitforgeTypeError(f"WandbHandler: tags must be a list of str, got {describe(tags)}")
        if init_kwargs is not None and not isinstance(init_kwargs, Mapping):
            raise FitforgeTypeError(f"WandbHandler: init_kwargs must be a dict, got {describe(init_kwargs)}")
        self.extra_config = check_params("WandbHandler", config, "config")
        try:  # imported here, not at module import: wandb is an optional extra
            import wandb
        except ImportError as err:
            raise ImportError("WandbHandler needs the wandb package: pip install 'fitforge[wandb]'") from err
        self._wandb: Any = wandb
        self.project, self.run_name, self.dir, self.mode = project, run_name, dir, mode
        self.tags = None if tags is None else list(tags)
        self.init_kwargs = dict(init_kwargs or {})
        self._run: Any = None  # set while a run is open
        self._run_config: dict[str, ParamValue] = {}
        self._plotted: set[str] = set()  # the keys plotted over the epoch

    def train_begin(self, state: TrainState) -> None:
        self._run = None
        self._run_config = {**run_params(state), **self.extra_config}
        super().train_begin(state)

    def _open(self) -> None:
        wandb = self._wandb
        if wandb.run is not None:
            run, self._owned = wandb.run, False
            run.config.setdefaults(self._run_config)  # the values its owner set are kept
        else:
            arguments = {"project": self.project, "name": self.run_name, "tags": self.tags, "dir": self.dir}
            arguments = {key: value for key, value in arguments.items() if value is not None}
            arguments.update(self.init_kwargs)
            if self._resumed_run is not None:
                arguments.update(id=self._resumed_run, resume="allow")
            if "settings" not in arguments and _FLUSH_SETTING in getattr(wandb.Settings, "model_fields", {}):
                # W&B's service writes the run's files every 15 s by default, and nothing more if its process is killed.
                arguments["settings"] = wandb.Settings(**{_FLUSH_SETTING: self.flush_secs})
            run, self._owned = wandb.init(mode=self.mode, config=self._run_config, **arguments), True
        self._run, self.run_id, self._plotted = run, run.id, set()
        # Handed over at once: W&B's service keeps them until its own flush, every flush_secs.
        self._writer = BackgroundWriter("WandbHandler", self._write, flush_secs=0.0)

    def _write(self, records: list[tuple[int, int, dict[str, float]]]) -> None:
        """On the writer's thread: a W&B row per epoch, each key plotted over ``epoch`` (not W&B's own step, which
        a resumed run cannot set back)."""
        run = self._run
        for epoch, _, row in records:
            for key in row.keys() - self._plotted:
                run.define_metric(key, step_metric="epoch")
                self._plotted.add(key)
            run.log({**row, "epoch": epoch})

    def _end(self, ended: str) -> None:
        run, self._run = self._run, None
        if self._owned:
            if ended == "killed":  # W&B marks it preempted: a resumed fit continues it
                run.mark_preempting()
            run.finish(exit_code=0 if ended == "finished" else 1)

    def __repr__(self) -> str:
        return f"WandbHandler(project={self.project!r}, mode={self.mode!r})"
