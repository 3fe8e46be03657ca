"""``mlscale bench data --suite images``: images/s of decoding and augmenting JPEGs, side by side.

On a generated folder of JPEGs (``--images``, 128-256 px, 10 classes; made by the benchmark), every system
does the same per image: decode, a random resized crop to ``--crop`` px (area 8-100%, ratio 3/4-4/3), a
horizontal flip half the time, scaling to [0, 1] and normalising; batches of 64. Measured, interleaved in
every repeat, medians of ``--repeats``:

- mlscale: ``ImageFolder`` through its loader at ``--data-workers auto`` (the tuning timed apart; its items are
  uint8, normalised by the model's first layer on the training device, which this benchmark leaves out: a
  few microseconds of an accelerator's time a batch), and with
  ``--data-threads`` 2 and one per core (threads of one process instead of worker processes);
- PyTorch: ``DataLoader`` over an ImageFolder-style Dataset written as users write it (Pillow, the worker's
  own random numbers), at each ``num_workers`` in 0, 1, 2, 4... up to the cores: the best is the anchor;
- tf.data: ``from_tensor_slices`` + ``map(num_parallel_calls=AUTOTUNE)`` + ``batch`` + ``prefetch(AUTOTUNE)``
  with ``decode_jpeg``, ``sample_distorted_bounding_box``, ``resize``, ``random_flip_left_right``, in its
  own environment (``--tf-python``: a Python with tensorflow-cpu; ``make bench-tf-env`` makes one);
- the ceiling: the same decode and augmentation in a tight loop, one process per core, no loader.

With ``--s3`` (moto's S3 server on 127.0.0.1), mlscale reading the same images from a bucket, first and
second epoch, with its local copies (``--data-cache-mb``), and the bytes fetched from the server.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from mlscale.bench.data_loaders import anchor_workers
from mlscale.data.dataset import MapData
from mlscale.data.images import ImageFolder, write_image_folder

BATCH = 64
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_jpegs(root: Path, count: int, seed: int = 0) -> Path:
    if not (root / ".complete").exists():
        write_image_folder(root, classes=10, per_class=max(1, count // 10), seed=seed, sizes=(128, 256))
        (root / ".complete").touch()
    return root


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _timed(batches: Any, count: int, warmup: int) -> float:
    """Images a second over ``count`` batches after ``warmup`` (worker start-up among them)."""
    iterator = iter(batches)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(count):
        next(iterator)
    return count * BATCH / (time.perf_counter() - start)


def measure_mlscale(root: str, crop: int, batches: int, warmup: int, workers: int | str = "auto",
                    cache_dir: Path | None = None, cache_mb: int = 0) -> dict[str, Any]:
    from mlscale.data.pipeline import DatasetLoader, autotune_workers

    dataset = ImageFolder(root, crop, seed=0)
    if cache_dir is not None and cache_mb:
        dataset.use_object_cache(cache_dir, cache_mb * 2**20)
    data = MapData(dataset)

    def make(n: int) -> DatasetLoader:
        return DatasetLoader(data, rank=0, world=1, step_batch=BATCH, seed=0, workers=n, prefetch=2)

    tuning_s, picked = 0.0, workers
    if workers == "auto":
        start = time.perf_counter()
        picked, _ = autotune_workers(make)
        tuning_s = time.perf_counter() - start
    loader = make(int(picked))
    try:
        rate = _timed(loader, batches, warmup)
    finally:
        loader.close()
    return {"images_per_s": rate, "workers": int(picked), "tuning_s": tuning_s}


def measure_threads(root: str, crop: int, batches: int, warmup: int, threads: int) -> dict[str, Any]:
    """mlscale's loader with ``--data-threads``: the items decoded by threads of this process (Pillow releases
    the GIL while it decodes and resizes)."""
    from mlscale.data.threads import ThreadLoader

    loader = ThreadLoader(MapData(ImageFolder(root, crop, seed=0)), rank=0, world=1, step_batch=BATCH, seed=0,
                          threads=threads)
    try:
        return {"images_per_s": _timed(loader, batches, warmup), "threads": threads}
    finally:
        loader.close()


class PlainImageFolder(Dataset[tuple[torch.Tensor, int]]):
    """An ImageFolder-style Dataset as users write one for a DataLoader: Pillow, torchvision's
    RandomResizedCrop rule drawn from the process's own random numbers, a flip, normalisation."""

    def __init__(self, root: str, crop: int) -> None:
        classes = sorted(entry.name for entry in os.scandir(root) if entry.is_dir() and not entry.name.startswith("."))
        self.samples = [(os.path.join(root, name, file), label) for label, name in enumerate(classes)
                        for file in sorted(os.listdir(os.path.join(root, name))) if file.endswith(".jpg")]
        self.crop = crop
        self.mean, self.std = torch.tensor(MEAN).view(3, 1, 1), torch.tensor(STD).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            image = image.convert("RGB")
            box = _random_box(*image.size)
            image = image.resize((self.crop, self.crop), Image.Resampling.BILINEAR, box=box)
            if random.random() < 0.5:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        tensor = pixels.view(self.crop, self.crop, 3).permute(2, 0, 1).float().div_(255)
        return tensor.sub_(self.mean).div_(self.std), label


