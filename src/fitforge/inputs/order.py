"""The training data of one fit, epoch by epoch, in an order a checkpoint can restore (docs/checkpoints.md,
"The data order"): a loader or sampler without a generator of its own gets one, reseeded every epoch
from the epoch and the fit's seed; a user's own generator has its state at each epoch's start recorded.
Data that keeps its own position (:mod:`fitforge.inputs.stateful`) has its state saved and loaded instead.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from fitforge.core.batches import loader_options, sampler_of
from fitforge.core.rng import derived_seed, restore_rng_states, rng_states
from fitforge.core.state import TrainState
from fitforge.distributed.ranks import broadcast_from_main, rank, world_size
from fitforge.inputs.indexed import draw_worker_seed, indexed_batches
from fitforge.inputs.placement import epoch_permutation, rank_remainder
from fitforge.inputs.seeds import EpochKeys, SeededSamples, keyed_loader, unseedable
from fitforge.inputs.stateful import epoch_setter, position_holder, resumable_buffers
from fitforge.inputs.streams import shared_stream
from fitforge.signals.worker_shield import shielded

log = logging.getLogger("fitforge")
_SEEDED_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)  # they draw from .generator


def epoch_seed(seed: int, epoch: int, role: str) -> int:
    """A 63-bit seed for ``role``'s generator in ``epoch``, unrelated to its neighbours'."""
    return derived_seed(f"{seed}:{epoch}:{role}")


def _draw_seed() -> int:
    """A seed from torch's global generator: a hash of its state (no host read), then one draw moves it on."""
    digest = hashlib.blake2b(torch.get_rng_state().numpy().tobytes(), digest_size=8).digest()
    torch.empty((), dtype=torch.int64).random_()
    return int.from_bytes(digest, "little") >> 1


