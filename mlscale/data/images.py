"""Images from a class-per-subfolder tree (torchvision's ImageFolder layout), decoded and augmented per sample.

``ImageFolder(root, size=S)`` lists ``root/CLASS/*.{jpg,jpeg,png}`` once and keeps the listing (``Listing``),
then serves item ``i`` as ``(image, label)``: the file decoded to RGB (Pillow; a JPEG is decoded at the
smallest DCT scale that still covers the crop, ``Image.draft``), a random resized crop to ``S x S`` and a
horizontal flip when training (a centre crop when not), as a ``3 x S x S`` uint8 tensor. Scaling to [0, 1]
and normalising happen in the model (``Normalize``, the first layer of ``--task images``' network), on the
training device, in the run's dtype: a batch travels from the data workers at a quarter of the bytes of
float32 (measured on 2 cores: 1.7x the images/s of normalising in the workers). ``normalize=True`` gives
normalised float32 tensors instead.

*Augmentation that resumes.* The crop and flip of a sample are drawn from a generator seeded with
``(seed, epoch, index)`` alone (``item_for_epoch(index, epoch)``, which mlscale's loaders call with the epoch
of the batch): not from a worker's random state, which depends on how many workers there are and which of them
read the sample. So a resume mid-epoch, at another world size or with another number of data workers,
feeds bit-identical tensors, and a run's tensors can be recomputed from its sample-id files.

*The listing* of a large tree costs one ``scandir`` per class folder: made once and kept in
``ROOT/.mlscale/listing.json`` (else, where the tree is read-only, under ``$MLSCALE_CACHE_DIR`` or
``~/.cache/mlscale/listings``), with each class folder's modification time; a folder changed since (a file
added, removed or renamed in it) makes the listing again.

*Object storage.* ``root`` may be an fsspec URL (``s3://bucket/prefix``; ``storage.Store``): listed once and
kept under ``$MLSCALE_CACHE_DIR`` (or ``~/.cache/mlscale``) ``/listings`` for ``LISTING_MAX_AGE_S`` (a prefix
has no modification time to check), objects read with retries, their bytes kept in a local folder bounded
in bytes when the run asks (``--data-cache-mb``: ``use_object_cache``).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from mlscale.common.io import atomic_write_json
from mlscale.data.storage import ObjectCache, Store, is_remote
from mlscale.errors import UsageError

EXTENSIONS = (".jpg", ".jpeg", ".png")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Listing:
    """The files of an image tree, sorted: ``files[i]`` (relative to the root) has label ``labels[i]``, the
    index of its folder in ``classes`` (sorted names)."""

    classes: list[str]
    files: list[str]
    labels: list[int]

    @classmethod
    def of(cls, root: Path | str) -> Listing:
        """The tree's listing, from its kept copy when no class folder changed since, else made and kept."""
        if is_remote(root):
            return cls.of_store(Store(str(root)))
        root = Path(root)
        if not root.is_dir():
            raise UsageError(f"bad value root={str(root)!r}: not a folder of class folders")
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
        if not classes:
            raise UsageError(f"bad value root={str(root)!r}: no class folders in it (ROOT/CLASS/IMAGE.jpg)")
        stamps = {name: os.stat(root / name).st_mtime_ns for name in classes}
        kept = _kept_path(root)
        try:
            saved = json.loads(kept.read_text())
            if saved.get("stamps") == stamps and saved.get("classes") == classes:
                return cls(saved["classes"], saved["files"], saved["labels"])
        except (OSError, ValueError, KeyError):
            pass  # none kept, or unreadable: make it again
        files, labels = [], []
        for label, name in enumerate(classes):
            found = sorted(entry.name for entry in os.scandir(root / name)
                           if entry.is_file() and entry.name.lower().endswith(EXTENSIONS))
            files.extend(f"{name}/{file}" for file in found)
            labels.extend([label] * len(found))
        if not files:
            raise UsageError(f"bad value root={str(root)!r}: no {', '.join(EXTENSIONS)} files in its class folders")
        listing = cls(classes, files, labels)
        _keep(kept, {"root": str(root), "stamps": stamps, "classes": classes, "files": files, "labels": labels})
        return listing


    @classmethod
    def of_store(cls, store: Store) -> Listing:
        """An object-storage prefix's listing: kept for ``LISTING_MAX_AGE_S``, else listed (one walk)."""
        kept = _cache_base() / (hashlib.sha256(store.root.encode()).hexdigest()[:16] + ".json")
        try:
            saved = json.loads(kept.read_text())
            if saved.get("root") == store.root and time.time() - saved.get("made", 0) < LISTING_MAX_AGE_S:
                return cls(saved["classes"], saved["files"], saved["labels"])
        except (OSError, ValueError, KeyError):
            pass
        tree = {folder: [name for name in names if name.lower().endswith(EXTENSIONS)]
                for folder, names in store.walk().items()}
        classes = sorted(folder for folder, names in tree.items() if names)
        if not classes:
            raise UsageError(f"bad value root={store.root!r}: no {', '.join(EXTENSIONS)} objects under CLASS/ "
                             "prefixes in it")
        files = [f"{name}/{file}" for name in classes for file in tree[name]]
        labels = [label for label, name in enumerate(classes) for _ in tree[name]]
        _keep(kept, {"root": store.root, "made": time.time(), "classes": classes, "files": files, "labels": labels})
        return cls(classes, files, labels)