def _random_box(width: int, height: int) -> tuple[int, int, int, int]:
    area = width * height
    for _ in range(10):
        target = area * random.uniform(0.08, 1.0)
        aspect = math.exp(random.uniform(math.log(3 / 4), math.log(4 / 3)))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            left, top = random.randint(0, width - w), random.randint(0, height - h)
            return left, top, left + w, top + h
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, (width + side) // 2, (height + side) // 2


def measure_torch(root: str, crop: int, batches: int, warmup: int, workers: int) -> dict[str, Any]:
    loader = DataLoader(PlainImageFolder(root, crop), batch_size=BATCH, shuffle=True, drop_last=True,
                        num_workers=workers, persistent_workers=workers > 0,
                        prefetch_factor=2 if workers else None)

    def forever() -> Any:
        while True:
            yield from loader

    return {"images_per_s": _timed(forever(), batches, warmup), "workers": workers}


TF_SCRIPT = r'''
import json, os, sys, time
import tensorflow as tf
root, crop, batches, warmup = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)) and not d.startswith("."))
paths, labels = [], []
for label, name in enumerate(classes):
    for file in sorted(os.listdir(os.path.join(root, name))):
        if file.endswith(".jpg"):
            paths.append(os.path.join(root, name, file)); labels.append(label)
mean, std = tf.constant([0.485, 0.456, 0.406]), tf.constant([0.229, 0.224, 0.225])
def load(path, label):
    data = tf.io.read_file(path)
    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(shape, tf.zeros([0, 0, 4]), area_range=(0.08, 1.0),
        aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10, use_image_if_no_bounding_boxes=True)
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    image = tf.io.decode_and_crop_jpeg(data, window, channels=3)
    image = tf.image.resize(image, (crop, crop), method="bilinear")
    image = tf.image.random_flip_left_right(image)
    return (image / 255.0 - mean) / std, label
data = (tf.data.Dataset.from_tensor_slices((paths, labels)).shuffle(len(paths)).repeat()
        .map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(64, drop_remainder=True).prefetch(tf.data.AUTOTUNE))
iterator = iter(data)
for _ in range(warmup):
    next(iterator)
start = time.perf_counter()
for _ in range(batches):
    next(iterator)
print(json.dumps({"images_per_s": batches * 64 / (time.perf_counter() - start), "tensorflow": tf.__version__}))
'''


