"""The anchor: a plain, hand-written torch DDP training loop, as a user would write it.

Same model, data, optimizer and batch as our trainer is given in the benchmark; throughput is measured
the same way (rank 0, from the end of the warm-up steps to the end of the last step).
Run as ``python -m mlscale.bench.plain_ddp OUT.json TASK_JSON STEPS BATCH WARMUP`` under a launcher.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from mlscale.tasks import make_task


def main(argv: list[str]) -> None:
    out, task_json, steps, batch, warmup = argv[0], json.loads(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world > 1:
        dist.init_process_group("gloo")
    task = make_task(task_json["name"], task_json["options"])
    torch.manual_seed(0)
    model = task.build_model()
    if world > 1:
        model = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=task_json["lr"], momentum=0.9)
    sampler = DistributedSampler(range(len(task.train)), num_replicas=world, rank=rank, shuffle=True, drop_last=True)
    step, epoch, start = 0, 0, None
    while step < steps:
        sampler.set_epoch(epoch)
        indices = torch.tensor(list(sampler))
        for i in range(0, len(indices) - batch + 1, batch):
            idx = indices[i:i + batch]
            loss = torch.nn.functional.cross_entropy(model(task.train.inputs[idx]), task.train.targets[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step == warmup:
                start = time.perf_counter()
            if step == steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"samples_per_s": (steps - warmup) * batch * world / elapsed}, handle)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
