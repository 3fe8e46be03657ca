"""Data workers stack batches into shared-memory segments they reuse (``mlscale.data.batch_buffers``): the
batches, positions and sample ids are those of fresh segments, a batch the caller keeps (or a view of one) is
never written over, and the segments made stay few however many batches are read."""

from __future__ import annotations

import os

import pytest
import torch

from mlscale.data.dataset import MapData
from mlscale.data.images import ImageFolder, write_image_folder
from mlscale.data.pipeline import DatasetLoader

EPOCH = 4  # batches of 4 of 16 images


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = write_image_folder(tmp_path_factory.mktemp("buffers") / "tree", classes=2, per_class=8, seed=3,
                                sizes=(20, 28))
    return MapData(ImageFolder(folder, size=12, seed=1))


def _loader(data: MapData, buffers: bool = True) -> DatasetLoader:
    return DatasetLoader(data, rank=0, world=1, step_batch=4, seed=0, workers=2, prefetch=2, batch_buffers=buffers)


def _copies(loader: DatasetLoader, count: int) -> list[tuple[torch.Tensor, torch.Tensor, object, list[int]]]:
    """``count`` batches, each copied and let go of before the next (so that the workers may reuse its slots)."""
    read = []
    for _ in range(count):
        images, labels = next(loader)
        assert images.is_shared() and images.is_contiguous(memory_format=torch.channels_last)
        read.append((images.clone(), labels.clone(), loader.position, loader.last_ids.tolist()))
        del images, labels
    return read


def test_reused_buffers_give_the_batches_positions_and_ids_of_fresh_segments(images):
    batches = {}
    for buffers in (True, False):
        loader = _loader(images, buffers)
        try:
            batches[buffers] = _copies(loader, 3 * EPOCH)  # past two epoch boundaries
        finally:
            loader.close()
    for (x, y, position, ids), (fx, fy, fposition, fids) in zip(batches[True], batches[False], strict=True):
        assert torch.equal(x, fx) and torch.equal(y, fy) and position == fposition and ids == fids


def test_a_batch_the_caller_keeps_or_a_view_of_one_is_not_written_over(images):
    loader = _loader(images)
    try:
        kept, _ = next(loader)
        kept_copy = kept.clone()
        row = next(loader)[1][1:3]  # a view of the second batch's labels: the batch itself is dropped
        row_copy = row.clone()
        _copies(loader, 5 * EPOCH)
    finally:
        loader.close()
    assert torch.equal(kept, kept_copy) and torch.equal(row, row_copy)


def _inode(tensor: torch.Tensor) -> int:
    fd, _ = tensor.untyped_storage()._share_fd_cpu_()  # the segment's file descriptor in this process
    return os.fstat(fd).st_ino


def test_the_shared_memory_segments_made_stay_few_over_many_batches(images):
    loader = _loader(images)
    segments = set()
    try:
        for _ in range(10 * EPOCH):
            batch = next(loader)
            segments.update(_inode(tensor) for tensor in batch)
            del batch
    finally:
        loader.close()
    # 80 tensors read; each worker made a segment for its images and its labels for each batch it had out
    # at once (2 prefetched, the one being made, the one the caller holds)
    assert len(segments) <= 2 * 2 * 4
