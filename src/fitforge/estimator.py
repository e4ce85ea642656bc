"""Estimator: holds the net, loss(es), metrics, optimizer(s) and device; ``fit``/``evaluate``/``predict``."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fitforge.checkpoint.load_weights import place_built
from fitforge.checkpoint.weights_io import WeightsInOut
from fitforge.checks.activation_checkpointing import checkpoint_activations
from fitforge.checks.options import (
    check_net,
    compile_net,
    resolve_device,
    resolve_optimizers,
    resolve_precision,
    warn_default_optimizer,
)
from fitforge.core.coordinator import PassWatch
from fitforge.core.dispatch import Dispatcher
from fitforge.core.events import EventHandler
from fitforge.core.history import History
from fitforge.core.modules import tensors_of
from fitforge.core.processor import (
    BatchProcessor,
    check_batch_processor,
)
from fitforge.core.roles import WeightAveraging
from fitforge.distributed.ranks import on_this_rank
from fitforge.distributed.strategy import Strategy, resolve_strategy
from fitforge.evaluation import Evaluation
from fitforge.exceptions import FitforgeValueError, check_flag
from fitforge.handlers.defaults import fit_handlers, run_keys
from fitforge.losses.loss import loss_sets
from fitforge.metrics.resolve import check_independent, check_output_indices, copy_slots, resolve_metrics
from fitforge.optim.learning_rate import set_learning_rate
from fitforge.optim.schedule_free import schedule_free_weights
from fitforge.plans.fit import plan_fit
from fitforge.plans.passes import check_first_batch_of, evaluation_of, plan_predict
from fitforge.signals.preemption import Preemption, preemptible, raise_if_preempted
from fitforge.tools.lr_find import LRFindResult, lr_find

log = logging.getLogger("fitforge")


class Estimator(WeightsInOut):
    """Train, evaluate and predict with a PyTorch model without writing the loop.

    Args:
        net: the model.
        loss: a loss module or callable ``(pred, label) -> scalar``, or a list (one per output,
            matched by position); or a dict by output name (``{"cls": ..., "reg": ...}``) for a net
            that returns a dict of named outputs, with labels a dict of the same names; or None for
            a model that computes its own loss (a Hugging Face model given ``labels``): its
            output's ``loss`` is trained on and reported, metrics and ``predict`` get its ``logits``
            (see :class:`BatchProcessor` for the keys). A net's dict output is named outputs only
            with a dict ``loss``.
        train_metrics: a name (``"accuracy"``), a metric object (built-in or torchmetrics), a list or
            dict of them, or ``{output_index: metrics}``; with a dict ``loss``, a dict by output name
            (``{"cls": ["accuracy"], "reg": "mae"}``, keys ``train_cls_accuracy``...). None infers
            one from the loss (from each output's loss, by name).
        val_metrics: as ``train_metrics``; None copies the training metrics.
        optimizer: an optimizer, a list of them, a name (``"adam"``, ``"sgd"``, ``"muon"``: Muon with AdamW,
            :func:`fitforge.optim.muon`) or None (Adam, lr 1e-3,
            with a warning at the first fit; none at all for evaluate and predict).
        device: None (CUDA if available, else CPU), ``"cpu"``, ``"cuda:0"``, a torch.device...
        val_net / val_loss: used by evaluate and predict instead of ``net``/``loss`` when given.
        batch_processor: a :class:`BatchProcessor` (subclass) instance for custom steps.
        loss_weights: one weight per loss for the total of several losses: a list by position, or
            a dict by output name with a dict ``loss`` (a name left out weighs 1.0).
        precision: None (float32), ``"bf16-mixed"`` (forward and loss under bfloat16 autocast) or
            ``"16-mixed"`` (float16 autocast with a GradScaler, whose state checkpoints keep).
        compile: True (or a dict of ``torch.compile`` arguments) compiles the net's forward,
            falling back to eager with a warning where it cannot compile; ``state_dict`` keys
            are unchanged. ``val_net``, when it is the same module, runs compiled too.
        activation_checkpointing: a module class (a transformer block's) or a tuple of them: each such module
            of the net keeps no activation for the backward, which runs its forward again (less memory, about a
            third more compute); the loss and gradients are the same. ``state_dict`` keys are unchanged.
        channels_last: keep the net's 4-D weights and the 4-D inputs of every batch in
            channels-last memory order (N, H, W, C strides): faster convolutions for CNNs on CUDA,
            notably under mixed precision. Shapes, results and ``state_dict`` keys are unchanged.
        strategy: how several processes train (see docs/distributed.md): a
            :class:`fitforge.distributed.Strategy` (one of your own, see docs/extending.md), or a
            name. ``"auto"`` (default): data-parallel (``DistributedDataParallel``) when launched by
            ``torchrun`` with several processes, else one process; ``"ddp"``: data-parallel, an
            error without a launcher; ``"fsdp"``: sharded data-parallel with FSDP2 ``fully_shard``
            for models too big for one device (see :mod:`fitforge.distributed.fsdp`); ``"none"``
            (or None): fitforge neither wraps the net nor splits the data.
        strategy_options: for a strategy given by name, keyword arguments for its wrapper, e.g.
            ``{"find_unused_parameters": True}`` for DDP, or ``{"shard": (Block,),
            "reshard_after_forward": False}`` for FSDP.

    Attributes:
        run_config: the resolved config of a run started from one (``fitforge fit --config``, see
            docs/cli.md), as plain JSON values; None otherwise. Checkpoints keep it (key ``config``)
            and the loggers record it with the run's parameters (``config.model.init_args.hidden``...,
            :func:`~fitforge.reporting.hparams.run_params`). Set it yourself to record your own.
        losses: the loss(es) resolved (:class:`~fitforge.losses.loss.Losses`): ``losses.train``, ``losses.validate``.

    Under ``torchrun`` each rank takes the device of its ``LOCAL_RANK``, the data is split across
    ranks, metrics are reduced over them and only rank 0 writes (see docs/distributed.md). ``net``
    stays the unwrapped module (``train_net`` is the wrapper fit's forward goes through).

    Example:
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        >>> est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters()))
        >>> history = est.fit(train_loader, val_data=val_loader, epochs=5)   # doctest: +SKIP
    """

    def __init__(
        self,
        net: nn.Module,
        loss: Any,
        train_metrics: Any = None,
        val_metrics: Any = None,
        optimizer: Any = None,
        device: Any = None,
        val_net: nn.Module | None = None,
        val_loss: Any = None,
        batch_processor: BatchProcessor | None = None,
        loss_weights: Sequence[float] | Mapping[str, float] | None = None,
        precision: str | None = None,
        compile: bool | dict = False,
        channels_last: bool = False,
        activation_checkpointing: type[nn.Module] | tuple[type[nn.Module], ...] | None = None,
        strategy: str | Strategy | None = "auto",
        strategy_options: dict | None = None,
    ) -> None:
        self.strategy = resolve_strategy(strategy, strategy_options)
        net = self.strategy.adopt(check_net(net))
        self.device = resolve_device(self.strategy.device(device))
        # Host-to-GPU copies need not block: from pinned memory they overlap compute, and from
        # pageable memory CUDA stages them before returning, so the batch can never change under them.
        self.non_blocking = self.device.type == "cuda"
        self.precision = precision
        self.autocast_dtype, self.scaler = resolve_precision(precision, self.device)
        self.channels_last = check_flag("Estimator", "channels_last", channels_last)
        self.net = compile_net(checkpoint_activations(self._place(net), activation_checkpointing), compile)
        self.val_net = self.net if val_net is None else self._place(check_net(val_net, "val_net"), "val_net")
        self.loss, self.val_loss = loss, loss if val_loss is None else val_loss
        self.losses = loss_sets(loss, val_loss, loss_weights, self.device)
        self.train_metrics = resolve_metrics(train_metrics, loss, "train_metrics")
        self.val_metrics = (
            copy_slots(self.train_metrics)
            if val_metrics is None
            else resolve_metrics(val_metrics, self.val_loss, "val_metrics")
        )
        check_independent(self.train_metrics, self.val_metrics)
        check_output_indices(self.train_metrics, self.losses.train.keys, "train_metrics")
        check_output_indices(self.val_metrics, self.losses.validate.keys, "val_metrics")
        self.optimizers = resolve_optimizers(optimizer, self.net)
        self._default_optimizer = optimizer is None  # warned of at the first fit or lr_find, not here
        self.train_net = self.strategy.wrap(self.net, self.optimizers, self.device)
        self.history = History()  # every epoch of every fit (each fit returns its own History)
        # The last fit's EMAHandler (a WeightAveraging role), else a schedule-free optimizer's evaluated weights:
        # evaluate and predict use its weights.
        self.weight_average: WeightAveraging | None = schedule_free_weights(self.net, self.optimizers)
        self.run_config: dict[str, Any] | None = None
        self.pass_watch: PassWatch | None = None  # during fit: what its validations ask between batches
        self.batch_processor = check_batch_processor(BatchProcessor() if batch_processor is None else batch_processor)

    def _place(self, net: nn.Module, argument: str = "net") -> nn.Module:
        if any(tensor.is_meta for tensor in tensors_of(net)):  # built without memory: load_weights gives it
            if argument != "net":
                raise FitforgeValueError(
                    f"{argument} is on the meta device, and load_weights loads net only: build {argument} on a "
                    "real device, or leave it out to evaluate with net"
                )
            return place_built(net, self.device)  # under FSDP each rank gets its shards only
        net = net.to(self.device)
        if self.channels_last:  # torch accepts memory_format at run time; its type stubs lack it
            net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
        return net

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The first (usually only) optimizer."""
        return self.optimizers[0]

    @property
    def splits_data(self) -> bool:
        """Whether fit, evaluate and predict split their data across torch.distributed ranks."""
        return self.strategy.splits_data

    # -- used by batch processors -------------------------------------------------------------------
    def compute_loss(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """``(weighted total, each loss)`` of the training loss(es); counts are checked."""
        return self.losses.train(pred, label)

    def compute_val_loss(self, pred: Any, label: Any) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """As :meth:`compute_loss` with ``val_loss``."""
        return self.losses.validate(pred, label)

    def check_first_val_batch(
        self, val_data: Iterable, name: str = "val_data", event_handlers: Sequence[EventHandler] | None = None
    ) -> None:
        """Evaluate a first validation batch once (eval mode, no grad, RNG state restored), as fit
        does before training, so a mistake in the validation data fails in a second, not after an epoch."""
        check_first_batch_of(self, val_data, name, event_handlers)

    def history_keys(self, validation: bool = False) -> list[str]:
        """The history keys a fit with the default handlers and the configured metrics produces."""
        return run_keys(fit_handlers(None, [] if validation else None), self)

    # -- entry points -------------------------------------------------------------------------------
    def fit(
        self,
        train_data: Iterable,
        val_data: Iterable | None = None,
        epochs: int | None = None,
        batches: int | None = None,
        event_handlers: Sequence[EventHandler] | None = None,
        default_handlers: bool = True,
        check_access: bool = False,
        profile: bool = False,
        batch_size: int | None = None,
        validation_split: float | None = None,
        sample_seeds: bool | None = None,
    ) -> History:
        """Train for ``epochs`` epochs or ``batches`` batches (exactly one) and return the History.

        ``train_data`` and ``val_data`` are iterables of batches (a DataLoader, a list), or whole
        arrays ``(X, y)`` of tensors or NumPy arrays, batched by ``batch_size`` (default 32; the
        training batches shuffled); ``validation_split=0.2`` holds out the arrays' last 20% as
        ``val_data`` (see :mod:`fitforge.inputs.arrays`).

        Default handlers (Stopping, GradientUpdate, Metric, Validation if ``val_data``, Logging, and
        ProgressBar on a terminal or notebook) are added unless ``event_handlers`` holds one of the
        same class. ``default_handlers=False`` adds only Stopping and GradientUpdate (and Validation
        if ``val_data`` is given): a lean loop.

        The fit's epochs are also appended to ``estimator.history``, and logs number epochs across fits.

        SIGTERM, SIGUSR1 or SIGINT during fit (its checks included) stops training after the current
        batch, or a validation after its current batch (the resumed run redoes it): a
        CheckpointHandler saves the state, ``train_end`` runs, then SIGTERM exits with status 143
        (``SystemExit``), SIGUSR1 requeues a SLURM job and exits with 0 (138 without SLURM) and
        SIGINT raises ``KeyboardInterrupt``; a second signal acts at once (see docs/checkpoints.md).

        A stop with an ending (``state.run.stop(reason, ending=Ending(word, error))``, e.g.
        OptunaPruningHandler's ``optuna.TrialPruned``) ends training as any stop does, then raises
        its ``error``; the fit's epochs are in ``estimator.history`` all the same.

        ``check_access=True`` (debug) makes handlers that declare ``reads``/``writes`` see a state
        that raises ``StateAccessError`` on an undeclared access (:mod:`fitforge.core.dispatch`).
        ``profile=True`` logs the time each handler spent in each event (``history.profile``);
        for a ``torch.profiler`` trace of chosen steps, pass a ``ProfilerHandler``.

        ``sample_seeds=True`` reads each sample of a map-style ``train_data`` DataLoader (torch's, or
        torchdata's ``StatefulDataLoader``) with torch's generator seeded from (the fit's seed, the epoch,
        the sample's index): a random transform in ``__getitem__`` is then the same whatever
        ``num_workers``, rank or resume point (docs/data-at-scale.md). None (default): on when a handler
        saves checkpoints.

        Raises:
            TypeError/ValueError: bad arguments or data, before training starts; bad batches,
                shapes or dtypes at the first batch, before any optimizer step.
        """
        self._announce_default_optimizer("fit")
        preemption = Preemption()
        with preemptible(preemption):  # from the checks on: a signal there stops the fit before its first batch
            plan = plan_fit(
                self,
                train_data,
                val_data,
                epochs,
                batches,
                event_handlers,
                default_handlers,
                check_access,
                profile,
                batch_size,
                validation_split,
                sample_seeds,
            )
            state = plan.run(self, preemption)
        raise_if_preempted(state)
        if state.run.stop_ending is not None:  # e.g. optuna.TrialPruned, raised once the run ended cleanly
            raise state.run.stop_ending.error
        return state.history

    def _announce_default_optimizer(self, entry: str) -> None:
        if self._default_optimizer:
            self.optimizers = warn_default_optimizer(self.optimizers, self.net, self.train_net is not self.net, entry)
            self._default_optimizer = False  # once per estimator

    def evaluate(
        self,
        val_data: Iterable,
        event_handlers: Sequence[EventHandler] | None = None,
        batch_size: int | None = None,
        prefix: str = "val",
    ) -> dict[str, float]:
        """Loss and metrics of ``val_net`` over ``val_data``: ``{"val_loss": ..., "val_<metric>": ...}``.
        ``val_data`` may be arrays ``(X, y)``, batched by ``batch_size`` (default 32).

        ``prefix`` names the data in the keys: ``evaluate(test_loader, prefix="test")`` returns
        ``{"test_loss": ..., "test_<metric>": ...}`` (the values ``state.log`` names too). It is a
        name of letters, digits and ``_`` starting with a letter; the ``_`` after it is added. The
        validation inside ``fit`` always records ``val_*``.

        Raises:
            FitforgeTypeError/FitforgeValueError: a bad ``prefix`` or bad data (before any batch).
        """
        return evaluation_of(self, val_data, event_handlers, batch_size, prefix)[0]()

    def evaluation(
        self,
        val_data: Iterable,
        event_handlers: Sequence[EventHandler] | None = None,
        checked: bool = False,
        placed: bool = False,
    ) -> Evaluation:
        """:meth:`evaluate` set up once, to call as often as needed (as fit sets up its validations):
        ``checked`` when the data's first batch was checked already, ``placed`` when ``val_net``'s
        device was just checked (see :class:`~fitforge.evaluation.Evaluation`)."""
        return evaluation_of(self, val_data, event_handlers, placed=placed, checked=checked)[0]

    def predict(
        self, data: Iterable, event_handlers: Sequence[EventHandler] | None = None, batch_size: int | None = None
    ) -> Any:
        """``val_net`` outputs for every batch, concatenated on the CPU (a tuple for multi-output nets, a
        dict of tensors for a net returning named outputs).

        Batches may be ``(data, label)`` pairs (the label is ignored), ``(data,)`` or bare tensors;
        ``data`` may also be a whole array ``X``, batched by ``batch_size`` (default 32).
        Outputs move to the host batch by batch, so a large prediction never fills the device. The
        net runs in eval mode under ``torch.inference_mode``; the returned tensors are ordinary ones.

        Outputs follow the dataset's order even when the DataLoader shuffles (it is read through a
        sequential sampler, with a warning). Under torch.distributed each rank predicts its share of
        a DataLoader's dataset, and rank 0 returns every output in dataset order; the other ranks
        return None.
        """
        return plan_predict(self, data, event_handlers, batch_size).run_all()

    def predict_batches(
        self, data: Iterable, event_handlers: Sequence[EventHandler] | None = None, batch_size: int | None = None
    ) -> Iterator[Any]:
        """Each batch's ``val_net`` outputs, on the CPU, as they are computed: what :meth:`predict`
        returns, batch by batch and in the same order, with none of them kept (bounded memory, for
        predictions larger than memory: write each batch out as it comes).

        It takes what ``predict`` takes. Between batches your code runs with the net's modes and
        grad mode as they were (each batch is computed in eval mode under ``torch.inference_mode``).
        The handlers' ``epoch_end`` runs after the last batch; a loop you leave early ends the pass
        there. Under torch.distributed each rank gets the outputs of its own share of the data.
        Example: docs/getting-started.md, "evaluate and predict".
        """
        # A generator: the data is checked at the first next(), as any generator starts there.
        yield from plan_predict(self, data, event_handlers, batch_size, stream=True).stream()

    def lr_find(
        self,
        train_data: Iterable,
        start_lr: float = 1e-7,
        end_lr: float = 10.0,
        num_steps: int = 100,
        smoothing: float = 0.05,
        diverge_factor: float = 4.0,
        batch_size: int | None = None,
    ) -> LRFindResult:
        """Run the learning-rate range test on ``train_data`` (batches, or arrays ``(X, y)`` in batches
        of ``batch_size``) and return its curve and a suggested rate: see :func:`fitforge.tools.lr_find.lr_find`.
        Weights, optimizer states, modes and random generators are restored exactly afterwards."""
        self._announce_default_optimizer("lr_find")
        return lr_find(self, train_data, start_lr, end_lr, num_steps, smoothing, diverge_factor, batch_size)

    def set_lr(self, lr: float | Sequence[float], optimizer: int | torch.optim.Optimizer | None = None) -> None:
        """Set the learning rate the next fit trains with: fine-tuning's lower rate for a second phase.

        ``lr`` is written into every parameter group of every optimizer (of ``optimizers[optimizer]``
        when an index or one of them is given), and into the ``initial_lr`` a scheduler recorded, so
        a scheduler built afterwards starts from it. A list gives one rate per parameter group of
        one optimizer (a backbone lower than its head). A scheduler of an earlier phase keeps its own
        base rates: build a new one for the next phase. See docs/fine-tuning.md (unfreeze, set_lr, fit on).

        Raises:
            FitforgeTypeError/FitforgeValueError: ``lr`` not a number (or list of them) that is finite
                and not negative, one per parameter group; ``optimizer`` not an index or one of them.
        """
        set_learning_rate(self.optimizers, lr, optimizer)

    def describe_loop(
        self,
        event_handlers: Sequence[EventHandler] | None = None,
        val_data: Iterable | None = None,
        default_handlers: bool = True,
    ) -> str:
        """The handlers each event of ``fit`` with these arguments calls, in order, as text."""
        handlers = fit_handlers(event_handlers, val_data, default_handlers) + self.strategy.fit_handlers()
        return Dispatcher(on_this_rank(handlers)).describe()
