"""Inputs by position and by name, in process: a model called ``model(*inputs)`` gets a signature of
``input_0, input_1`` (dict keys are tested end to end in tests/serve/test_several_inputs.py), the
sequence its samples differ in is -1, and its ONNX export takes them by those names with the batch and
the sequence dynamic and matches PyTorch on batches of other sizes and lengths. A model of one tensor
keeps the signature it always had."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

from mlscale import PadCollate, Task
from mlscale.export import check_parity, export_onnx
from mlscale.export.session import onnx_session
from mlscale.registry.inputs import call_args, positional
from mlscale.registry.models import signature_of


class Pairs(Dataset):
    """Token ids and a weight per token, 2 to 9 tokens, as a tuple."""

    def __init__(self, size: int) -> None:
        generator = torch.Generator().manual_seed(size)
        lengths = torch.randint(2, 10, (size,), generator=generator)
        self.items = [(torch.randint(0, 20, (int(n),), generator=generator), torch.rand(int(n), generator=generator))
                      for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int):
        return self.items[index], 0


class WeightedTokens(nn.Module):
    """Per token, a score of its embedding times its weight: an output with the sequence in it."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * weights.unsqueeze(-1))


def _task() -> Task:
    torch.manual_seed(0)
    return Task(name="pairs", build_model=WeightedTokens, train=Pairs(16), eval=Pairs(24), collate=PadCollate())


def test_a_tuple_model_is_signed_and_exported_with_its_inputs_by_position_and_a_dynamic_sequence(tmp_path):
    task = _task()
    signature = signature_of({"task": "pairs"}, task)
    assert signature == {
        "inputs": [{"name": "input_0", "datatype": "INT64", "shape": [-1, -1], "range": [0, 19]},
                   {"name": "input_1", "datatype": "FP32", "shape": [-1, -1]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, -1, 3]}]}
    model = task.build_model().eval()
    held_out = task.eval_data()
    export_onnx(model, held_out.batch([0, 1])[0], tmp_path / "model.onnx", signature)
    session = onnx_session(tmp_path / "model.onnx")
    assert [(i.name, i.shape) for i in session.get_inputs()] == [("input_0", ["batch", "sequence"]),
                                                                 ("input_1", ["batch", "sequence"])]
    batches = [held_out.batch(list(range(start, end)))[0] for start, end in ((2, 3), (3, 10), (10, 24))]
    assert len({batch[0].shape[1] for batch in batches}) > 1  # the sequence differs between them
    parity = check_parity(model, tmp_path / "model.onnx", batches)
    assert parity.passed and parity.batch_sizes == [1, 7, 14]


def test_names_say_how_a_model_is_called_and_one_tensor_keeps_its_signature():
    assert positional(["input"]) and positional(["input_0", "input_1"]) and not positional(["input_1", "input_0"])
    assert call_args({"input_0": 1, "input_1": 2}) == ((1, 2), {})
    assert call_args({"input_ids": 1, "attention_mask": 2}) == ((), {"input_ids": 1, "attention_mask": 2})
    assert signature_of({"task": "digits"}) == {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 64]}],
        "outputs": [{"name": "output", "datatype": "FP32", "shape": [-1, 10]}]}
