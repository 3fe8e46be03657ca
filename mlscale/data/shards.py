"""Images in tar shards, WebDataset's layout: ``NAME.jpg`` (or ``.jpeg``/``.png``) beside ``NAME.cls`` (the class
index as text) or ``NAME.json`` (``{"label": N}``), in ``shard-000000.tar``, ``shard-000001.tar``...

``TarShards(paths)`` indexes the shards once (each member's offset and size in its tar, read from the
headers, not the data) and keeps the index as arrays (``.npz``, no pickle: 20 bytes a sample, so millions of
images hold a few tens of MB) beside the shards or in the cache folder, checked against each shard's size
and modification time. An item is then one read of ``size`` bytes at ``offset`` in its shard: a local file
kept open per process, or from object storage (fsspec): with ``--data-cache-mb`` (``use_object_cache``) the
whole shard is fetched once into the host's bounded cache folder (one request, not one a member; a host's
processes take turns, so a shard is fetched once) and read there, else a ranged read of the member. Items
are decoded and augmented as ``images.AugmentedImages`` does (the same (seed, epoch, sample) crops).

Items are addressed by index, so the sharding contract holds as for any Dataset; ``sample_shards()`` says
which shard each item is in, and the loaders then lay the epoch out so that a rank reads only its own shards
(``sampler.shard_order``): with 24 pieces, world sizes 1, 2, 3, 4, 6, 8, 12 and 24 fetch a shard on one rank
only, and the same rank every epoch. A resume at another world size still trains the rest of the epoch once.
"""

from __future__ import annotations

import glob
import hashlib
import io
import json
import os
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from mlscale.data.images import IMAGENET_MEAN, IMAGENET_STD, AugmentedImages, Listing
from mlscale.data.storage import ObjectCache, is_remote, with_retries
from mlscale.errors import UsageError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
OPEN_SHARDS = 16  # local shard files a process keeps open


def shard_paths(source: str | Path | Sequence[str], suffix: str = ".tar") -> list[str]:
    """The shards of ``source``: a list, a glob (``data/shard-*.tar``), a folder of ``suffix`` files, or a URL."""
    if isinstance(source, Path):
        source = str(source)
    if not isinstance(source, str):
        return [str(path) for path in source]
    if is_remote(source):
        import fsspec

        fs, path = fsspec.core.url_to_fs(source)
        protocol = source.split("://")[0]
        found = fs.glob(path) if any(c in path for c in "*?[") else \
            (sorted(p for p in fs.find(path) if p.endswith(suffix)) if fs.isdir(path) else [path])
        return [f"{protocol}://{p}" for p in sorted(found)]
    if os.path.isdir(source):
        return sorted(str(p) for p in Path(source).rglob(f"*{suffix}")  # Spark and Dask write nested folders
                      if not any(part.startswith(".") for part in p.relative_to(source).parts))
    return sorted(glob.glob(source)) or ([source] if os.path.exists(source) else [])


def _stamp(path: str) -> list[Any]:
    if is_remote(path):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path)
        info = fs.info(inner)
        return [info.get("size"), str(info.get("LastModified") or info.get("mtime") or "")]
    stat = os.stat(path)
    return [stat.st_size, stat.st_mtime_ns]


def _members(path: str) -> list[tarfile.TarInfo]:
    if is_remote(path):
        import fsspec

        with fsspec.open(path, "rb") as handle, tarfile.open(fileobj=handle, mode="r|") as archive:
            return [member for member in archive if member.isfile()]
    with tarfile.open(path, "r") as archive:
        return [member for member in archive.getmembers() if member.isfile()]