def measure_tf(python: str, root: str, crop: int, batches: int, warmup: int) -> dict[str, Any]:
    """tf.data in its own interpreter (TensorFlow's dependencies need not agree with mlscale's)."""
    result = subprocess.run([python, "-c", TF_SCRIPT, root, str(crop), str(batches), str(warmup)],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "CUDA_VISIBLE_DEVICES": ""})
    if result.returncode != 0:
        raise RuntimeError(f"tf.data run failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


_CEILING: dict[str, Any] = {}


def _ceiling_start(root: str, crop: int) -> None:
    """A ceiling process: one core (as a data worker), the images listed once."""
    torch.set_num_threads(1)
    _CEILING["data"] = ImageFolder(root, crop, seed=0)


def _ceiling_share(indices: list[int]) -> int:
    data = _CEILING["data"]
    for index in indices:
        data.item_for_epoch(index, 0)
    return len(indices)


def _ceiling_ready(_: int) -> int:
    time.sleep(0.2)  # every process takes one: all of them are up before the timing starts
    return os.getpid()


def measure_ceiling(root: str, crop: int, images: int) -> dict[str, Any]:
    """The same decode and augmentation (mlscale's own code, no loader, no batching) in one process per core,
    each on its own share of ``images`` images: what the cores can do."""
    total = min(images, len(ImageFolder(root, crop)))
    processes = cores()
    shares = [list(range(p, total, processes)) for p in range(processes)]
    # spawned, not forked (a child forked from a process whose torch thread pool runs can deadlock); all of
    # them started and warm before the clock starts
    with multiprocessing.get_context("spawn").Pool(processes, _ceiling_start, (root, crop)) as pool:
        pool.map(_ceiling_ready, range(processes), chunksize=1)
        pool.map(_ceiling_share, [share[:4] for share in shares], chunksize=1)
        start = time.perf_counter()
        done = sum(pool.map(_ceiling_share, shares, chunksize=1))
    return {"images_per_s": done / (time.perf_counter() - start), "processes": processes}


def end_to_end(root: Path, crop: int, steps: int) -> dict[str, Any]:
    """``--task images`` trained by 2 workers with ``--data-workers auto``: each rank's median data wait and step,
    from the run's report (what a user sees: is the run input-bound?)."""
    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    with tempfile.TemporaryDirectory(prefix="mlscale-bench-e2e-") as scratch:
        report = fit(build_config(task="images", task_options={"root": str(root), "size": crop}, workers=2,
                                  batch_size=32, steps=steps, data_workers="auto", progress=False, log_every=10,
                                  run_dir=str(Path(scratch) / "run")))
    ranks = [{"rank": r["rank"], "data_wait_ms_p50": r["data_wait_ms_p50"], "step_ms_p50": r["step_ms_p50"],
              "data_wait_share": r["data_wait_ms_p50"] / r["step_ms_p50"]} for r in report["per_rank"]]
    return {"per_rank": ranks, "samples_per_s": report["samples_per_s"], "data_workers": report["data"]["workers"],
            "input_bound": report["data"]["input_bound"]}


RSS_SCRIPT = r'''
import json, os, sys
from mlscale.data.dataset import MapData
from mlscale.data.pipeline import DatasetLoader
from mlscale.data.parquet_images import ParquetImages
from mlscale.data.shards import TarShards
shards, batches, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
dataset = TarShards(shards, 32, seed=0) if kind == "tar" else ParquetImages(shards, 32, seed=0)
loader = DatasetLoader(MapData(dataset), rank=0, world=1, step_batch=64, seed=0, workers=2)
for _ in range(batches):
    next(loader)
def rss(pid):
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024
def parent(pid):
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[1])
children = [int(d) for d in os.listdir("/proc") if d.isdigit() and parent(d) == os.getpid()]
print(json.dumps({"main_bytes": rss(os.getpid()), "workers_bytes": sum(rss(c) for c in children)}))
loader.close()
'''


def rss_at_scale(folder: Path, counts: tuple[int, int], batches: int = 40) -> dict[str, Any]:
    """The resident memory of a process reading shards through 2 data workers (``batches`` batches of 64), for
    ``counts[0]`` and ``counts[1]`` images, as WebDataset tar shards of 1,000 and as Parquet files of 1,000 rows
    in row groups of 100: does memory grow with the data set? (A tar index is 20 bytes an image, kept as arrays;
    Parquet's row-group map and labels about as much; a process keeps the row groups it is reading.)"""
    from mlscale.data.parquet_images import write_parquet_images
    from mlscale.data.shards import write_tar_shards

    measured: dict[str, dict[str, Any]] = {"tar": {}, "parquet": {}}
    for count in counts:
        images = write_image_folder(folder / f"rss-{count}", classes=10, per_class=count // 10, sizes=(32, 48))
        written = {"tar": write_tar_shards(images, folder / f"rss-shards-{count}", per_shard=1000),
                   "parquet": write_parquet_images(images, folder / f"rss-parquet-{count}", per_file=1000,
                                                   per_group=100)}
        for kind, files in written.items():
            result = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(files[0].parent), str(batches), kind],
                                    capture_output=True, text=True, timeout=600)
            if result.returncode != 0:
                raise RuntimeError(f"the RSS run failed: {result.stderr.strip().splitlines()[-1:]}")
            measured[kind][str(count)] = json.loads(result.stdout.strip().splitlines()[-1])

    def ratio(kind: str) -> float:
        small, large = (measured[kind][str(c)]["main_bytes"] + measured[kind][str(c)]["workers_bytes"] for c in counts)
        return large / small

    return {"images": list(counts), "rss": measured["tar"], "large_over_small": ratio("tar"),
            "parquet_rss": measured["parquet"], "parquet_large_over_small": ratio("parquet")}


