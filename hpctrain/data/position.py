"""Where a run is in its data: the epoch, the steps of it done on this data-parallel world size, and the steps
of it done before on other world sizes (an elastic resume). One implementation for `hpctrain train`
(`trainer`, `resume`) and the library's `ShardLoader` and `Checkpointer` (`api`): both write it into a
checkpoint's meta.json (`meta`), read it back from there (`from_meta`) and walk their epochs from it through a
`Cursor`, which reads the rest of an epoch that other world sizes began.

A position counts the batches handed out: after the last batch of an epoch it is the next epoch's start, so a
checkpoint written at any step boundary resumes at the batch after it, never replaying one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

from .reader import ShardReader, epoch_remainder


@dataclass(slots=True)
class Position:
    """A step boundary of the run's data order."""

    epoch: int = 0
    in_epoch: int = 0  # steps of `epoch` done in this segment (these data-parallel ranks, this batch size)
    # (data-parallel ranks, steps, batch size per rank) of the epoch's earlier segments (older checkpoints: no batch)
    prior: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], ranks: int, batch: int) -> "Position":
        """The position a checkpoint's meta.json records, as a run on `ranks` data-parallel ranks of `batch`
        samples each continues it: with both the same, inside the segment it was in; else in a new segment of
        the same epoch (the samples of the earlier ones are those their ranks and batches dealt out)."""
        segments = [tuple(int(v) for v in seg) for seg in meta.get("segments", [])]
        if not segments and meta.get("step_in_epoch"):  # written before segments were recorded
            segments = [(int(meta["world_size"]), int(meta["step_in_epoch"]))]
        if segments and segments[-1][0] == ranks and segments[-1][2:] in ((), (batch,)):
            return cls(int(meta["epoch"]), segments[-1][1], segments[:-1])
        return cls(int(meta["epoch"]), 0, segments)

    def meta(self, ranks: int, batch: int) -> dict[str, Any]:
        """What a checkpoint's meta.json records of this position, reached on `ranks` data-parallel ranks of
        `batch` samples each."""
        segments = [*self.prior, (ranks, self.in_epoch, batch)] if self.in_epoch else list(self.prior)
        return {"epoch": self.epoch, "step_in_epoch": self.in_epoch, "segments": segments}

    def epochs_begun(self) -> int:
        """The epochs the run has trained on, the one in progress counted: its total in summary.json."""
        return self.epoch + (1 if self.in_epoch or self.prior else 0)


class Cursor:
    """A run's position in its data, and the readers that deal its batches out from there: `whole` for whole
    epochs, and the rest of an epoch that other world sizes began. `hpctrain train`'s loop and the library's
    `ShardLoader` both walk their epochs through one, so both resume the same way.

    The position counts the batches handed out: once a batch is handed out, a checkpoint resumes after it."""

    def __init__(self, whole: ShardReader, position: Position | None = None, *, drop_empty: bool = False):
        self.whole = whole
        self.drop_empty = drop_empty  # an epoch ends at the first step where some rank would have no sample
        self.epoch, self.step = 0, 0  # the step: batches of the epoch handed out (of its rest, after others)
        self.prior: list[tuple[int, ...]] = []  # (ranks, steps, batch) of the epoch's earlier segments
        self.rest: ShardReader | None = None  # the reader of what other world sizes left of `epoch`
        self.current: tuple[ShardReader, int] | None = None  # the reader and step of the batch handed out last
        self.move_to(position or Position())

    @property
    def reader(self) -> ShardReader:
        """The reader of the current epoch."""
        return self.rest if self.rest is not None else self.whole

    def steps_of(self, reader: ShardReader) -> int:
        """The steps of an epoch `reader` deals out (with drop_empty: while every rank has a sample)."""
        return -(-int(min(reader.counts)) // reader.batch_size) if self.drop_empty else reader.steps_per_epoch

    @property
    def steps(self) -> int:
        """The steps of the current epoch (of its rest, in an epoch other world sizes began)."""
        return self.steps_of(self.reader)

    @property
    def position(self) -> Position:
        """Where the data stands after the batches handed out (after an epoch's last: the next epoch's start)."""
        if self.step >= self.steps:
            return Position(self.epoch + 1)
        return Position(self.epoch, self.step, list(self.prior))

    def meta(self, ranks: int) -> dict[str, Any]:
        """What a checkpoint's meta.json records of the data: the position, reached on `ranks` data-parallel
        ranks, and the global batch (what a resume compares)."""
        return {**self.position.meta(ranks, self.whole.batch_size), "global_batch": self.whole.batch_size * ranks}

    def move_to(self, position: Position) -> None:
        """Continue from `position`, written on any world size: in its epoch, the samples the ranks before
        did not train on."""
        if self.rest is not None:
            self.rest.close()
        self.epoch, self.step, self.prior = position.epoch, position.in_epoch, list(position.prior)
        self.rest = remainder_reader(position, self.whole)

    def steps_to(self, epochs: int) -> int:
        """The steps from here to the end of epoch `epochs` (0 when it is behind)."""
        if self.epoch >= epochs:
            return 0
        return self.steps - self.step + (epochs - self.epoch - 1) * self.steps_of(self.whole)

    def batches(self) -> Iterator[Any]:
        """The current epoch's batches from the position on, each counted as it is handed out; the next epoch
        starts after the last (not when the caller stops early)."""
        reader, steps = self.reader, self.steps
        batches = reader.epoch(self.epoch, self.step)
        try:  # zip asks range first: no batch is read past the last step (drop_empty ends the epoch early)
            for _, batch in zip(range(self.step, steps), batches):
                self.current = (reader, self.step)
                self.step += 1
                yield batch
        finally:
            batches.close()
        self.move_to(Position(self.epoch + 1))

    def close(self) -> None:
        if self.rest is not None:
            self.rest.close()
        self.whole.close()


def remainder_reader(position: Position, whole: ShardReader) -> ShardReader | None:
    """The reader of what is left of `position.epoch` after its earlier segments on other world sizes (the
    samples they trained on excluded, the rest dealt out again over `whole`'s ranks, in its order); None when
    there are none."""
    if not position.prior:
        return None
    opts = {"batch_size": whole.batch_size, "shuffle": whole.shuffle, "seed": whole.seed}
    done = epoch_remainder(whole.shardset, whole.split, position.prior, epoch=position.epoch, **opts)
    return ShardReader(whole.shardset, whole.split, rank=whole.rank, world=whole.world, exclude=done,
                       segment=len(position.prior), **opts)