class ShardIndex:
    """Where each sample of the shards is: shard number, offset and size of its image, its label."""

    def __init__(self, shards: list[str], shard: np.ndarray, offset: np.ndarray, size: np.ndarray,
                 label: np.ndarray, names: list[str], shard_bytes: list[int | None]) -> None:
        self.shards, self.shard, self.offset, self.size = shards, shard, offset, size
        self.label, self.names = label, names
        self.shard_bytes = shard_bytes  # each shard's size, from the stamps the index is checked against

    @classmethod
    def of(cls, shards: list[str]) -> ShardIndex:
        stamps = [_stamp(path) for path in shards]
        key = hashlib.sha256(json.dumps([shards, stamps]).encode()).hexdigest()[:20]
        kept = _index_folder(shards) / f"index-{key}.npz"
        if kept.exists():
            saved = np.load(kept, allow_pickle=False)
            return cls(shards, saved["shard"], saved["offset"], saved["size"], saved["label"],
                       list(saved["names"].astype(str)), [stamp[0] for stamp in stamps])
        columns: dict[str, list[Any]] = {"shard": [], "offset": [], "size": [], "label": [], "names": []}
        for number, path in enumerate(shards):
            images: dict[str, tarfile.TarInfo] = {}
            labels: dict[str, int] = {}
            for member in _members(path):
                stem, _, suffix = member.name.rpartition(".")
                if f".{suffix.lower()}" in IMAGE_SUFFIXES:
                    images[stem] = member
                elif suffix in ("cls", "json"):
                    labels[stem] = _label(path, member)
            for stem in sorted(images):
                if stem not in labels:
                    raise UsageError(f"shard {path}: {images[stem].name} has no {stem}.cls or {stem}.json beside it")
                member = images[stem]
                for name, value in (("shard", number), ("offset", member.offset_data), ("size", member.size),
                                    ("label", labels[stem]), ("names", f"{os.path.basename(path)}:{member.name}")):
                    columns[name].append(value)
        if not columns["shard"]:
            raise UsageError(f"no images in the {len(shards)} shard(s) ({', '.join(shards[:3])}...)")
        index = cls(shards, np.asarray(columns["shard"], np.int32), np.asarray(columns["offset"], np.int64),
                    np.asarray(columns["size"], np.int32), np.asarray(columns["label"], np.int32), columns["names"],
                    [stamp[0] for stamp in stamps])
        try:
            kept.parent.mkdir(parents=True, exist_ok=True)
            temporary = kept.with_suffix(".part.npz")
            np.savez(temporary, shard=index.shard, offset=index.offset, size=index.size, label=index.label,
                     names=np.asarray(index.names))
            os.replace(temporary, kept)
        except OSError:
            pass  # not kept: indexed again next time
        return index


def _label(path: str, member: tarfile.TarInfo) -> int:
    """A ``.cls`` or ``.json`` member's label, read from the tar (small: a few bytes)."""
    with _open(path) as handle:
        handle.seek(member.offset_data)
        text = handle.read(member.size).decode()
    try:
        value = json.loads(text)
        label = value.get("label", value.get("cls")) if isinstance(value, dict) else value
        return int(label)
    except (ValueError, TypeError, AttributeError):
        raise UsageError(f"shard {path}: {member.name} holds no class index ({text[:40]!r})") from None


def _open(path: str) -> BinaryIO:
    if is_remote(path):
        import fsspec

        return fsspec.open(path, "rb").open()  # type: ignore[no-any-return]
    return open(path, "rb")


def _index_folder(shards: list[str]) -> Path:
    first = shards[0]
    if not is_remote(first) and os.access(os.path.dirname(os.path.abspath(first)), os.W_OK):
        return Path(os.path.dirname(os.path.abspath(first))) / ".mlscale"
    return Path(os.environ.get("MLSCALE_CACHE_DIR") or Path.home() / ".cache" / "mlscale") / "shards"