LISTING_MAX_AGE_S = 3600.0


def _cache_base() -> Path:
    return Path(os.environ.get("MLSCALE_CACHE_DIR") or Path.home() / ".cache" / "mlscale") / "listings"


def _kept_path(root: Path) -> Path:
    if os.access(root, os.W_OK):
        return root / ".mlscale" / "listing.json"
    return _cache_base() / (hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:16] + ".json")


def _keep(path: Path, listing: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, listing)
    except OSError:
        pass  # a listing not kept is made again next time: slower, not wrong


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The random numbers of one sample's augmentation: a function of ``(seed, epoch, index)`` alone."""
    digest = hashlib.blake2b(f"{seed}:{epoch}:{index}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def random_resized_crop(width: int, height: int, generator: torch.Generator, scale: tuple[float, float] = (0.08, 1.0),
                        ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """A box ``(left, top, right, bottom)`` covering a random share ``scale`` of the image's area with an aspect
    ratio in ``ratio`` (log-uniform), as torchvision's RandomResizedCrop draws it (10 tries, then the
    largest centred box of an allowed ratio)."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        draws = torch.rand(4, generator=generator, dtype=torch.float64).tolist()
        target = area * (scale[0] + (scale[1] - scale[0]) * draws[0])
        aspect = math.exp(log_ratio[0] + (log_ratio[1] - log_ratio[0]) * draws[1])
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = int(draws[2] * (width - w + 1)), int(draws[3] * (height - h + 1))
            return left, top, left + w, top + h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif in_ratio > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    left, top = (width - w) // 2, (height - h) // 2
    return left, top, left + w, top + h


def centre_crop(width: int, height: int) -> tuple[int, int, int, int]:
    """The largest centred square."""
    side = min(width, height)
    left, top = (width - side) // 2, (height - side) // 2
    return left, top, left + side, top + side


class AugmentedImages(Dataset[tuple[torch.Tensor, int]]):
    """Encoded images as ``(3 x size x size float32 image, label)`` items; ``train``: a random resized crop and
    flip per ``(seed, epoch, index)``, else a centre crop; ``transform`` is the user's own, applied to the
    normalised tensor. Subclasses say where item ``index``'s bytes are (``file``), its name and its label."""

    def __init__(self, size: int, train: bool, seed: int, mean: Sequence[float], std: Sequence[float],
                 transform: Callable[[torch.Tensor], torch.Tensor] | None, normalize: bool = False) -> None:
        if size < 8:
            raise UsageError(f"bad value size={size}: an image crop of at least 8 pixels")
        self.size, self.train, self.seed = size, train, seed
        self.normalize = normalize
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        self.transform = transform

    def __len__(self) -> int:
        raise NotImplementedError

    def file(self, index: int) -> Path | io.BytesIO:
        """What Pillow opens for item ``index``: a path, or the bytes."""
        raise NotImplementedError

    def name_of(self, index: int) -> str:
        """Item ``index``'s file as the user knows it (in error messages)."""
        raise NotImplementedError

    def label_of(self, index: int) -> int:
        raise NotImplementedError

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.item_for_epoch(index, 0)

    def item_for_epoch(self, index: int, epoch: int) -> tuple[torch.Tensor, int]:
        """Item ``index`` as epoch ``epoch`` sees it (its augmentation drawn from ``(seed, epoch, index)``); a
        file that cannot be read or decoded is a ``ValueError`` naming it."""
        from PIL import Image, UnidentifiedImageError

        try:
            return self._decode(index, epoch, Image), self.label_of(index)
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:  # Pillow's ways of failing
            detail = str(exc).splitlines()[0] if str(exc) else "no detail"
            raise ValueError(f"cannot read or decode {self.name_of(index)} ({type(exc).__name__}: {detail})") from None

    def _decode(self, index: int, epoch: int, Image: Any) -> torch.Tensor:
        with Image.open(self.file(index)) as image:
            image.draft("RGB", (self.size, self.size))  # JPEG: decode at a reduced scale when it still covers
            image = image.convert("RGB")
            draws = sample_generator(self.seed, epoch, index) if self.train else None  # the crop's, then the flip's
            box = random_resized_crop(*image.size, draws) if draws is not None else centre_crop(*image.size)
            image = image.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
            if draws is not None and float(torch.rand(1, generator=draws, dtype=torch.float64)) < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        tensor = pixels.view(self.size, self.size, 3).permute(2, 0, 1)
        if self.normalize:
            tensor = tensor.float().div_(255).sub_(self.mean).div_(self.std)
        return self.transform(tensor) if self.transform is not None else tensor


class ImageFolder(AugmentedImages):
    """``root/CLASS/IMAGE`` files (``AugmentedImages``); ``indices`` keeps a subset of the listing (a held-out
    split)."""

    def __init__(self, root: str | Path, size: int = 64, *, train: bool = True, seed: int = 0,
                 indices: Sequence[int] | None = None, mean: Sequence[float] = IMAGENET_MEAN,
                 std: Sequence[float] = IMAGENET_STD, transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 normalize: bool = False) -> None:
        super().__init__(size, train, seed, mean, std, transform, normalize)
        self.remote = is_remote(root)
        self.root = str(root) if self.remote else Path(root)
        self.store = Store(str(root)) if self.remote else None
        self.listing = Listing.of_store(self.store) if self.store is not None else Listing.of(self.root)
        self.indices = list(indices) if indices is not None else list(range(len(self.listing.files)))

    @property
    def classes(self) -> list[str]:
        return self.listing.classes

    def __len__(self) -> int:
        return len(self.indices)

    def name_of(self, index: int) -> str:
        return self.listing.files[self.indices[index]]

    def label_of(self, index: int) -> int:
        return self.listing.labels[self.indices[index]]

    def file(self, index: int) -> Path | io.BytesIO:
        """What Pillow opens: the file's path, or an object's bytes (from the local copy when kept)."""
        relative = self.listing.files[self.indices[index]]
        if self.store is not None:
            return io.BytesIO(self.store.read(relative))
        return Path(self.root) / relative

    def use_object_cache(self, directory: Path, limit_bytes: int) -> None:
        """Keep the bytes of the objects read in ``directory``, at most ``limit_bytes`` (``--data-cache-mb``);
        nothing to keep for a local folder."""
        if self.store is not None:
            self.store.cache = ObjectCache(directory, limit_bytes)


class Normalize(nn.Module):
    """uint8 images (batch x 3 x H x W) to floats in the module's dtype, scaled to [0, 1] and normalised by
    ``mean`` and ``std``: the first layer of a model fed ``ImageFolder``'s uint8 images, so that this work is
    done on the training device (buffers: they move and cast with the model, and are not trained)."""

    def __init__(self, mean: Sequence[float] = IMAGENET_MEAN, std: Sequence[float] = IMAGENET_STD) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1) * 255, persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1) * 255, persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return (images.to(self.mean.dtype) - self.mean) / self.std


