"""Sharded, resumable checkpoints on torch.distributed.checkpoint (DCP): each rank writes its own part.

A checkpoint is a directory ``checkpoints/step_XXXXXXXX/``:

- DCP's files: ``.metadata`` and one ``__<rank>_0.distcp`` per writing rank. Tensors are keyed by
  the names of the *unsplit* model (``model/<fqn>``, ``optimizer/<fqn>/<state>``), so a checkpoint
  written by 4 fsdp ranks loads on 2, into a pipeline stage, or into one process; a tensor every rank
  holds (a ddp replica) is written once.
- ``rank_<r>.json``: what is not a tensor, per rank (LR schedule, loss scaler, optimizer
  hyperparameters, random number generators).
- ``trainer.json``: the trainer's own state (step, data positions, world size), from rank 0.

Everything is written into ``step_XXXXXXXX.partial/`` and renamed by rank 0 once DCP has written its
metadata (which it does only after every rank's data is on disk), so a crash mid-write never leaves
something that passes for a checkpoint. Resuming takes the newest complete checkpoint whose files are
whole (each file at least as long as DCP's metadata says); a damaged one is skipped with a warning.

No pickle code runs on load: DCP's tensor data is read with ``torch.load(weights_only=True)``, only
tensors go through DCP, and its ``.metadata`` (a pickle) is read by an unpickler that knows only DCP's
metadata classes and refuses anything else.

Asynchronous saving (the default) is ``dcp.async_save``: the state is copied to CPU memory on the
training thread (the only stall) and written on a background thread, whose collectives run on a gloo
group of their own so they never interleave with training's. At most one save is in flight.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import sys
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from mlscale.common.io import _fsync_dir, atomic_write

# DCP warns that it "assumes a single process" whenever no process group is used, as we mean it to.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")

PARTIAL = ".partial"
REPLACED = ".replaced"  # a step's earlier checkpoint, moved aside while the same step is saved again
OPTIMIZER_PREFIX = "optimizer/"
TRAINER_FILE = "trainer.json"
WriteHook = Callable[[int, Path], None]


@dataclass
class TrainState:
    """One rank's part of the training state: tensors (DCP) and JSON-able values (``rank_<r>.json``)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank_{rank:05d}.json"


# -- reading DCP's metadata without running pickle code ---------------------------------------------
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")  # not BytesStorageMetadata: DCP would unpickle those
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) not in _METADATA_CLASSES and not dtype:
            raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is not DCP metadata")
        return super().find_class(module, name)


def read_metadata(directory: Path) -> Metadata:
    with (directory / ".metadata").open("rb") as handle:
        metadata = _MetadataUnpickler(handle).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError("checkpoint metadata is not DCP metadata")
    others = [key for key, entry in metadata.state_dict_metadata.items()
              if not isinstance(entry, TensorStorageMetadata)]
    if others:  # mlscale writes tensors only; anything else would be read with pickle
        raise pickle.UnpicklingError(f"checkpoint metadata declares non-tensor entries ({others[0]!r})")
    return metadata