class DataOrder:
    """``train_data`` for one fit: :meth:`epoch` gives each epoch's iterable (from a start position).

    Attributes:
        problem: None when a position can be restored exactly by index, else why not (for a warning).
        unplaceable: None when the order is one for every number of ranks and batch size, else why not.
        seed: the seed of the generators given to the loader (None when it needed none).
        offset: ``(samples, position)``: the batches from ``position`` on follow ``samples`` samples.
        samples: with ``sample_seeds``, the loader's dataset read with per-sample seeds
            (:mod:`fitforge.inputs.seeds`); None for data whose positions are not exact, or a
            ``TensorDataset``, which has no transform.
        holder: the object whose state is the position in the epoch (:mod:`fitforge.inputs.stateful`), or None;
            for a ``StatefulDataLoader`` read with sample seeds, the loader over its samples.
        stream: a Hugging Face stream every rank reads whole (:mod:`fitforge.inputs.streams`), or None; its
            state, the holder's, continues on any number of ranks.
    """

    def __init__(
        self, data: Iterable, sample_seeds: bool | None = False, resumable: bool = False, split: bool = True
    ) -> None:
        """``sample_seeds``: read each sample with its own seeds (None: where ``resumable``, a handler saving
        checkpoints); ``resumable``: a Hugging Face stream's shuffle buffer is made resumable; ``split``: the
        strategy splits the data across ranks (a Hugging Face stream's too)."""
        self.data = data
        self.seed: int | None = None
        self._managed: dict[str, tuple[Any, torch.Generator]] = {}  # role -> (owner, generator given to it)
        self._own: list[torch.Generator] = []  # the user's generators, restored by state
        self._start: list[torch.Tensor] = []  # their states at the current epoch's start
        self._epoch_samplers: list[Any] = []  # DistributedSamplers: their order is set by set_epoch
        self.shuffled = False  # whether the order is random (a position then depends on the sampler)
        self.epoch_start_step = 0  # global_step when the current epoch began
        self._resume_position = 0  # where the next epoch starts: set by a resume
        self._resume_sample: int | None = None  # the sample it starts from, when placed anew
        self.offset = (0, 0)
        self._legacy_seeding = False  # a checkpoint from before one order for every world size
        self.unplaceable: str | None = None
        self.holder, self._unsaved = position_holder(data)  # _unsaved: why a dataset's state cannot be saved
        self.stream = shared_stream(data, resumable, split)  # a stream every rank reads whole, keeping its share
        if self.stream is not None:
            self.holder, self._unsaved = self.stream, None
        self._loaded: Any = None  # the holder's state a resume loaded, until a batch is read after it
        self._first: int | None = None  # the position of the first batch of the epoch under way
        self._put_back = resumable_buffers(data) if self.holder is not None and resumable else None
        self.problem = self._inspect(data)
        if self.unplaceable is None:
            self.unplaceable = self.problem
        self.samples: SeededSamples | None = None
        self._keyed: tuple[DataLoader, EpochKeys] | None = None  # each epoch's loader over the samples
        self._reader: Iterable = self.stream or data  # what each epoch reads from its start (samples: below)
        self._repeats = False  # whether the sampler draws with replacement (a sample repeated in an epoch)
        why_not = unseedable(data, self.problem) if (resumable if sample_seeds is None else sample_seeds) else "off"
        if why_not is None:
            assert isinstance(data, DataLoader)  # for the type checker: only a DataLoader is seedable
            self.samples = SeededSamples(data.dataset, 0)
            self._repeats = getattr(sampler_of(data), "replacement", False) is True
            options = loader_options(data, data.generator)
            options["persistent_workers"] = data.persistent_workers  # built once: its workers may live on
            if type(data) is not DataLoader:  # a StatefulDataLoader keeps its snapshots
                options["snapshot_every_n_steps"] = data.snapshot_every_n_steps  # type: ignore[attr-defined]
            indices = data.batch_sampler or data.sampler
            self._keyed = keyed_loader(type(data), self.samples, indices, data, options, self._repeats)
            self._reader = self._keyed[0]
            if self.holder is data:  # a StatefulDataLoader: the position is the keyed loader's (its sampler's)
                self.holder = self._reader
        elif sample_seeds:  # asked for: say why it does not apply
            log.warning("fit(sample_seeds=True): train_data's samples are read as they are: %s", why_not)
        if self._managed or self.samples is not None:  # every rank draws; rank 0's seed is everyone's
            self.seed = broadcast_from_main(_draw_seed())
            self._seed_samples()

    def _seed_samples(self) -> None:
        if self.samples is not None:
            self.samples.seed = epoch_seed(self.seed, 0, "samples")  # type: ignore[arg-type]  # drawn with samples

    def _adopt(self, role: str, owner: Any) -> None:
        """Give ``owner`` (the loader, its sampler) a generator for ``role``, or record the user's own."""
        if owner.generator is None:
            owner.generator = generator = torch.Generator()
            self._managed[role] = (owner, generator)
        elif all(owner.generator is not g for g in self._own):
            self._own.append(owner.generator)

    def _inspect(self, data: Iterable) -> str | None:
        if isinstance(data, (list, tuple)):
            return None
        setter = epoch_setter(data)
        if setter is not None:  # its order is a function of its seed and set_epoch, as a DistributedSampler's
            self._epoch_samplers.append(setter)
        if self.holder is not None:  # its state is its position: the loader's own, or its dataset's
            if isinstance(data, DataLoader):  # its workers' seeds, a function of the epoch as for any loader
                self._adopt("workers", self.stream or data)
            self.unplaceable = (
                f"its position is the state of its {type(self.holder).__name__}, for the ranks that saved it"
            )
            return None
        if not isinstance(data, DataLoader):
            return f"it is a {type(data).__name__}, not a list or a DataLoader, so it has no batch positions"
        loader = data
        self._adopt("workers", loader)
        if isinstance(loader.dataset, IterableDataset):
            return self._unsaved or "its dataset is an IterableDataset, which has no indices"
        if type(loader).__iter__ is not DataLoader.__iter__:
            return f"{type(loader).__name__} overrides DataLoader.__iter__"
        if loader.batch_sampler is not None and type(loader.batch_sampler) is not BatchSampler:
            return f"its batch_sampler {type(loader.batch_sampler).__name__} is not torch's BatchSampler"
        sampler = sampler_of(loader)  # a batch_sampler= of the user's holds its own (loader.sampler is then unused)
        self.shuffled = type(sampler) in _SEEDED_SAMPLERS or getattr(sampler, "shuffle", False) is True
        self.unplaceable = _why_unplaceable(loader, sampler)
        if type(sampler) is DistributedSampler:  # its order is a function of its seed and set_epoch
            self._epoch_samplers.append(sampler)
            if getattr(sampler, "fitforge_seeded", False):  # seeded from the fit's seed by data_split
                self._managed["shard"] = (sampler, torch.Generator())
        elif type(sampler) is not SequentialSampler:
            if type(sampler) not in _SEEDED_SAMPLERS:
                return f"its sampler {type(sampler).__name__} draws its order from a source fitforge cannot restore"
            self._adopt("sampler", sampler)
        if self._own and loader.persistent_workers and loader.num_workers > 0:
            return "it has its own generator and persistent workers, whose seeds are drawn only once"
        return None

    @property
    def split(self) -> int:
        """How many ranks share each step's samples: the world size under a ``DistributedSampler``, else 1."""
        sampler = sampler_of(self.data) if isinstance(self.data, DataLoader) else None
        return world_size() if isinstance(sampler, DistributedSampler) else 1

    @property
    def order_seed(self) -> int:
        """The seed of every epoch's order (:mod:`fitforge.inputs.placement`); set only with :attr:`seed`."""
        return epoch_seed(self.seed, 0, "shard")  # type: ignore[arg-type]

    def epoch(self, state: TrainState) -> tuple[Iterable, int]:
        """The data of ``state.epoch`` and the position of its first batch (0 unless resumed)."""
        start, self._resume_position = self._resume_position, 0
        sample, self._resume_sample = self._resume_sample, None
        if self._first is not None:  # a later epoch: the loaded state was read past
            self._loaded = None
        self._first = start
        if not start:
            self.epoch_start_step = state.global_step
        self.offset = (sample, start) if sample is not None else (0, 0)
        if sample is None:
            data = self.batches_of(state.epoch, start)
        elif self.unplaceable is None:
            data = self._placed(state.epoch, sample)
        else:  # the same order in batches of another size, which end at that sample (checked by the resume)
            data = self.batches_of(state.epoch, sample // ((self.batch_size or 1) * self.split))
        return indexed_batches(data), start

    def epoch_digest(self, epoch: int) -> str | None:
        """A digest of the order of ``epoch``'s samples, for the run's manifest (read at its end): of the order
        itself where fitforge draws it (a list, a plain loader sequential or shuffled by its seed), else of
        what draws it (the seed, the user's generators at the epoch's start); None where neither is known (a
        sampler of one's own, data keeping its own position)."""
        digest = hashlib.blake2b(f"{epoch}".encode(), digest_size=8)
        data = self.data
        if isinstance(data, (list, tuple)):
            digest.update(f"list{len(data)}".encode())
        elif self.problem is not None or self.holder is not None:
            return None
        elif self.unplaceable is None and not self._legacy_seeding and isinstance(data, DataLoader):
            size = len(data.dataset)  # type: ignore[arg-type]  # placeable: a map-style dataset
            if self.shuffled:  # the order itself: the seeded RandomSampler's or DistributedSampler's
                generator = torch.Generator().manual_seed(self.order_seed + epoch)
                digest.update(torch.randperm(size, generator=generator).numpy().tobytes())
            else:
                digest.update(f"range{size}".encode())
        else:  # a generator fitforge seeds by the epoch, or the user's own
            digest.update(f"seed{self.seed}".encode())
            for start in self._start:
                digest.update(start.numpy().tobytes())
        return digest.hexdigest()

    def resume_at(self, position: int, epoch_start_step: int, sample: int | None = None) -> None:
        """Make the next epoch continue after ``position`` batches (``sample``: that many samples, placed anew)."""
        self._resume_position, self.epoch_start_step = position, epoch_start_step
        self._resume_sample = sample
        if sample is not None:  # a save before the epoch starts (a signal while restoring) counts from here too
            self.offset = (sample, position)

    def _placed(self, epoch: int, sample: int) -> DataLoader:
        """A loader for this rank's share of ``epoch`` after its first ``sample`` samples."""
        self.batches_of(epoch)  # the generators, as the epoch's start leaves them
        loader: DataLoader = self.data  # type: ignore[assignment]
        batches: BatchSampler = loader.batch_sampler  # type: ignore[assignment]  # torch's: unplaceable otherwise
        order = epoch_permutation(len(loader.dataset), self.shuffled, self.order_seed, epoch)  # type: ignore[arg-type]
        rest = rank_remainder(order, sample, world_size(), rank())
        batched = list(BatchSampler(rest, batches.batch_size, batches.drop_last))
        workers = torch.Generator()
        workers.set_state(loader.generator.get_state())  # given one in _inspect, as in _remainder
        draw_worker_seed(loader)
        return self._loader(batched, loader_options(loader, workers), epoch)

    def batches_of(self, epoch: int, start: int = 0) -> Iterable:
        """The data of ``epoch``, from batch position ``start``."""
        for role, (owner, generator) in self._managed.items():
            if role == "shard":  # one seed for the whole fit: set_epoch varies the order
                owner.seed = self.order_seed
            elif role == "sampler" and type(owner) is RandomSampler and not self._legacy_seeding:
                generator.manual_seed(self.order_seed + epoch)  # the DistributedSampler's order of the epoch
            else:
                generator.manual_seed(epoch_seed(self.seed, epoch, role))  # type: ignore[arg-type]
        for sampler in self._epoch_samplers:
            sampler.set_epoch(epoch)
        self._start = [generator.get_state() for generator in self._own]
        if self._keyed is not None:
            self._keyed[1].epoch = epoch
        if start == 0 or (self.holder is not None and self._loaded is not None):  # a loaded state: at its position
            return self._reader
        if isinstance(self.data, (list, tuple)):
            return self.data[start:]
        if self.problem is None:
            return self._remainder(start, epoch)
        return self._skip(start)

    def _remainder(self, start: int, epoch: int) -> DataLoader:
        """A loader for the epoch's batches from ``start`` on, every generator drawn as the original draws it
        (worker seed, then the sampler's order)."""
        loader: DataLoader = self.data  # type: ignore[assignment]
        assert loader.generator is not None  # given one in _inspect when the user did not
        workers = torch.Generator()
        workers.set_state(loader.generator.get_state())  # its first draw is the worker seed the original drew
        draw_worker_seed(loader)
        indices = loader.sampler if loader.batch_sampler is None else loader.batch_sampler  # single ones, or batches
        drawn = list(iter(indices))
        return self._loader(drawn[start:], loader_options(loader, workers), epoch, drawn[:start])

    def _loader(self, indices: Sequence, options: dict[str, Any], epoch: int, drawn: Sequence = ()) -> DataLoader:
        """A loader of the training data's ``indices`` (batches of them, or single ones as the loader's),
        after the epoch's ``drawn`` ones."""
        if self.samples is not None:
            keyed = keyed_loader(DataLoader, self.samples, indices, self.data, options, self._repeats, drawn)  # type: ignore[arg-type]
            loader, keys = keyed
            keys.epoch = epoch
            return loader
        dataset = self.data.dataset  # type: ignore[attr-defined]  # a DataLoader: only they have indices
        if self.data.batch_sampler is not None:  # type: ignore[attr-defined]
            return DataLoader(dataset, batch_sampler=indices, **options)
        return DataLoader(dataset, batch_size=None, sampler=indices, **options)

    def _skip(self, start: int) -> Iterable:
        """The data's iterator after reading and discarding ``start`` batches, the generators left alone."""
        states = rng_states()
        iterator = iter(shielded(self._reader))
        next(itertools.islice(iterator, start, start), None)  # consumes the first ``start`` batches
        restore_rng_states(states)
        return iterator

    def close(self) -> None:
        """Take back the generators given to the user's loader and sampler, and its own shuffle buffers."""
        for role, (owner, _) in self._managed.items():
            if role != "shard":
                owner.generator = None
        if self._put_back is not None:
            self._put_back()

    @property
    def batch_size(self) -> int | None:
        """The loader's batch size (None for other data, whose batches have no set size)."""
        batches = getattr(self.data, "batch_sampler", None)
        return batches.batch_size if type(batches) is BatchSampler else None

    def state_dict(self, batch_idx: int | None = None) -> dict[str, Any]:
        """The seed, batch size, the user's generators at the epoch's start and now, and the holder's state
        (``batch_idx``: the index of the epoch's last batch read, None when none was read since a resume)."""
        return {
            "seed": self.seed,
            "world": world_size(),
            "split": self.split,
            "batch_size": self.batch_size,
            "shuffled": self.shuffled,
            "start": list(self._start),
            "now": [generator.get_state() for generator in self._own],
            "placeable": self.unplaceable is None and not self._legacy_seeding,
            "legacy_seeding": self._legacy_seeding,
            "offset": list(self.offset),
            **({} if self.holder is None else {"data_state": self._holder_state(batch_idx)}),
        }

    def _holder_state(self, batch_idx: int | None) -> Any:
        """The holder's state: the one loaded while no batch was read after it (a holder may give it only
        once read from, as a ``datasets.IterableDataset`` does), else the holder's own."""
        if self._loaded is not None and (batch_idx is None or self._first is None or batch_idx < self._first):
            return self._loaded
        self._loaded = None
        return self.holder.state_dict()

    def load_state_dict(self, state: dict[str, Any], mid_epoch: bool) -> None:
        """Restore :meth:`state_dict`: the generators as at the epoch's start (``mid_epoch``), else as saved."""
        if state.get("seed") is not None and (self._managed or self.samples is not None):
            self.seed = int(state["seed"])
            self._seed_samples()
        # Written before one order for every world size: one process drew its own shuffled order.
        self._legacy_seeding = bool(state) and state.get(
            "legacy_seeding", "placeable" not in state and state.get("world", 1) == 1
        )
        saved: Sequence[torch.Tensor] = state.get("start" if mid_epoch else "now", [])
        if len(saved) == len(self._own):
            for generator, generator_state in zip(self._own, saved):
                generator.set_state(generator_state)
        # At an epoch's end a dataset starts its next pass afresh (loaded, a finished pass's state would
        # leave it nothing to read); a StatefulDataLoader's state knows its pass ended, and holds its order's.
        if self.holder is None or not (mid_epoch or isinstance(self.holder, DataLoader)):
            return
        if "data_state" in state:
            self.holder.load_state_dict(state["data_state"])
            self._loaded = state["data_state"]
        elif mid_epoch:  # written by an older fitforge, or for other data: its batches are read and discarded
            self.problem = f"the checkpoint holds no state of its {type(self.holder).__name__}"
            log.warning(
                "CheckpointHandler: %s, so the batches before its position are read and discarded (exact only if "
                "train_data yields the same batches in the same order on every pass)",
                self.problem,
            )


def _why_unplaceable(loader: DataLoader, sampler: Any) -> str | None:
    """Why ``loader``'s order is not one for every number of ranks; None for a plain loader or fitforge's split."""
    if type(loader.batch_sampler) is not BatchSampler:
        return "it has no batch size (batch_size=None)"
    if type(sampler) is SequentialSampler:
        return None
    if type(sampler) is DistributedSampler:
        if getattr(sampler, "fitforge_seeded", False):
            return None
        return "its DistributedSampler is your own, split for a set number of ranks"
    if type(sampler) is RandomSampler:
        if sampler.replacement or sampler.num_samples != len(sampler.data_source):
            return "its RandomSampler draws with replacement or another number of samples than the dataset's"
        if sampler.generator is not None:
            return "its RandomSampler draws from a generator of yours, which the ranks' split does not use"
        return None
    return f"its sampler {type(sampler).__name__} is your own"


class OnePass:
    """A single pass over ``data``, from its first batch."""

    def __init__(self, data: Iterable) -> None:
        self.data = data

    def epoch(self, state: TrainState) -> tuple[Iterable, int]:
        return indexed_batches(self.data), 0

    def close(self) -> None:
        pass
