"""Runs as the UI shows them: found under a folder, summarised for the table, their records read once
and then only as they grow, and down-sampled on this side so that a long run on many ranks reaches the
page as a few hundred points a chart (full resolution where the page zooms in).

Everything here reads the run directory through ``RunDir``'s names and ``RunsFolder`` (``files.py``): the
files a run writes are the UI's only source, so what the page shows is what ``metrics.jsonl`` and the logs
say. They are untrusted too (a shared folder): every value is checked for its type and range as it is read,
a line or entry that fails is dropped and counted, what one run may hold in memory is bounded, and a run
whose files cannot be read is shown as unreadable with the reason, never as an error of the whole UI.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import operator
import os
import re
import threading
import time
import warnings
from array import array
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from mlscale.rundir import RunDir
from mlscale.ui.files import LISTED, RunsFolder, Unreadable

# The split of a step the page stacks, in the order it stacks them (StepTimes' names in metrics.jsonl).
SPLIT_KEYS = ("compute_ms", "comm_exposed_ms", "data_wait_ms", "optimizer_ms")
RANK_KEYS = ("step_ms", *SPLIT_KEYS, "comm_ms", "straggler_score")
RUNNING_WITHIN_S = 60.0  # a run without a report whose heartbeats or records moved this recently is running
MAX_DEPTH = 3  # how deep under --runs run directories are looked for
ERROR_CHARS = 160  # a worker's error as the events table shows it (the whole of it in the event's data)
TAIL_BYTES = 1 << 20  # the runs table reads a run's newest metrics line from this much of its end
KEEP_RUNS = 16  # runs whose records are kept in memory (the most recently asked for)
WARM_RUNS = 8  # runs whose records the UI reads when it starts, the most recently started first
HEAT_CELLS = 12_000  # the straggler heat map's budget: drawn in well under a second, finer than its pixels
# What one run may hold (a shared folder is untrusted: a planted metrics.jsonl must not exhaust the UI)
MAX_LINE_BYTES = 1 << 20  # a metrics line longer than this is skipped (a real one is a few kB a rank)
READ_BYTES = 256 << 20  # read from metrics.jsonl in one refresh; the rest in the next
CHUNK_BYTES = 8 << 20  # read and parsed at a time
MAX_LINES = 2_000_000  # metrics lines kept for a run; later ones are counted, not kept
MAX_RANKS = 1024  # distinct ranks kept for a run; entries of further ranks are dropped and counted
MAX_RANK_NUMBER = 1 << 20
MAX_CELLS = 8_000_000  # lines x ranks of per-rank values (a float64 matrix per key while one is drawn)
CACHE_CELLS = 2_000_000  # a run within this many keeps its matrices laid out between requests
KEEP_BYTES = 1 << 30  # the records of the runs kept in memory: the least recently asked for forgotten first
COLUMNS = ("steps", "loss", "lr", "samples_per_s")
MAX_EXTRAS = 64  # eval entries, stragglers or spans one line may carry
SHORT = 200  # characters of a text field (task, strategy, status) shown
LIVE_ROWS = 500  # rows sent in one live-stream message
ERROR_KEPT = 4000  # characters of a worker's error kept for the events table's detail
FAULT_KINDS = ("kill", "hang", "fault")
REPLICA_LOG = re.compile(r"replica([0-9]{1,6})(?:-rank([0-9]{1,6}))?\.jsonl")
BAD_SAMPLES_LOG = re.compile(r"rank([0-9]{1,6})\.jsonl")  # --bad-samples skip's files (RunDir.bad_samples_path)
BAD_SAMPLES_SHOWN = 100  # samples left out that the events table lists
RANK_CHOICE = re.compile(r"[0-9]{1,7}")
log = logging.getLogger("mlscale.ui")


def find_runs(root: Path) -> dict[str, Path]:
    """Every run directory (one holding ``config.json``) at or under ``root``, by its path relative to
    ``root`` (``.`` for ``root`` itself); hidden folders and a run's own sub-folders are not searched, nor
    a folder whose real path (symlinks resolved) lies outside ``root``."""
    found: dict[str, Path] = {}
    folder = RunsFolder(root)

    def walk(here: Path, depth: int) -> None:
        if RunDir(here).config_path.is_file():
            found[here.relative_to(root).as_posix()] = here
            return
        if depth >= MAX_DEPTH:
            return
        children = sorted(Path(e.path) for e in folder.listing(here, LISTED * 10)
                          if not e.name.startswith(".") and _is_dir(e))
        for child in children:
            if folder.inside(child):
                walk(child, depth + 1)

    if root.is_dir():
        walk(root, 0)
    return found


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir()
    except OSError:
        return False


def _finite(value: Any) -> float | None:
    """A finite number as a float (an integer too large for one, a bool, anything else: None)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _whole(value: Any, low: int = -(1 << 53), high: int = 1 << 53) -> int | None:
    """An integer in [low, high) (a float with no fraction counts), else None."""
    number = _finite(value)
    if number is None or not number.is_integer() or not low <= number < high:
        return None
    return int(number)