def s3_epochs(root: Path, crop: int, batches: int, workers: int) -> dict[str, Any]:
    """The images in moto's S3 server on 127.0.0.1: mlscale's first epoch (fetching), its second (local copies),
    and how many objects were fetched in the first (each once: the cache then holds one file per image)."""
    from moto.server import ThreadedMotoServer
    from s3fs import S3FileSystem

    with tempfile.TemporaryDirectory(prefix="mlscale-bench-s3-") as scratch:
        port = _free_port()
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        saved = dict(os.environ)
        os.environ.update({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
                           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                           "MLSCALE_CACHE_DIR": scratch})
        try:
            fs = S3FileSystem(skip_instance_cache=True)
            fs.mkdir("bench")
            fs.put(str(root), "bench/images", recursive=True)
            epoch = len([p for p in root.rglob("*.jpg")]) // BATCH
            runs = {}
            cache = Path(scratch) / "objects"
            for name in ("first", "second"):
                runs[name] = measure_mlscale("s3://bench/images", crop, min(batches, epoch - 1), 1, workers,
                                             cache_dir=cache, cache_mb=100_000)
            fetched = len(list(cache.iterdir()))
        finally:
            os.environ.clear()
            os.environ.update(saved)
            server.stop()
    return {**runs, "objects_fetched": fetched}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run_suite(args: Any, say: Any) -> dict[str, Any]:
    """The images section of ``mlscale bench data``: each system's images/s, medians over repeats."""
    with tempfile.TemporaryDirectory(prefix="mlscale-bench-images-") as scratch:
        root = make_jpegs(Path(args.image_dir or scratch) / f"jpegs-{args.images}", args.images)
        systems: dict[str, Any] = {"mlscale auto": lambda: measure_mlscale(str(root), args.crop, args.batches,
                                                                          args.warmup)}
        for n in sorted({2, cores()}):
            systems[f"mlscale threads {n}"] = lambda n=n: measure_threads(str(root), args.crop, args.batches,
                                                                          args.warmup, n)
        for n in anchor_workers():  # the loaders suite's: 0, 1, 2, then 4, 8... up to the cores
            systems[f"torch {n}"] = lambda n=n: measure_torch(str(root), args.crop, args.batches, args.warmup, n)
        if args.tf_python:
            systems["tf.data"] = lambda: measure_tf(args.tf_python, str(root), args.crop, args.batches, args.warmup)
        # at least 2,000 images: the processes' start and the last stragglers are a small part of the time
        systems["ceiling"] = lambda: measure_ceiling(str(root), args.crop, max(2000, args.batches * BATCH))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in systems}
        for repeat in range(args.repeats):
            for name in systems if repeat % 2 == 0 else list(systems)[::-1]:
                runs[name].append(systems[name]())
                say(f"images repeat {repeat + 1}/{args.repeats}  {name:<13} {runs[name][-1]['images_per_s']:,.0f} "
                    "images/s")
        s3 = s3_epochs(root, args.crop, args.batches, workers=2) if args.s3 else None
        trained = end_to_end(root, args.crop, args.train_steps) if args.train_steps else None
        memory = rss_at_scale(Path(scratch), (args.rss_images, 10 * args.rss_images)) if args.rss_images else None
    medians = {name: statistics.median(r["images_per_s"] for r in group) for name, group in runs.items()}
    torch_best = max((name for name in medians if name.startswith("torch")), key=lambda n: medians[n])
    ours = medians["mlscale auto"]
    result: dict[str, Any] = {
        "how": (f"{args.images:,} generated JPEGs of 128-256 px; per image: decode, random resized crop to "
                f"{args.crop} px, flip, normalise; batches of {BATCH}, {args.batches} timed after {args.warmup} "
                f"warm-up; {args.repeats} interleaved repeats, medians. mlscale: ImageFolder through its loader at "
                "--data-workers auto (tuning timed apart), uint8 items normalised by the model's first layer on the "
                "device (not timed here: a few microseconds of an accelerator's time a batch); --data-threads 2 and "
                "one per core; torch: DataLoader over an ImageFolder-style Dataset "
                "at num_workers 0, 1, 2, 4... up to the cores, the best one the anchor; tf.data: AUTOTUNE map + "
                "prefetch with decode_and_crop_jpeg; ceiling: mlscale's decode and augmentation in a loop, one "
                "process per core, no loader"),
        "images": args.images, "crop": args.crop, "batch": BATCH, "repeats": args.repeats,
        "images_per_s": medians, "runs": runs, "anchor_torch": torch_best,
        "vs_torch_best": ours / medians[torch_best], "vs_ceiling": ours / medians["ceiling"],
    }
    if "tf.data" in medians:
        result["vs_tf_data"] = ours / medians["tf.data"]
    if s3 is not None:
        result["s3"] = {**s3, "second_vs_local": s3["second"]["images_per_s"] / ours}
    if trained is not None:
        result["end_to_end"] = trained
    if memory is not None:
        result["memory_at_10x"] = memory
    return result


