"""MLflowHandler: a run's parameters, its epochs' history and its best checkpoint in MLflow tracking, written
from a background thread."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from typing import Any

from fitforge.core.services import CheckpointSaver
from fitforge.core.state import TrainState
from fitforge.exceptions import FitforgeTypeError, FitforgeValueError, check_flag, describe
from fitforge.reporting.hparams import ParamValue, check_params, run_params
from fitforge.reporting.tracking import FLUSH_SECS, BackgroundWriter, RunTracker, check_names

log = logging.getLogger("fitforge")
_PARAMS, _METRICS = 100, 1000  # per log_batch call (MLflow's limits)


class MLflowHandler(RunTracker):
    """Track a fit as an MLflow run: parameters at the start, the history per epoch, and the status (and optionally
    the best checkpoint) at the end. It starts a run, or joins the active one, whose end it then leaves to its owner;
    a fit resumed from a checkpoint continues the run of the fit that saved it. The epochs' values are written from a
    background thread, so no step waits for the tracking store. Needs ``pip install 'fitforge[mlflow]'``;
    docs/handlers.md (Experiment tracking) has the details.

    Args:
        tracking_uri: where runs are stored (``"sqlite:///mlflow.db"``, ``"http://host:5000"``); None: MLflow's default.
        experiment_name: the experiment of a new run, created if needed; None: MLflow's (from the environment).
        run_name: the new run's name (None: MLflow makes one up).
        params: more parameters (str keys; str, int, float or bool values), merged over the run's own.
        tags: tags of a new run (str to str).
        log_best_checkpoint: at ``train_end``, upload the best checkpoint of the fit's
            ``CheckpointHandler(save_best=True)`` as an artifact.
        flush_secs: the longest an epoch's values wait before they are written (a process killed loses at most
            these seconds of values).
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment_name: str | None = None,
        run_name: str | None = None,
        params: Mapping[str, ParamValue] | None = None,
        tags: Mapping[str, str] | None = None,
        log_best_checkpoint: bool = False,
        flush_secs: float = FLUSH_SECS,
    ) -> None:
        super().__init__(flush_secs)
        check_names("MLflowHandler", tracking_uri=tracking_uri, experiment_name=experiment_name, run_name=run_name)
        if tags is not None and (
            not isinstance(tags, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items())
        ):
            raise FitforgeTypeError(f"MLflowHandler: tags must be a dict of str to str, got {describe(tags)}")
        self.params = check_params("MLflowHandler", params)
        self.log_best_checkpoint = check_flag("MLflowHandler", "log_best_checkpoint", log_best_checkpoint)
        try:  # imported here, not at module import: mlflow is an optional extra
            import mlflow
            from mlflow.entities import Metric, Param
            from mlflow.exceptions import MlflowException
        except ImportError as err:
            raise ImportError("MLflowHandler needs the mlflow package: pip install 'fitforge[mlflow]'") from err
        self._mlflow: Any = mlflow
        self._metric, self._param, self._refused = Metric, Param, MlflowException
        self.tracking_uri, self.experiment_name, self.run_name = tracking_uri, experiment_name, run_name
        self.tags = dict(tags or {})
        self._client: Any = None  # set while a run is open
        self._run_params: dict[str, str] = {}

    def train_begin(self, state: TrainState) -> None:
        self._client = None
        if self.log_best_checkpoint and self._best_saver(state) is None:
            raise FitforgeValueError(
                "MLflowHandler: log_best_checkpoint=True needs a CheckpointHandler(save_best=True, monitor=...) "
                "among the fit's event_handlers"
            )
        self._run_params = {key: str(value) for key, value in {**run_params(state), **self.params}.items()}
        super().train_begin(state)

    def _open(self) -> None:
        mlflow = self._mlflow
        active = mlflow.active_run()
        joined = None  # "active" or "resumed": a run that may have parameters already
        if active is not None and self.tracking_uri in (None, mlflow.get_tracking_uri()):
            client, self._owned = mlflow.MlflowClient(mlflow.get_tracking_uri()), False
            run_id, joined = active.info.run_id, "active"
        else:
            client, self._owned = mlflow.MlflowClient(self.tracking_uri), True
            run_id = self._continued(client)
            if run_id is None:
                run = client.create_run(self._experiment_id(client), tags=self.tags, run_name=self.run_name)
                run_id = run.info.run_id
            else:
                joined = "resumed"
        self._client, self.run_id = client, run_id
        self._writer = BackgroundWriter("MLflowHandler", self._write, self.flush_secs)
        params = self._run_params
        try:
            self._log_params(params)
        except self._refused:  # a joined run may have some with other values: MLflow never changes a logged param
            existing = client.get_run(run_id).data.params if joined else {}
            clashes = sorted(key for key, value in params.items() if existing.get(key, value) != value)
            if not clashes:
                raise
            log.warning(
                "MLflowHandler: the %s run already has other values for %s; kept them", joined, ", ".join(clashes)
            )
            self._log_params({key: value for key, value in params.items() if key not in existing})

    def _log_params(self, params: dict[str, str]) -> None:
        entities = [self._param(key, value) for key, value in params.items()]
        for start in range(0, len(entities), _PARAMS):
            self._client.log_batch(self.run_id, params=entities[start : start + _PARAMS])

    def _continued(self, client: Any) -> str | None:
        """The run of the checkpoint this fit resumed from, running again; None if there is none to continue."""
        run_id = self._resumed_run
        if run_id is None:
            return None
        try:
            client.update_run(run_id, status="RUNNING")
        except Exception as err:  # e.g. another tracking store than the one of the saving fit
            log.warning("MLflowHandler: cannot continue the checkpoint's run %s (%s); starting a new run", run_id, err)
            return None
        return run_id

    def _experiment_id(self, client: Any) -> str:
        name = self.experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if name is None:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")  # "0": MLflow's Default experiment
        experiment = client.get_experiment_by_name(name)
        return experiment.experiment_id if experiment is not None else client.create_experiment(name)

    def _write(self, records: list[tuple[int, int, dict[str, float]]]) -> None:
        """On the writer's thread: the finite metrics of the epochs gathered, in as few batches as MLflow takes."""
        metrics = [
            self._metric(key, value, at, epoch)
            for epoch, at, row in records
            for key, value in row.items()
            if math.isfinite(value)
        ]
        try:
            for start in range(0, len(metrics), _METRICS):
                self._client.log_batch(self.run_id, metrics=metrics[start : start + _METRICS])
        except Exception as err:  # a tracking server out of reach must not end (and lose) the training
            epochs = ", ".join(str(epoch) for epoch, _, _ in records)
            log.warning("MLflowHandler: the metrics of epoch(s) %s were not logged (%s); training goes on", epochs, err)

    def _before_end(self, state: TrainState) -> None:
        saver = self._best_saver(state) if self.log_best_checkpoint else None
        path = None if saver is None else saver.best_checkpoint()
        if path is not None and path.is_file():
            self._client.log_artifact(self.run_id, str(path), artifact_path="checkpoints")
        elif self.log_best_checkpoint:
            log.warning("MLflowHandler: no best checkpoint was saved in this fit; none uploaded")

    def _end(self, ended: str) -> None:
        client, self._client = self._client, None
        if self._owned:
            client.set_terminated(self.run_id, status=ended.upper())

    @staticmethod
    def _best_saver(state: TrainState) -> CheckpointSaver | None:
        """The handler saving the best checkpoint (a CheckpointHandler with ``save_best``)."""
        return next((s for s in state.services.checkpoints if s.best_weights() == "saved"), None)

    def __repr__(self) -> str:
        return f"MLflowHandler({self.tracking_uri!r}, experiment_name={self.experiment_name!r})"