def _text(value: Any) -> str | None:
    """A text field as the page shows it: a string (cut to ``SHORT``), or None."""
    if isinstance(value, str):
        return value if len(value) <= SHORT else value[:SHORT - 1] + "…"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    return None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


_RANK_VALUES = operator.itemgetter("rank", *RANK_KEYS)
_WIDTH = 1 + len(RANK_KEYS)


def _rank_values(entry: dict[str, Any]) -> list[float]:
    """(rank, *RANK_KEYS) of one per_rank entry; a key an older record lacks reads as its neutral value,
    a value that is not a finite number as NaN."""
    values = [entry.get("rank", 0), *(entry.get(k, 1.0 if k == "straggler_score" else 0.0) for k in RANK_KEYS)]
    return [math.nan if (number := _finite(v)) is None else number for v in values]


def _extras(record: dict[str, Any], series: Series) -> dict[str, Any]:
    """A line's evaluations, flagged stragglers and steps without every replica, each checked (what is
    not the expected shape is dropped and counted), so the page draws them without a second look."""
    out: dict[str, Any] = {}
    evals = [e for e in _items(record.get("eval")) if isinstance(e, dict) and _whole(e.get("step")) is not None]
    evals = [{"step": _whole(e["step"]), **{str(k)[:SHORT]: v for k, v in e.items()
                                             if k != "step" and _finite(v) is not None}} for e in evals]
    stragglers = [r for r in map(lambda r: _whole(r, 0, MAX_RANK_NUMBER), _items(record.get("stragglers")))
                  if r is not None]
    spans = [span for span in map(_span, _items(record.get("degraded_steps"))) if span is not None]
    for key, value, given in (("eval", evals, record.get("eval")), ("stragglers", stragglers, record.get("stragglers")),
                              ("degraded_steps", spans, record.get("degraded_steps"))):
        if value:
            out[key] = value
        if given and len(value) != (len(given) if isinstance(given, list) else -1):
            series.drop(f"{key} entries that are not the expected shape")
    return out


def _items(value: Any) -> list[Any]:
    return value[:MAX_EXTRAS] if isinstance(value, list) else []


def _span(value: Any) -> dict[str, Any] | None:
    """A ``degraded_steps`` span: {"steps": [first, last], "participants": [replica groups]}."""
    if not isinstance(value, dict) or not isinstance(value.get("steps"), list) or len(value["steps"]) != 2:
        return None
    first, last = (_whole(s) for s in value["steps"])
    members = [_whole(m, 0, MAX_RANK_NUMBER) for m in _items(value.get("participants"))]
    if first is None or last is None or None in members:
        return None
    return {"steps": [first, last], "participants": members}