def plot_images(left: Any, right: Any, section: dict[str, Any]) -> None:
    """images/s by system (the anchor's best torch setting, tf.data, the ceiling), and S3's epochs vs local."""
    rates = section["images_per_s"]
    shown = ["mlscale auto", section["anchor_torch"], *[n for n in ("tf.data", "ceiling") if n in rates]]
    colors = ["tab:blue", "grey", "tab:orange", "black"][:len(shown)]
    bars = left.bar(shown, [rates[n] for n in shown], color=colors)
    left.bar_label(bars, fmt="%.0f")
    left.set_ylabel("images/s")
    left.set_title(f"images: decode + {section['crop']} px crop + flip + normalise (medians)", fontsize=9)
    s3 = section.get("s3")
    if not s3:
        right.axis("off")
        return
    names = ["local", "S3 epoch 1", "S3 epoch 2"]
    values = [rates["mlscale auto"], s3["first"]["images_per_s"], s3["second"]["images_per_s"]]
    bars = right.bar(names, values, color=["tab:blue", "tab:purple", "tab:green"])
    right.bar_label(bars, fmt="%.0f")
    right.set_ylabel("images/s")
    right.set_title(f"mlscale from moto's S3 server: {s3['objects_fetched']:,} objects fetched in epoch 1", fontsize=9)


__all__ = ["make_jpegs", "measure_ceiling", "measure_mlscale", "measure_tf", "measure_torch", "plot_images",
           "run_suite"]
