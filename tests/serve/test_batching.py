"""Batching requests of several inputs and different lengths, driven directly: padded to the batch's
longest (a mask input), or grouped by shape (none), each request answered with its own rows and length."""

import asyncio
import time

import numpy as np

from mlscale.serve.batcher import DynamicBatcher
from mlscale.serve.batching import Batching, batching_for
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.runtime import TensorSpec


class MaskedTokens:
    """Per token, its id where the mask is 1 and -1 where it is 0 (so an answer shows its padding);
    records the shape of every batch it runs."""

    kind = "test"

    def __init__(self) -> None:
        self.batches: list[tuple[int, ...]] = []

    def run(self, batch: dict[str, np.ndarray]) -> np.ndarray:
        self.batches.append(batch["input_ids"].shape)
        time.sleep(0.005)
        return np.where(batch["attention_mask"] == 1, batch["input_ids"], -1).astype(np.float32)


def _request(length: int, first: int = 1) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(first, first + length)[None], "attention_mask": np.ones((1, length), np.int64)}


def _served(batching: Batching, lengths: list[int]) -> tuple[MaskedTokens, list[np.ndarray]]:
    async def scenario():
        runtime = MaskedTokens()
        batcher = DynamicBatcher(runtime, stats=ServerMetrics().stats_for("m", "1"), max_batch_size=16,
                                 max_delay_s=0.02, queue_limit=64, slo_s=None, timeout_s=10.0, batching=batching)
        answers = await asyncio.gather(*(batcher.submit(_request(n, 10 * i)) for i, n in enumerate(lengths)))
        await batcher.close()
        return runtime, answers

    return asyncio.run(scenario())


def test_padded_requests_share_a_batch_and_each_gets_its_own_length_back():
    sequence = TensorSpec("input_ids", "INT64", (-1, -1))
    batching = batching_for([sequence, TensorSpec("attention_mask", "INT64", (-1, -1))],
                            TensorSpec("output", "FP32", (-1, -1)))
    assert batching == Batching("pad", ("input_ids", "attention_mask"), output_padded=True)
    lengths = [4, 5, 6, 5, 6, 4, 6, 5]
    runtime, answers = _served(batching, lengths)
    assert len(runtime.batches) < len(lengths)  # batched, across lengths: all are within 1.5x of each other
    assert any(width > min(lengths) and rows > 1 for rows, width in runtime.batches)
    for i, (length, answer) in enumerate(zip(lengths, answers)):  # no -1: nothing padded came back
        assert answer.tolist() == [list(range(10 * i, 10 * i + length))]


def test_padding_stops_at_a_spread_of_lengths_and_grouping_never_mixes_shapes():
    lengths = [3, 3, 20, 4, 21, 3, 20]
    runtime, _ = _served(Batching("pad", ("input_ids", "attention_mask")), lengths)
    assert all(width <= 4 or width >= 20 for _, width in runtime.batches)  # 3-4 apart from 20-21
    padding = Batching("pad", ("input_ids",))
    assert padding.admits([4, 6], 5) and not padding.admits([4], 7)
    assert Batching("pad", ("input_ids",), spread=None).admits([3], 70)
    grouping = Batching("group")
    assert not grouping.admits([grouping.key(_request(3))], grouping.key(_request(4)))
    grouped, answers = _served(grouping, lengths)
    assert sum(rows for rows, _ in grouped.batches) == len(lengths)  # every request ran once
    assert any(rows > 1 for rows, _ in grouped.batches)  # the requests of one length shared one
    assert all(answer.shape == (1, n) for answer, n in zip(answers, lengths))


def test_a_model_without_a_mask_is_grouped_and_one_of_fixed_shapes_is_concatenated():
    ids = TensorSpec("input_ids", "INT64", (-1, -1))
    assert batching_for([ids, TensorSpec("weights", "FP32", (-1, -1))], TensorSpec("output", "FP32", (-1, 4))).mode \
        == "group"
    assert batching_for([TensorSpec("input", "FP32", (-1, 64))], TensorSpec("output", "FP32", (-1, 10))) == Batching()