class _SafeReader(FileSystemReader):
    """DCP's file reader, reading ``.metadata`` with the restricted unpickler above."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_metadata(Path(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def check_complete(directory: Path) -> dict[str, Any]:
    """The trainer state of a checkpoint whose files are all there and whole; raises otherwise."""
    metadata = read_metadata(directory)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        path = str(info.relative_path)
        needed[path] = max(needed.get(path, 0), info.offset + info.length)
    for name, size in needed.items():
        have = (directory / name).stat().st_size
        if have < size:
            raise ValueError(f"{name} holds {have} bytes, its metadata says at least {size}")
    return json.loads((directory / TRAINER_FILE).read_text())


class Checkpointer:
    """Saves and finds checkpoints of one run. ``group``: the ranks that write together (``None``:
    the default group when one exists); ``collective=False``: this process reads and writes alone."""

    def __init__(self, directory: str | Path, keep: int = 3, async_save: bool = False,
                 write_hook: WriteHook | None = None, *, rank: int | None = 0, group: Any = None,
                 collective: bool = False, clean_leftovers: bool = True) -> None:
        self.directory = Path(directory)
        self.keep, self.async_save, self.write_hook = keep, async_save, write_hook
        self.rank, self.group, self.collective = rank, group, collective
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._cleaned = not clean_leftovers
        self.write_ms: list[float] = []  # how long each checkpoint took to reach the disk, from the save call

    @property
    def coordinator(self) -> bool:
        return self.rank == 0  # rank: this process's rank among the writers; None for a reader only

    def _group(self) -> Any:
        return self.group if self.collective else None  # a reader outside the group reads on its own

    def path_for(self, step: int) -> Path:
        """The step's checkpoint: its folder, or the copy a re-save interrupted between its two renames
        left aside (the only complete copy of that step then)."""
        final = self.directory / step_name(step)
        aside = final.with_name(final.name + REPLACED)
        return aside if not final.exists() and aside.is_dir() else final

    # -- saving ------------------------------------------------------------------------------------
    def _clean_partials(self) -> None:
        """Once, before the first save: rank 0 removes what a crashed save left, then all go on together
        (so nobody writes into a folder that is about to be removed)."""
        if self._cleaned:
            return
        if self.coordinator and self.directory.is_dir():
            for aside in self.directory.glob(f"step_*{REPLACED}"):
                final = aside.with_name(aside.name.removesuffix(REPLACED))
                if final.exists():
                    shutil.rmtree(aside, ignore_errors=True)
                else:  # a re-save died between its renames: the earlier copy is the step's checkpoint again
                    aside.rename(final)
            for leftover in self.directory.glob(f"step_*{PARTIAL}"):
                shutil.rmtree(leftover, ignore_errors=True)
            _fsync_dir(self.directory)
        if self.collective:
            dist.barrier(group=self.group)
        self._cleaned = True

    def save(self, step: int, state: TrainState, trainer: dict[str, Any] | None = None) -> None:
        """Save this rank's ``state`` as part of the checkpoint of ``step`` (rank 0 also gives the
        ``trainer`` state); returns once training may go on."""
        self.wait()
        self._clean_partials()
        start = time.perf_counter()
        partial = self.directory / (step_name(step) + PARTIAL)
        partial.mkdir(parents=True, exist_ok=True)
        assert self.rank is not None, "a reader-only checkpointer does not save"
        _write_json(partial / rank_file(self.rank), state.meta)
        if self.coordinator:
            _write_json(partial / TRAINER_FILE, trainer or {})
        writer = FileSystemWriter(partial)
        options = {"storage_writer": writer, "process_group": self._group(), "no_dist": not self.collective}
        if not self.async_save:
            dcp.save(state.tensors, **options)
            self._finish(step, partial, start)
            return
        future = dcp.async_save(state.tensors, **options)  # copies to CPU memory, then writes in the background
        self._thread = threading.Thread(target=self._finish_in_background, args=(future, step, partial, start),
                                        name=f"checkpoint-{step}", daemon=True)
        self._thread.start()

    def _finish_in_background(self, future: Any, step: int, partial: Path, start: float) -> None:
        try:
            future.result()
            self._finish(step, partial, start)
        except BaseException as exc:  # handed to the training thread by wait()
            self._error = exc

    def _finish(self, step: int, partial: Path, start: float) -> None:
        """Every rank's data and DCP's metadata are on disk: rank 0 makes the checkpoint visible."""
        if self.coordinator:
            if self.write_hook is not None:
                self.write_hook(step, partial / "__0_0.distcp")
            final = self.directory / step_name(step)
            old = final.with_name(final.name + REPLACED)
            if final.exists():  # an earlier checkpoint of the same step (a resumed, finished run): moved
                shutil.rmtree(old, ignore_errors=True)  # aside first, so one complete copy always exists
                final.rename(old)
            partial.rename(final)
            shutil.rmtree(old, ignore_errors=True)
            _fsync_dir(self.directory)
            self._prune()
        self.write_ms.append((time.perf_counter() - start) * 1e3)

    def wait(self) -> None:
        """Block until the save in flight is on disk; re-raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def finish_in_flight(self, timeout_s: float) -> None:
        """On the way out after a failure: give the save in flight up to ``timeout_s`` to reach the disk
        (its peers may be alive and writing their parts), ignoring its error."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)

    # -- finding and loading -----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a checkpoint directory that was renamed into place (complete when written)."""
        if not self.directory.is_dir():
            return []
        found = set()
        for path in self.directory.iterdir():
            name = path.name.removesuffix(REPLACED)  # a copy left aside counts (see path_for)
            if path.is_dir() and name.startswith("step_") and name[5:].isdigit():
                found.add(int(name[5:]))
        return sorted(found)

    def legacy_files(self) -> list[Path]:
        """Single-file checkpoints of mlscale before sharded checkpoints; they cannot be resumed."""
        return sorted(self.directory.glob("step_*.pt")) if self.directory.is_dir() else []

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def latest_complete(self) -> tuple[int, dict[str, Any]] | None:
        """The newest checkpoint whose files are whole, with its trainer state; ``None`` when none is.
        Every rank reads the same files, so every rank picks the same checkpoint."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                return step, check_complete(path)
            except Exception as exc:  # a damaged checkpoint: say so and fall back to the one before
                if self.coordinator:
                    print(f"mlscale: skipping damaged checkpoint {path}: {type(exc).__name__}: {exc}",
                          file=sys.stderr)
        return None

    def trainer_state(self, step: int) -> dict[str, Any]:
        return json.loads((self.path_for(step) / TRAINER_FILE).read_text())

    def load(self, step: int, template: TrainState) -> TrainState:
        """Fill ``template.tensors`` (this rank's tensors, in the layout it trains with) from the
        checkpoint of ``step``, resharding as needed; the JSON part is this rank's, or rank 0's when
        the checkpoint had no such rank."""
        path = self.path_for(step)
        saved = read_metadata(path).state_dict_metadata
        # Optimizer state exists only for parameters that were stepped (fp16 skips steps, a parameter may
        # never get a gradient): what the checkpoint lacks stays fresh. Everything else must be there.
        tensors = {key: value for key, value in template.tensors.items()
                   if key in saved or not key.startswith(OPTIMIZER_PREFIX)}
        dcp.load(tensors, storage_reader=_SafeReader(path), process_group=self._group(), no_dist=not self.collective)
        own = path / rank_file(self.rank) if self.rank is not None else None
        mine = own is not None and own.exists()
        meta = json.loads((own if mine else path / rank_file(0)).read_text())
        return TrainState(tensors, {**meta, "own": mine})


def _write_json(path: Path, value: Any) -> None:
    text = json.dumps(value, allow_nan=True)
    atomic_write(path, lambda tmp: tmp.write_text(text))


# -- random number generators as JSON ---------------------------------------------------------------
def capture_rng() -> dict[str, Any]:
    """Every random number generator a training step may draw from, as JSON-able values."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "gauss": float(cached)},
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state((numpy_state["kind"], np.array(numpy_state["keys"], dtype=np.uint32), numpy_state["pos"],
                         numpy_state["has_gauss"], numpy_state["gauss"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])