def write_image_folder(root: str | Path, classes: int = 4, per_class: int = 50, seed: int = 0,
                       sizes: tuple[int, int] = (48, 96), quality: int = 90) -> Path:
    """A folder of generated JPEGs, ``root/class_K/img_N.jpg``, for tests, demos and benchmarks (nothing is
    downloaded): each class a colour and a stripe direction a small CNN can learn, each image of a random
    size in ``sizes`` with noise."""
    from PIL import Image

    root = Path(root)
    generator = torch.Generator().manual_seed(seed)
    palette = torch.tensor([[220, 60, 60], [60, 200, 80], [70, 90, 230], [230, 200, 50], [170, 70, 200],
                            [60, 200, 210], [240, 140, 40], [120, 120, 120]], dtype=torch.float32)
    for label in range(classes):
        folder = root / f"class_{label}"
        folder.mkdir(parents=True, exist_ok=True)
        for n in range(per_class):
            w, h = (int(v) for v in torch.randint(sizes[0], sizes[1] + 1, (2,), generator=generator))
            axis = torch.arange(w if label % 2 else h, dtype=torch.float32)
            stripes = (torch.sin(axis / (2 + label % 3)) * 40).view(1, -1) if label % 2 else \
                (torch.sin(axis / (2 + label % 3)) * 40).view(-1, 1)
            base = palette[label % len(palette)].view(1, 1, 3) + stripes.unsqueeze(-1)
            noise = torch.randn(h, w, 3, generator=generator) * 25
            pixels = (base.expand(h, w, 3) + noise).clamp(0, 255).to(torch.uint8)
            Image.fromarray(pixels.numpy(), "RGB").save(folder / f"img_{n:05d}.jpg", quality=quality)
    return root


__all__ = ["AugmentedImages", "ImageFolder", "Listing", "Normalize", "centre_crop", "random_resized_crop",
           "sample_generator", "write_image_folder"]
