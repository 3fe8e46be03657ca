"""Images read from object storage: a real S3-compatible server (moto's standalone server, as s3fs tests
itself) on 127.0.0.1, reached through s3fs configured the standard way (AWS_ENDPOINT_URL and keys in the
environment). The listing and the decoded tensors equal the local folder's; the local copies bounded in
bytes serve the second epoch (the objects deleted from the bucket after the first); a missing bucket or a
vanished object is one line naming it; a 2-worker training run with data workers reads from the bucket."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from mlscale.data.dataset import MapData, SampleError
from mlscale.data.images import ImageFolder, write_image_folder
from mlscale.data.storage import ObjectCache, with_retries
from mlscale.errors import UsageError
from tests.helpers import free_port, run_cli

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server holding ``bucket/tree/CLASS/IMAGE.jpg``, and the environment that reaches it."""
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    environ = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
               "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "MLSCALE_CACHE_DIR": str(tmp_path_factory.mktemp("listings"))}
    saved = {key: os.environ.get(key) for key in environ}
    os.environ.update(environ)
    local = write_image_folder(tmp_path_factory.mktemp("images") / "tree", classes=3, per_class=12, seed=2)
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.mkdir("bucket")
    fs.put(str(local), "bucket/tree", recursive=True)
    yield local, fs, environ
    server.stop()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def test_a_bucket_lists_and_decodes_like_the_local_folder(s3):
    local, _, _ = s3
    remote, here = ImageFolder("s3://bucket/tree", size=24, seed=3), ImageFolder(local, size=24, seed=3)
    assert remote.listing == here.listing and len(remote) == 36
    for index in (0, 17, 35):
        assert torch.equal(remote.item_for_epoch(index, 2)[0], here.item_for_epoch(index, 2)[0])


def test_the_local_copies_serve_the_second_epoch_and_stay_within_their_bound(s3, tmp_path):
    _, fs, _ = s3
    fs.copy("bucket/tree", "bucket/gone", recursive=True)
    data = ImageFolder("s3://bucket/gone", size=16)
    data.use_object_cache(tmp_path / "objects", limit_bytes=10**8)
    first = [data.item_for_epoch(i, 0)[0] for i in range(len(data))]  # each object's bytes read once
    assert len(list((tmp_path / "objects").iterdir())) == len(data)
    fs.rm("bucket/gone", recursive=True)
    assert all(torch.equal(data.item_for_epoch(i, 0)[0], first[i]) for i in range(len(data)))
    small = ObjectCache(tmp_path / "small", limit_bytes=3 * 5000)
    for n in range(40):
        small.put(f"s3://x/{n}", bytes(2000))
    small.trim()
    assert small.size_bytes <= 3 * 5000 and small.get("s3://x/39") is not None  # the newest kept


def test_a_missing_bucket_is_one_line():
    with pytest.raises(UsageError, match=r"bad value root='s3://no-such-bucket/tree': cannot list it"):
        ImageFolder("s3://no-such-bucket/tree", size=16)


def test_an_object_that_vanished_names_the_file(s3):
    _, fs, _ = s3
    fs.copy("bucket/tree", "bucket/vanishing", recursive=True)
    data = MapData(ImageFolder("s3://bucket/vanishing", size=16))
    fs.rm("bucket/vanishing/class_1/img_00004.jpg")
    with pytest.raises(SampleError, match=r"sample 16 of the training Dataset: ValueError: cannot read or decode "
                                          r"class_1/img_00004\.jpg \(FileNotFoundError"):
        data.batch([15, 16])


def test_reads_are_retried_on_errors_that_pass_and_not_on_a_missing_object():
    calls = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection reset")
        return "bytes"

    assert with_retries("reading x", flaky, backoff_s=0.001) == "bytes" and len(calls) == 3
    with pytest.raises(FileNotFoundError):
        with_retries("reading y", lambda: (_ for _ in ()).throw(FileNotFoundError("y")), backoff_s=0.001)
    with pytest.raises(OSError, match="reading z: failed 2 times, the last with TimeoutError"):
        with_retries("reading z", lambda: (_ for _ in ()).throw(TimeoutError("slow")), tries=2, backoff_s=0.001)


def test_two_workers_train_on_images_in_a_bucket_with_data_workers(s3, tmp_path):  # s3: the server, the environment
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "images", "--task-opt", "root=s3://bucket/tree", "--task-opt", "size=16",
                     "--task-opt", "width=8", "--workers", "2", "--batch-size", "4", "--epochs", "2",
                     "--data-workers", "1", "--data-cache-mb", "64", "--no-progress", "--run-dir", str(run_dir),
                     timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["data"]["dataset"] == "ImageFolder" and report["steps"] == 8  # 32 training images / (2 x 4), x 2
    copies = list(Path(run_dir / "data-cache" / "objects").iterdir())
    assert 32 <= len(copies) <= 36  # each training object once (and the held-out ones the eval may read)


def test_tar_shards_in_a_bucket_read_their_members_by_range_like_local_shards(s3, tmp_path):
    from mlscale.data.shards import TarShards, write_tar_shards

    local, fs, _ = s3
    shards = write_tar_shards(local, tmp_path / "shards", per_shard=10)
    for path in shards:
        fs.put(str(path), f"bucket/shards/{path.name}")
    remote, here = TarShards("s3://bucket/shards", size=16, seed=1), TarShards(tmp_path / "shards", size=16, seed=1)
    assert len(remote) == len(here) == 36 and remote.index.names == here.index.names
    for index in (0, 11, 35):
        assert torch.equal(remote.item_for_epoch(index, 1)[0], here.item_for_epoch(index, 1)[0])


def test_two_ranks_fetch_tar_shards_whole_each_only_its_own_once(s3, tmp_path):
    """With a cache (``--data-cache-mb``), a remote shard is fetched whole into it (one request, not one a
    member) by the rank whose pieces hold it: 24 shards of 10 images, 2 ranks, 12 shards each, none twice."""
    from mlscale.data.sampler import shard_indices
    from mlscale.data.shards import TarShards, write_tar_shards

    _, fs, _ = s3
    folder = write_image_folder(tmp_path / "tree", classes=4, per_class=60, seed=4, sizes=(16, 24))
    for path in write_tar_shards(folder, tmp_path / "shards", per_shard=10):
        fs.put(str(path), f"bucket/many/{path.name}")
    fetched = []
    for rank in range(2):
        data = TarShards("s3://bucket/many", size=8, seed=1)
        data.use_object_cache(tmp_path / f"cache{rank}", 2**24)
        for index in shard_indices(len(data), rank, 2, seed=0, epoch=0, shards=data.sample_shards()).tolist():
            assert data.file(index).read(2) == b"\xff\xd8"  # a JPEG's first bytes
        fetched.append({path.name for path in (tmp_path / f"cache{rank}").iterdir() if not path.suffix})
    assert len(fetched[0]) == len(fetched[1]) == 12 and not fetched[0] & fetched[1]
