"""`data.features: engine` (DESIGN §2.3): the states of the batches a rank is about to train,
computed by a running vLLM engine (the capture's engine and connector,
data/capture_engine.py) a few batches ahead; nothing is kept on disk.

`EngineBatches` wraps a rank's `BatchStream`. It keeps at most `prefetch` micro-batches in
flight: each is collated as usual, every sample sent to the engine as one request whose
handover key names the run, split, epoch, batch and row (so each rank asks only for its own
batches, and a resumed run for the same ones), and its states read back by one worker
thread. A batch is handed to training once its states are there, and their handover files
are deleted then. `position` is the stream's position after the last batch *handed out*,
not after the ones asked for ahead, so a checkpoint resumes at the batch that was next to
train; states a killed run left in the handover directory are used when intact and of the
same tokens (`EngineStates`), the rest are asked for again. The engine computes a token's
states from the tokens before it alone, so the same batch gets the same states.
"""

from __future__ import annotations

import logging
import re
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch

from eyas.train.batching import BatchStream, DataPosition

log = logging.getLogger(__name__)


class EngineFeedError(RuntimeError):
    """data.features=engine cannot run as configured (the message says why and what to set)."""


def key_tag(name: str) -> str:
    """A run's name as a handover key prefix (keys are file stems: A-Z a-z 0-9 _ . -)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")[:80] or "run"


def split_states(states: torch.Tensor, n_aux: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, (n+1)·H] (the aux layers, then the last state) -> aux [T, n·H], last [T, H]."""
    h = states.shape[-1] // (n_aux + 1)
    return states[:, : n_aux * h], states[:, n_aux * h :]


class EngineBatches:
    """A `BatchStream` whose batches carry `aux` / `last` from the engine (module docstring).
    `stop_after`: how many more batches will be read (None: no end), so none is asked for
    that nobody trains."""

    def __init__(self, stream: BatchStream, engine, n_aux: int, prefetch: int, tag: str):
        self.stream, self.engine, self.n_aux = stream, engine, n_aux
        self.prefetch, self.tag = max(1, prefetch), tag
        self.stop_after: int | None = None
        self.last_index = stream.last_index
        self._position = stream.position
        self._ahead: deque = deque()  # (position after, last_index, batch, keys, future)
        self._asked = 0  # batches asked for since stop_after was set
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eyas-engine-feed")

    # --- what the loop reads of a BatchStream ------------------------------------------

    @property
    def position(self) -> DataPosition:
        return self._position

    @position.setter
    def position(self, position: DataPosition) -> None:
        self._drop()
        self.stream.position = self._position = position

    @property
    def multiple_of(self) -> int:
        return self.stream.multiple_of

    @multiple_of.setter
    def multiple_of(self, value: int) -> None:
        self.stream.multiple_of = value

    def batches_per_epoch(self) -> int:
        return self.stream.batches_per_epoch()

    def tokens_per_epoch(self) -> int:
        return self.stream.tokens_per_epoch()

    def limit(self, batches: int | None) -> None:
        """Read at most `batches` more batches from now on."""
        self.stop_after, self._asked = batches, len(self._ahead)

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if not self._ahead:
            self._ask()
        position, last_index, batch, keys, future = self._ahead.popleft()
        while len(self._ahead) < self.prefetch and self._may_ask():
            self._ask()
        states = future.result()  # the engine's error (naming its URL or the file) surfaces here
        self.engine.done(list(keys))
        rows = [split_states(states[k], self.n_aux) for k in keys]
        b, t = batch["input_ids"].shape
        ref = rows[0][0]
        batch["aux"] = ref.new_zeros(b, t, rows[0][0].shape[-1])
        batch["last"] = ref.new_zeros(b, t, rows[0][1].shape[-1])
        for r, (aux, last) in enumerate(rows):
            batch["aux"][r, : aux.shape[0]] = aux
            batch["last"][r, : last.shape[0]] = last
        self._position, self.last_index = position, last_index
        return batch

    def close(self) -> None:
        """Wait for the batches asked for ahead, delete their handover files, stop the worker."""
        self._drop()
        self._pool.shutdown(wait=True)

    # --- the queue ------------------------------------------------------------------

    def _may_ask(self) -> bool:
        return self.stop_after is None or self._asked < self.stop_after

    def _ask(self) -> None:
        batch = next(self.stream)
        epoch, index = self.stream.last_index
        lengths = batch["attention_mask"].sum(1).tolist()
        keys = {
            f"{self.tag}-e{epoch}-b{index}-r{r}": batch["input_ids"][r, :n].tolist()
            for r, n in enumerate(lengths)
        }
        future = self._pool.submit(self.engine.states, keys)
        self._ahead.append((self.stream.position, self.stream.last_index, batch, keys, future))
        self._asked += 1

    def _drop(self) -> None:
        """Forget the batches asked for ahead (a resume moves the position; the run ends)."""
        while self._ahead:
            *_, keys, future = self._ahead.popleft()
            if future.cancel():
                continue  # never sent: the engine wrote nothing for it
            try:
                future.result()
            except Exception as err:  # the run is stopping or moving; nothing reads these
                log.debug("a batch asked for ahead failed: %s", err)
            self.engine.done(list(keys))
        self.stream.position = self._position


@contextmanager
def training_engine(recipe, aux_layer_ids, num_layers: int, world: int, say=log.info):
    """The engine that feeds a `data.features: engine` run, as `data.capture` describes it:
    started for this run (launch line or vLLM-CPU) and stopped after, or running at
    server_url. One started engine serves one process: under several, each would start its
    own, so a multi-process run needs one running engine every rank asks (server_url)."""
    from eyas.data.capture_engine import capture_engine

    c = recipe.data.capture
    if world > 1 and (c.launch or not c.server_url):
        raise EngineFeedError(
            f"data.features=engine on {world} processes needs data.capture.server_url without "
            "data.capture.launch: eyas starts an engine only for a one-process run (each rank would "
            "start its own). Start one engine with the flags `eyas capture` prints, reachable from "
            "every rank, with its eyas_dir (data.capture.handover_dir) on a filesystem every rank reads"
        )
    with capture_engine(recipe, aux_layer_ids, num_layers, say=say) as engine:
        yield engine