class TarShards(AugmentedImages):
    """The images of WebDataset-style tar shards as ``(image, label)`` items (``AugmentedImages``)."""

    def __init__(self, source: str | Path | Sequence[str], size: int = 64, *, train: bool = True, seed: int = 0,
                 indices: Sequence[int] | None = None, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None, normalize: bool = False) -> None:
        super().__init__(size, train, seed, mean, std, transform, normalize)
        shards = shard_paths(source)
        if not shards:
            raise UsageError(f"bad value shards={source!r}: no .tar shards there")
        self.index = ShardIndex.of(shards)
        self.indices = np.asarray(indices if indices is not None else range(len(self.index.shard)), np.int64)
        self._handles: dict[int, BinaryIO] = {}
        self._pid = os.getpid()
        self.cache: ObjectCache | None = None

    def __len__(self) -> int:
        return len(self.indices)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_handles": {}}  # open files stay with their process

    def name_of(self, index: int) -> str:
        return self.index.names[int(self.indices[index])]

    def label_of(self, index: int) -> int:
        return int(self.index.label[int(self.indices[index])])

    def sample_shards(self) -> np.ndarray:
        """The shard each item is read from: the loaders keep a rank on its own shards."""
        return self.index.shard[self.indices]

    def use_object_cache(self, directory: Path, limit_bytes: int) -> None:
        """Fetch remote shards whole into ``directory`` (at most ``limit_bytes``, ``--data-cache-mb``) and
        read their members there; nothing to keep for local shards."""
        if is_remote(self.index.shards[0]):
            self.cache = ObjectCache(directory, limit_bytes)

    def file(self, index: int) -> io.BytesIO:
        row = int(self.indices[index])
        shard, offset, size = int(self.index.shard[row]), int(self.index.offset[row]), int(self.index.size[row])
        path = self.index.shards[shard]
        if is_remote(path) and not self._fetch_whole(shard):
            import fsspec

            fs, inner = fsspec.core.url_to_fs(path)
            return io.BytesIO(with_retries(f"reading {self.name_of(index)}",
                                           lambda: fs.cat_file(inner, start=offset, end=offset + size)))
        handle = self._handle(shard, path)
        handle.seek(offset)
        data = handle.read(size)
        if len(data) != size:
            raise OSError(f"the shard ends {size - len(data)} bytes short of this member (truncated)")
        return io.BytesIO(data)

    def _fetch_whole(self, shard: int) -> bool:
        """Whether remote shard ``shard`` is fetched whole into the cache: when there is one and it holds four
        such shards (else each member is a ranged read)."""
        size = self.index.shard_bytes[shard]
        return self.cache is not None and size is not None and 4 * size <= self.cache.limit

    def _handle(self, shard: int, path: str) -> BinaryIO:
        """Shard ``shard`` open for reading in this process (kept open: an item is one seek and one read): the
        local file, or the cached copy of a remote one."""
        if self._pid != os.getpid():  # a forked worker: its own file positions
            self._handles, self._pid = {}, os.getpid()
        handle = self._handles.get(shard)
        if handle is None:
            if len(self._handles) >= OPEN_SHARDS:
                self._handles.pop(next(iter(self._handles))).close()
            handle = self._handles[shard] = self._open_copy(path) if is_remote(path) else open(path, "rb")  # noqa: SIM115
        return handle

    def _open_copy(self, url: str) -> BinaryIO:
        """Remote shard ``url`` open from the cache, fetched whole (retried) when not there."""
        assert self.cache is not None
        import fsspec

        fs, inner = fsspec.core.url_to_fs(url)
        def fetch(to: str) -> None:
            with_retries(f"fetching {url}", lambda: fs.get_file(inner, to))

        for attempt in range(2):
            try:
                return open(self.cache.local_copy(url, fetch), "rb")
            except FileNotFoundError:  # another process trimmed it from the cache just now: fetched again
                if attempt:
                    raise
        raise AssertionError("unreachable")


def write_tar_shards(folder: str | Path, out: str | Path, per_shard: int = 100) -> list[Path]:
    """An image folder (``root/CLASS/IMAGE``) written as WebDataset tar shards of ``per_shard`` samples:
    ``NAME.jpg`` + ``NAME.cls``. For tests, demos and benchmarks."""
    listing = Listing.of(Path(folder))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for start in range(0, len(listing.files), per_shard):
        path = out / f"shard-{start // per_shard:06d}.tar"
        with tarfile.open(path, "w") as archive:
            for number in range(start, min(start + per_shard, len(listing.files))):
                name = f"{number:08d}"
                archive.add(Path(folder) / listing.files[number], arcname=f"{name}.jpg")
                label = str(listing.labels[number]).encode()
                info = tarfile.TarInfo(f"{name}.cls")
                info.size = len(label)
                archive.addfile(info, io.BytesIO(label))
        written.append(path)
    return written


__all__ = ["ShardIndex", "TarShards", "shard_paths", "write_tar_shards"]