@dataclass
class Series:
    """A run's metrics.jsonl as columns, one row per line; the per-rank values kept flat as they come
    (line, rank, *RANK_KEYS) and laid out as a lines x ranks matrix per key when asked.

    A resumed run appends the steps after its checkpoint again: the later line of a step supersedes the
    earlier one. ``kept`` are the lines that stand (steps strictly increasing), what the charts draw.

    Bounded whatever the file holds: at most ``MAX_LINES`` lines, ``MAX_RANKS`` ranks and ``MAX_CELLS``
    lines x ranks; what does not fit or is not a valid value is dropped and counted in ``dropped``."""

    steps: array = field(default_factory=lambda: array("q"))
    loss: array = field(default_factory=lambda: array("d"))
    lr: array = field(default_factory=lambda: array("d"))
    samples_per_s: array = field(default_factory=lambda: array("d"))
    ranks: list[int] = field(default_factory=list)  # every rank seen, sorted
    flat: array = field(default_factory=lambda: array("d"))  # (rank, *RANK_KEYS) per per_rank entry, in line order
    line_start: array = field(default_factory=lambda: array("q"))  # the entry each line's entries begin at
    extras: dict[int, dict[str, Any]] = field(default_factory=dict)  # line -> eval, stragglers, degraded steps
    kept: list[int] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # what was not kept, by reason
    _matrices: dict[str, np.ndarray] = field(default_factory=dict)
    _rank_set: set[int] = field(default_factory=set)

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count

    @property
    def cells(self) -> int:
        """Lines x ranks: what laying out the per-rank matrices costs (the memory bound's unit)."""
        return len(self.steps) * max(1, len(self.ranks))

    def add(self, record: dict[str, Any]) -> None:
        step = _whole(record.get("step", 0))
        if step is None:
            return self.drop("lines without a whole step number")
        if len(self.steps) >= MAX_LINES or (len(self.steps) + 1) * max(1, len(self.ranks)) > MAX_CELLS:
            return self.drop("lines past what the UI keeps of a run")
        line = len(self.steps)
        loss = _finite(record.get("loss"))
        self.steps.append(step)
        self.loss.append(math.nan if loss is None else loss)
        self.lr.append(_finite(record.get("lr")) or 0.0)
        self.samples_per_s.append(_finite(record.get("samples_per_s")) or 0.0)
        self.line_start.append(len(self.flat) // _WIDTH)
        self._add_entries(record.get("per_rank"))
        self._matrices.clear()
        extra = _extras(record, self)
        if extra:
            self.extras[line] = extra
        while self.kept and self.steps[self.kept[-1]] >= step:
            self.kept.pop()
        self.kept.append(line)

    def _add_entries(self, entries: Any) -> None:
        """A line's per-rank entries: the fast way (C loops) when every entry is whole, entry by entry
        (each checked) otherwise."""
        if not entries:
            return
        if not isinstance(entries, list):
            return self.drop("per-rank lists that are not lists")
        if len(entries) > MAX_RANKS:
            self.drop("per-rank entries past the rank bound", len(entries) - MAX_RANKS)
            entries = entries[:MAX_RANKS]
        start = self.line_start[-1] * _WIDTH
        try:
            self.flat.fromlist(list(chain.from_iterable(map(_RANK_VALUES, entries))))
        except (KeyError, TypeError, OverflowError):  # a key missing (an older record), not a number
            del self.flat[start:]
            for entry in entries:
                if isinstance(entry, dict):
                    self.flat.fromlist(_rank_values(entry))
                else:
                    self.drop("per-rank entries that are not objects")
        # the rank numbers this line brought, from its rank column (a set built in C: no loop over entries)
        seen = set(self.flat[start::_WIDTH])
        if not seen <= self._rank_set:
            self._admit(seen - self._rank_set, start)

    def _admit(self, new: set[float], start: int) -> None:
        """Ranks first seen on this line: kept while whole, in range and within the bounds; the line's
        entries of any other are removed (a NaN rank, one that is no number, is never a row)."""
        admitted = set()
        for rank in sorted(new, key=lambda r: (math.isnan(r), r)):
            whole = _whole(rank, 0, MAX_RANK_NUMBER)
            if whole is None or whole != rank:
                continue
            if len(self._rank_set) + len(admitted) >= MAX_RANKS \
                    or len(self.steps) * (len(self._rank_set) + len(admitted) + 1) > MAX_CELLS:
                break
            admitted.add(rank)
        refused = {r for r in new - admitted if not math.isnan(r)}
        if refused or any(math.isnan(r) for r in new):
            rows = [self.flat[i:i + _WIDTH] for i in range(start, len(self.flat), _WIDTH)]
            keep = [row for row in rows if row[0] in self._rank_set or row[0] in admitted]
            self.drop("per-rank entries of no valid rank or past the rank bound", len(rows) - len(keep))
            del self.flat[start:]
            for row in keep:
                self.flat.extend(row)
        if admitted:
            self._rank_set |= {int(r) for r in admitted}
            self.ranks = sorted(self._rank_set)

    def row(self, line: int) -> dict[str, Any]:
        """Line ``line`` as the page draws it (the live stream sends these)."""
        end = self.line_start[line + 1] if line + 1 < len(self.line_start) else len(self.flat) // _WIDTH
        loss = self.loss[line]
        entries = [self.flat[i * _WIDTH:(i + 1) * _WIDTH] for i in range(self.line_start[line], end)]
        return {"line": line, "step": self.steps[line], "loss": None if math.isnan(loss) else loss,
                "lr": self.lr[line], "samples_per_s": self.samples_per_s[line],
                "per_rank": {str(int(e[0])): dict(zip(RANK_KEYS, e[1:])) for e in entries},
                **self.extras.get(line, {})}

    def standing(self, key: str, lo: int = 0, hi: int | None = None) -> np.ndarray:
        """Rows ``lo:hi`` of the lines that stand (``kept``) of a column (``COLUMNS``) or of a per-rank
        key's lines x ranks matrix. A run within ``CACHE_CELLS`` has each matrix laid out once per growth
        of its records; a larger one only the rows asked for, each time (its memory stays that of its
        records, whatever their shape)."""
        if key in COLUMNS:
            if key not in self._matrices:
                kept = np.asarray(self.kept, dtype=np.int64)
                for column in COLUMNS:
                    self._matrices[column] = np.asarray(getattr(self, column), dtype=np.float64)[kept]
            return self._matrices[key][lo:hi]
        if self.cells <= CACHE_CELLS:
            if key not in self._matrices:
                self._matrices[key] = self._layout(key, np.asarray(self.kept, dtype=np.int64))
            return self._matrices[key][lo:hi]
        return self._layout(key, np.asarray(self.kept[lo:hi], dtype=np.int64))

    def _layout(self, key: str, lines: np.ndarray) -> np.ndarray:
        """``key``'s values on ``lines`` (line numbers, increasing) x ranks; NaN where a rank has none."""
        out = np.full((len(lines), len(self.ranks)), np.nan)
        if not len(lines) or not self.flat:
            return out
        flat = np.frombuffer(self.flat, dtype=np.float64).reshape(-1, _WIDTH)
        starts = np.frombuffer(self.line_start, dtype=np.int64)
        first, last = int(lines[0]), int(lines[-1])
        begin, end = int(starts[first]), int(starts[last + 1]) if last + 1 < len(starts) else len(flat)
        block = flat[begin:end]
        line_of = np.repeat(np.arange(first, last + 1), np.diff(np.append(starts[first:last + 1], end)))
        row = np.minimum(np.searchsorted(lines, line_of), len(lines) - 1)
        ok = (lines[row] == line_of) & np.isin(block[:, 0], self.ranks)  # a line that stands, a rank kept
        ranks = np.searchsorted(self.ranks, block[ok, 0].astype(np.int64))
        out[row[ok], ranks] = block[ok, 1 + RANK_KEYS.index(key)]
        return out

    def held_bytes(self) -> int:
        """What the records take in memory, roughly: entries, columns and laid-out matrices."""
        return len(self.flat) * 8 + len(self.steps) * 40 + sum(m.nbytes for m in self._matrices.values())

    def kept_extras(self, key: str) -> list[tuple[int, Any]]:
        """(line, value) of one of the extras, on the lines that stand."""
        standing = set(self.kept)
        return [(line, extra[key]) for line, extra in sorted(self.extras.items()) if key in extra and line in standing]


def _buckets(count: int, points: int) -> np.ndarray:
    """Bucket edges splitting ``count`` lines into at most ``points`` nearly equal buckets."""
    buckets = max(1, min(points, count))
    return np.linspace(0, count, buckets + 1).round().astype(np.int64)


def _reduce(values: np.ndarray, edges: np.ndarray, how: str) -> np.ndarray:
    """Per bucket (axis 0) mean or max, NaN left out (an all-NaN bucket stays NaN); a bucket of one line
    is that line."""
    if len(edges) - 1 == len(values) or not len(values):
        return values
    starts = edges[:-1]
    if how == "max":
        return np.fmax.reduceat(values, starts, axis=0)
    seen = ~np.isnan(values)
    sums = np.add.reduceat(np.where(seen, values, 0.0), starts, axis=0)
    counts = np.add.reduceat(seen, starts, axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def _clean(values: np.ndarray, digits: int = 4) -> list[Any]:
    """JSON-ready: rounded, NaN as null."""
    rounded = np.round(values.astype(np.float64), digits)
    return [None if isinstance(v, float) and math.isnan(v) else v for v in rounded.tolist()] \
        if rounded.ndim == 1 else [_clean(row, digits) for row in rounded]


class RunView:
    """One run directory, read as it grows: ``refresh`` parses only the bytes appended since the last
    call (a line still being written is held, not read again; a file cut short is read again from the
    start). Every file is read through ``folder`` (``RunsFolder``): a standalone view is bounded by its
    own directory."""

    def __init__(self, run_id: str, path: Path, folder: RunsFolder | None = None) -> None:
        self.id, self.run = run_id, RunDir(path)
        self.folder = folder or RunsFolder(path)
        self.series = Series()
        self.problem: str | None = None  # why metrics.jsonl cannot be read, if it cannot
        self._offset = 0  # metrics.jsonl's bytes up to the end of the last whole line parsed
        self._read_to = 0  # and read (a line still being written is held in ``_pending``)
        self._pending = b""
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES: dropped up to its newline
        self._lock = threading.Lock()

    def refresh(self) -> int:
        """Read what metrics.jsonl gained (at most ``READ_BYTES`` a call); returns how many lines it has."""
        with self._lock:
            try:
                self._read_more()
                self.problem = None
            except Unreadable as exc:
                self.problem = str(exc)
            return len(self.series.steps)

    def _restart(self) -> None:
        self.series, self._offset, self._read_to, self._pending, self._skipping = Series(), 0, 0, b"", False

    def _read_more(self) -> None:
        path = self.run.metrics_path
        size = self.folder.size(path)
        if size is None:  # none, or one refused: say why (a link out of the folder, a FIFO, a device)
            with contextlib.suppress(FileNotFoundError):
                if os.path.lexists(path):
                    self.folder.read(path, 0)
            return
        if size < self._offset:  # replaced, or cut short below what was parsed
            self._restart()
        elif size < self._read_to or (self._pending and self.folder.read(
                path, len(self._pending), self._offset) != self._pending):  # the torn line cut off on resume
            self._read_to, self._pending, self._skipping = self._offset, b"", False
        budget = READ_BYTES
        while size > self._read_to and budget > 0:
            try:
                data = self.folder.read(path, min(CHUNK_BYTES, size - self._read_to, budget), self._read_to)
            except FileNotFoundError:
                return
            if not data:
                return
            self._read_to += len(data)
            budget -= len(data)
            self._parse(data)

    def _parse(self, data: bytes) -> None:
        if self._skipping:
            newline = data.find(b"\n")
            if newline < 0:
                return
            self._offset += newline + 1
            data, self._skipping = data[newline + 1:], False
        data = self._pending + data
        end = data.rfind(b"\n") + 1  # a line still being written waits for its newline
        self._pending = data[end:]
        if len(self._pending) > MAX_LINE_BYTES:
            self.series.drop("lines longer than 1 MB")
            self._offset += end + len(self._pending)
            self._pending, self._skipping = b"", True
        else:
            self._offset += end
        for line in data[:end].splitlines():
            if len(line) > MAX_LINE_BYTES:
                self.series.drop("lines longer than 1 MB")
                continue
            record = _parse_line(line)
            if isinstance(record, dict):
                try:
                    self.series.add(record)
                except Exception as exc:  # a shape nothing here expected: the line alone is lost, counted
                    self.series.drop(f"lines of unexpected content ({type(exc).__name__})")

    def forget(self) -> None:
        """Drop the records read so far (memory): read again from the start when next asked for."""
        with self._lock:
            if self.series.steps:
                self._restart()

    def rows(self, start: int, limit: int = LIVE_ROWS) -> tuple[int, list[dict[str, Any]]]:
        """At most ``limit`` lines from ``start`` on (the live stream): (lines now, rows)."""
        with self._lock:
            series = self.series
            end = min(len(series.steps), start + limit)
            return len(series.steps), [series.row(line) for line in range(start, end)]

    # -- what the page asks for -----------------------------------------------------------------------
    def report(self) -> dict[str, Any] | None:
        """report.json, unless it is an earlier launch's: a resumed (or restarted) run writes config.json
        again when it starts, and its report only when it ends."""
        report = self.folder.json(self.run.report_path)
        if report is not None and not isinstance(report, dict):
            raise Unreadable("report.json is not a JSON object")
        if report is not None and (_mtime(self.run.config_path) or 0.0) > (_mtime(self.run.report_path) or 0.0):
            return None
        return report

    def config(self) -> dict[str, Any]:
        config = self.folder.json(self.run.config_path)
        if not isinstance(config, dict):
            raise Unreadable("config.json is not a JSON object")
        return config

    def _last_record(self) -> dict[str, Any]:
        """The newest metrics line: from the records if read, else from the file's tail only (the runs
        table reads no run whole)."""
        size = self.folder.size(self.run.metrics_path) or 0
        with self._lock:
            if self.series.steps and size == self._offset:  # read to the end
                last = len(self.series.steps) - 1
                return {"step": self.series.steps[last], "loss": self.series.loss[last],
                        "samples_per_s": self.series.samples_per_s[last]}
        try:
            tail = self.folder.read(self.run.metrics_path, TAIL_BYTES, max(0, size - TAIL_BYTES))
        except (OSError, Unreadable):
            return {}
        for line in reversed(tail.splitlines()[1:] if size > TAIL_BYTES else tail.splitlines()):
            record = _parse_line(line)
            if isinstance(record, dict):
                return record
        return {}

    def summary(self) -> dict[str, Any]:
        """The runs table's row (config, report and the newest metrics line); a run that cannot be read
        is a row of its own saying why, never an error of the table."""
        try:
            return self._summary()
        except Unreadable as exc:
            return self._unreadable(str(exc))
        except Exception as exc:  # a shape nothing here expected: this run alone, in one line
            log.warning("mlscale ui: run %s cannot be read: %s", self.id, _short(exc))
            return self._unreadable(f"unexpected content ({type(exc).__name__})")

    def _unreadable(self, reason: str) -> dict[str, Any]:
        return {"id": self.id, "status": "unreadable", "reason": reason, "task": None, "strategy": None,
                "world": None, "steps": None, "total_steps": None, "loss": None, "samples_per_s": None,
                "restarts": None, "started": _mtime(self.run.config_path), "fault_tolerance": None}

    def _summary(self) -> dict[str, Any]:
        config = self.config()
        report = self.report()
        last = self._last_record()
        status = (_text(report.get("status")) or "completed") if report else self._status_without_report()
        loss = report.get("final_loss") if report else last.get("loss")
        sps = report.get("samples_per_s") if report else last.get("samples_per_s")
        restarts = _whole(report.get("restarts")) if report else len(self.folder.records(self.run.recovery_path))
        steps = _whole(last.get("step"))
        return {
            "id": self.id, "status": status, "task": _text(config.get("task")),
            "strategy": _text(config.get("strategy")),
            "world": _whole(report.get("world_size")) if report else self._world(config),
            "steps": steps if steps is not None else _whole((report or {}).get("steps")) or 0,
            "total_steps": _whole((report or {}).get("steps")) or _whole(config.get("steps")),
            "loss": _finite(loss), "samples_per_s": _finite(sps), "restarts": restarts,
            "started": _mtime(self.run.config_path),
            "fault_tolerance": _text(_object(config.get("recovery")).get("fault_tolerance")),
        }

    def _world(self, config: dict[str, Any]) -> int | None:
        try:
            plan = _object(self.folder.json(self.run.plan_path))
        except Unreadable:
            plan = {}
        return _whole(plan.get("processes")) or _whole(config.get("workers"))

    def _status_without_report(self) -> str:
        beats = [_mtime(Path(e.path)) or 0.0 for e in self.folder.listing(self.run.heartbeats)]
        latest = max([_mtime(self.run.config_path) or 0.0, _mtime(self.run.metrics_path) or 0.0, *beats])
        return "running" if time.time() - latest <= RUNNING_WITHIN_S else "stopped"

    def detail(self) -> dict[str, Any]:
        """The run page's fixed parts: summary, config, plan, report, memory, pipeline, events; each
        checked for the shape the page draws (an unreadable run: its reason and nothing else)."""
        self.refresh()
        summary = self.summary()
        empty = {"config": {}, "plan": {}, "report": {}, "memory": [], "pipeline": None, "events": [],
                 "ranks": [], "lines": 0, "dropped": {}}
        if summary["status"] == "unreadable":
            return {**summary, **empty}
        try:
            report = self.report() or {}
            plan = self.folder.json(self.run.plan_path)
            return {
                **summary, "config": self.config(), "plan": plan if isinstance(plan, dict) else {},
                "report": {**report, "per_rank": [r for r in _items(report.get("per_rank")) if isinstance(r, dict)]},
                "memory": _memory(report.get("memory")), "pipeline": _pipeline(report.get("pipeline")),
                "events": self.events(), "ranks": self.series.ranks, "lines": len(self.series.steps),
                "dropped": dict(self.series.dropped), **({"reason": self.problem} if self.problem else {}),
            }
        except Unreadable as exc:
            return {**self._unreadable(str(exc)), **empty}

    def events(self) -> list[dict[str, Any]]:
        """What happened to the job, by step, for the timeline: injected faults (kill, hang), worker
        errors, restarts and resumes (recovery.jsonl), live recoveries and replica restarts (per-step
        replica logs), steps without every replica (metrics lines) and the first flag of each straggler.
        Each field checked: a file's odd value becomes a blank, never a page that throws."""
        events: list[dict[str, Any]] = []
        for fault in self.folder.records(self.run.faults_path):
            kind = fault.get("kind")
            if kind == "slow":
                continue
            kind = kind if kind in FAULT_KINDS else "fault"
            step, rank = _whole(fault.get("step")), _whole(fault.get("rank"))
            events.append({"kind": kind, "step": step, "rank": rank, "time": _finite(fault.get("time")),
                           "text": f"{kind} of rank {rank} at step {step} (injected)"})
        for failure in self.folder.records(self.run.failures_path):
            step, rank = _whole(failure.get("step")), _whole(failure.get("rank"))
            error = str(failure.get("error"))[:ERROR_KEPT]
            shown = error if len(error) <= ERROR_CHARS else error[:ERROR_CHARS - 1] + "…"
            events.append({"kind": "error", "step": None if step is None else step + 1, "rank": rank,
                           "time": _finite(failure.get("time")), "text": f"rank {rank}: {shown}", "error": error})
        for event in self.folder.records(self.run.recovery_path):
            attempt, failed = _whole(event.get("attempt")), _whole(event.get("failed_at_step"))
            downtime, resumed = _finite(event.get("downtime_s")), _whole(event.get("resumed_from_step"))
            events.append({"kind": "restart", "step": failed, "attempt": attempt,
                           "text": f"restart {attempt}: the group stopped after step {failed}"
                                   + (f", down {downtime:.1f} s" if downtime else "")})
            events.append({"kind": "resume", "step": resumed, "attempt": attempt,
                           "text": f"resumed from the checkpoint of step {resumed}, "
                                   f"{_whole(event.get('steps_redone'))} step(s) redone"})
        events.extend(self._replica_events())
        events.extend(self._bad_sample_events())
        for first, last, members in self._degraded_spans():
            events.append({"kind": "degraded", "step": first, "until": last, "participants": members,
                           "text": f"steps {first}-{last} trained by replica group(s) "
                                   f"{', '.join(map(str, members))} only"})
        flagged: dict[int, int] = {}
        for line, ranks in self.series.kept_extras("stragglers"):
            step = self.series.steps[line]
            for rank in ranks:
                flagged.setdefault(rank, step)
        for rank, step in sorted(flagged.items()):
            events.append({"kind": "straggler", "step": step, "rank": rank, "text": f"rank {rank} flagged a straggler"})
        return sorted(events, key=lambda e: (e["step"] if e.get("step") is not None else -1, e["kind"]))

    def _degraded_spans(self) -> list[tuple[int, int, list[int]]]:
        """Steps trained without every replica group, one span per stretch with the same groups (each
        metrics line reports the part of a stretch in its own window)."""
        spans: list[tuple[int, int, list[int]]] = []
        for _, reported in self.series.kept_extras("degraded_steps"):
            for span in reported:
                first, last = span["steps"]
                members = list(span["participants"])
                if spans and spans[-1][2] == members and first <= spans[-1][1] + 1:
                    spans[-1] = (spans[-1][0], max(last, spans[-1][1]), members)
                else:
                    spans.append((first, last, members))
        return spans

    def _replica_logs(self) -> dict[tuple[int, int], Path]:
        """The per-step replica logs (``RunDir.replica_log``'s names), by (group, rank), at most ``LISTED``."""
        found = {}
        for entry in self.folder.listing(self.run.logs):
            named = REPLICA_LOG.fullmatch(entry.name)
            if named:
                found[int(named[1]), int(named[2] or 0)] = Path(entry.path)
        return dict(sorted(found.items()))

    def _bad_sample_events(self) -> list[dict[str, Any]]:
        """``--bad-samples skip``'s samples left out (``RunDir.bad_samples_path``: rankR.jsonl), one event each,
        at most ``BAD_SAMPLES_SHOWN`` of them, every field checked."""
        events: list[dict[str, Any]] = []
        for entry in self.folder.listing(self.run.bad_samples):
            named = BAD_SAMPLES_LOG.fullmatch(entry.name)
            if not named:
                continue
            for line in self.folder.records(Path(entry.path)):
                if len(events) >= BAD_SAMPLES_SHOWN:
                    return events
                step, index, epoch = _whole(line.get("step")), _whole(line.get("index")), _whole(line.get("epoch"))
                error = str(line.get("error"))[:ERROR_CHARS]
                events.append({"kind": "bad_sample", "step": step, "rank": int(named[1]),
                               "text": f"sample {index} left out (epoch {epoch}, rank {named[1]}): {error}"})
        return events

    def _replica_events(self) -> list[dict[str, Any]]:
        events = []
        for (group, _rank), path in self._replica_logs().items():
            for line in self.folder.records(path):
                attempt, step = _whole(line.get("attempt")) or 0, _whole(line.get("step"))
                if line.get("event") == "start" and attempt > 0:
                    step = step or None  # a replacement with no checkpoint starts at 0: its place on the
                    # timeline is its live recovery
                    events.append({"kind": "replica_restart", "step": step, "replica": group,
                                   "text": f"replica group {group} restarted (attempt {attempt})"
                                           + (f", from step {step}" if step else ", to recover its state live")})
                elif line.get("event") == "received":
                    events.append({"kind": "live_recovery", "step": step, "replica": group,
                                   "text": f"replica group {group} recovered live: the state of step "
                                           f"{step} from its peers"})
        return events

    def series_payload(self, lo_step: float | None, hi_step: float | None, points: int,
                       rank: str = "all") -> dict[str, Any]:
        """The charts' data between two steps, at most ``points`` points a series: bucket means (the
        straggler score: the bucket's highest, so a slow rank is never averaged away); the split of
        ``rank`` (or the mean over ranks); each rank's mean split over the range."""
        self.refresh()
        with self._lock:
            return self._series_payload(lo_step, hi_step, points, rank)

    def _series_payload(self, lo_step: float | None, hi_step: float | None, points: int,
                        rank: str) -> dict[str, Any]:
        series = self.series
        steps = series.standing("steps").astype(np.int64)
        lo = int(np.searchsorted(steps, lo_step, "left")) if lo_step is not None else 0
        hi = int(np.searchsorted(steps, hi_step, "right")) if hi_step is not None else len(steps)
        count = max(0, hi - lo)
        edges = _buckets(count, points)
        picked = steps[lo:hi]
        payload: dict[str, Any] = {
            "id": self.id, "lines": len(series.steps), "points_total": len(steps), "from": lo, "to": hi,
            "per_point": count / (len(edges) - 1) if count else 1, "ranks": series.ranks,
            "steps": (picked[np.maximum(edges[1:] - 1, 0)] if count else picked).tolist(),
            "first_step": int(steps[0]) if len(steps) else None, "last_step": int(steps[-1]) if len(steps) else None,
        }
        for key, digits in (("loss", 6), ("lr", 8), ("samples_per_s", 1)):
            payload[key] = _clean(_reduce(series.standing(key, lo, hi), edges, "mean"), digits) if count else []
        ranked = count if series.ranks else 0
        # the heat map: at most HEAT_CELLS cells (a canvas rectangle each), never fewer columns than 100
        heat_edges = _buckets(ranked, max(100, min(points, HEAT_CELLS // max(1, len(series.ranks)))))
        payload["heat_steps"] = (picked[np.maximum(heat_edges[1:] - 1, 0)] if ranked else picked[:0]).tolist()
        payload["straggler"] = _clean(_reduce(series.standing("straggler_score", lo, hi), heat_edges, "max").T, 3) \
            if ranked else []
        split: dict[str, Any] = {}
        means: dict[str, Any] = {}
        for key in (*SPLIT_KEYS, "step_ms"):
            values = series.standing(key, lo, hi) if ranked else np.zeros((0, len(series.ranks)))
            if RANK_CHOICE.fullmatch(rank) and int(rank) in series.ranks:
                column = values[:, series.ranks.index(int(rank))]
            else:
                column = _nanmean(values, axis=1) if ranked else np.zeros(0)
            split[key] = _clean(_reduce(column, edges, "mean"), 3) if ranked else []
            means[key] = _clean(_nanmean(values, axis=0), 3) if ranked else []
        payload["split"], payload["split_of"], payload["rank_means"] = split, rank, means
        evals = [extra for _, extra in series.kept_extras("eval")]
        payload["eval"] = [e for batch in evals for e in batch
                           if (lo_step is None or e.get("step", 0) >= lo_step)
                           and (hi_step is None or e.get("step", 0) <= hi_step)]
        return payload


def _nanmean(values: np.ndarray, axis: int) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return np.nanmean(values, axis=axis)


def _parse_line(line: bytes) -> Any:
    """A metrics line's value; NaN or Infinity (a diverged loss, as Python's json writes it) the slow way;
    None for a line that is not JSON (a torn line a killed run left, cut off when it resumes)."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        try:
            return json.loads(line)
        except (ValueError, RecursionError):
            return None


def _memory(value: Any) -> list[dict[str, Any]]:
    """report.json's memory per rank, as the page draws it: a rank and numbers in MB."""
    rows = []
    for row in value[:MAX_RANKS] if isinstance(value, list) else []:
        rank = _whole(row.get("rank"), 0, MAX_RANK_NUMBER) if isinstance(row, dict) else None
        if rank is not None:
            rows.append({"rank": rank, **{str(k)[:SHORT]: v for k, v in row.items()
                                           if str(k).endswith("_mb") and _finite(v) is not None}})
    return rows


def _pipeline(value: Any) -> dict[str, Any] | None:
    """report.json's pipeline figures, as the page draws them, or None."""
    if not isinstance(value, dict):
        return None
    stages, params = _whole(value.get("stages"), 1, MAX_RANKS), value.get("stage_params")
    if stages is None or not isinstance(params, list) or any(_finite(p) is None for p in params[:MAX_RANKS]):
        return None
    return {**value, "stages": stages, "stage_params": params[:MAX_RANKS], "schedule": _text(value.get("schedule")),
            "microbatches": _whole(value.get("microbatches")), "ideal_bubble": _finite(value.get("ideal_bubble"))}


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:SHORT]


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


class RunCatalog:
    """The runs under ``--runs``, found again on every listing (a new run shows up without a restart);
    each run's records kept between calls so only what a run appends is read again."""

    def __init__(self, root: Path | None) -> None:
        self.root = root
        self.folder = RunsFolder(root) if root is not None else None
        self._views: dict[str, RunView] = {}
        self._lock = threading.Lock()

    def ids(self) -> dict[str, Path]:
        return find_runs(self.root) if self.root is not None else {}

    def view(self, run_id: str, found: dict[str, Path] | None = None, *, touch: bool = True) -> RunView | None:
        """The run of that id, or None (an id is a path found under ``--runs``, never one from the
        request: ``..`` or an absolute path finds nothing). ``found``: a listing just made. Asking for a
        run (``touch``; the runs table does not) makes it the most recently used: the records of at most
        ``KEEP_RUNS`` runs stay in memory."""
        with self._lock:
            view = self._views.get(run_id)
            if view is None or not view.run.config_path.is_file():
                path = (found if found is not None else self.ids()).get(run_id)
                if path is None:
                    return None
                view = RunView(run_id, path, self.folder)
            if not touch:
                self._views.setdefault(run_id, view)
                return self._views[run_id]
            self._views.pop(run_id, None)
            self._views[run_id] = view  # the most recent last
            for older in list(self._views.values())[:-KEEP_RUNS]:
                older.forget()
            held = list(self._views.values())
            size = sum(v.series.held_bytes() for v in held)
            for older in held[:-1]:  # and within KEEP_BYTES, the least recently asked for forgotten first
                if size <= KEEP_BYTES:
                    break
                size -= older.series.held_bytes()
                older.forget()
            return view

    def summaries(self) -> list[dict[str, Any]]:
        rows = []
        found = self.ids()
        for run_id in found:
            view = self.view(run_id, found, touch=False)
            if view is not None:
                rows.append(view.summary())
        return sorted(rows, key=lambda r: -(r["started"] or 0))

    def read_ahead(self, runs: int = WARM_RUNS) -> None:
        """Read the records of the most recently started runs now (the UI does this in the background when
        it starts), so that opening one finds them read: a long run's first read takes seconds."""
        found = self.ids()
        recent = sorted(found, key=lambda run_id: -(_mtime(RunDir(found[run_id]).config_path) or 0.0))
        for run_id in recent[:runs]:
            view = self.view(run_id, found)
            if view is not None:
                view.refresh()

    def id_of(self, path: str | os.PathLike[str] | None) -> str | None:
        """The id of a run directory given by its path (a registry version's source run), if it is one
        of ours."""
        if not path or self.root is None:
            return None
        try:
            relative = Path(path).resolve().relative_to(self.root.resolve()).as_posix()
        except ValueError:
            return None
        return relative if relative in self.ids() else None
