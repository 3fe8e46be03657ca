"""``--task images --task-opt root=DIR``: a ResNet-style CNN trained on a class-per-subfolder tree of images.

The data is ``mlscale.data.images.ImageFolder`` (decoded and augmented per sample in the data workers, the
augmentation a function of (seed, epoch, sample)); the held-out split is ``eval_root`` when given, else every
10th image of the tree (by its place in the sorted listing), centre-cropped. The model is plain PyTorch:
a stem, ``stages`` residual stages of ``blocks`` BasicBlocks each (channels ``width``, doubled and the
resolution halved at every stage after the first), global average pooling and a linear head; the blocks are
one ``nn.Sequential`` so that a pipeline can split it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mlscale.data.images import AugmentedImages, ImageFolder, Normalize
from mlscale.data.parquet_images import ParquetImages
from mlscale.data.shards import TarShards, shard_paths
from mlscale.errors import UsageError
from mlscale.tasks.base import Task

HELD_OUT_EVERY = 10


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with batch norm and a shortcut (a strided 1x1 convolution where the shape changes)."""

    def __init__(self, channels_in: int, channels: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = nn.Identity() if stride == 1 and channels_in == channels else nn.Sequential(
            nn.Conv2d(channels_in, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, classes: int, width: int = 16, stages: int = 3, blocks: int = 1) -> None:
        super().__init__()
        self.normalize = Normalize()  # uint8 pixels in: scaled and normalised here, on the training device
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, channels = [], width
        for stage in range(stages):
            out = width * 2**stage
            for block in range(blocks):
                layers.append(BasicBlock(channels, out, 2 if stage > 0 and block == 0 else 1))
                channels = out
        self.blocks = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.stem(self.normalize(x))).mean(dim=(2, 3)))


def make_images(root: str = "", size: int = 64, eval_root: str = "", width: int = 16, stages: int = 3,
                blocks: int = 1, seed: int = 0, shards: str = "", image_column: str = "image",
                label_column: str = "label") -> Task:
    """A ResNet-style CNN on ``root``'s images (or ``shards``: WebDataset tar shards or Parquet files of an
    ``image_column`` of encoded images and a ``label_column``; a folder, glob or URL), crops of ``size`` pixels;
    ``seed`` draws the augmentation."""
    if shards:
        return _on_shards(shards, size, width, stages, blocks, seed, image_column, label_column)
    if not root:
        raise UsageError("--task images needs --task-opt root=DIR (a folder of class folders of JPEG/PNG files) "
                         "or --task-opt shards=DIR|GLOB|URL (WebDataset tar shards)")
    listing = ImageFolder(root, size, seed=seed).listing
    if eval_root:
        train = ImageFolder(root, size, seed=seed)
        held_out = ImageFolder(eval_root, size, train=False)
        if held_out.classes != train.classes:
            raise UsageError(f"bad value eval_root={eval_root!r}: its classes differ from root's")
    else:
        every = range(len(listing.files))
        train = ImageFolder(root, size, seed=seed, indices=[i for i in every if i % HELD_OUT_EVERY])
        held_out = ImageFolder(root, size, train=False, indices=[i for i in every if i % HELD_OUT_EVERY == 0])
    classes = len(listing.classes)
    return Task(name="images", build_model=lambda: ResNet(classes, width, stages, blocks), train=train,
                eval=held_out, info={"classes": listing.classes, "size": size})


def _on_shards(shards: str, size: int, width: int, stages: int, blocks: int, seed: int, image_column: str,
               label_column: str) -> Task:
    parquet = shard_paths(shards, ".parquet")
    if parquet and all(path.endswith(".parquet") for path in parquet):
        def read(**options: Any) -> AugmentedImages:
            return ParquetImages(parquet, size, image=image_column, label=label_column, **options)
    else:
        def read(**options: Any) -> AugmentedImages:
            return TarShards(shards, size, **options)
    everything = read(seed=seed)
    every = range(len(everything))
    train = read(seed=seed, indices=[i for i in every if i % HELD_OUT_EVERY])
    held_out = read(train=False, indices=[i for i in every if i % HELD_OUT_EVERY == 0])
    if isinstance(everything, ParquetImages):
        classes, files = int(everything.label.max()) + 1, len(parquet)
    else:
        assert isinstance(everything, TarShards)
        classes, files = int(everything.index.label.max()) + 1, len(everything.index.shards)
    return Task(name="images", build_model=lambda: ResNet(classes, width, stages, blocks), train=train,
                eval=held_out, info={"classes": classes, "size": size, "shards": files})
