"""Runtimes: what executes a batch. The server only knows this interface, not how a model was trained.

``onnx`` (onnxruntime, the default when the version has an ONNX artifact) and ``torch`` (eager, in
inference mode). Both take and return numpy arrays whose first dimension is the batch: one array for a
model of one input (``input``), a dict of arrays by input name for a model of several (called by keyword,
or by position for ``input_0, input_1, ...``: ``mlscale.registry.inputs``). Which runtimes
there are, what each loads and how it is named to clients is in one table: ``runtimes.RUNTIMES``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from mlscale.common.dtypes import V2_TO_NAME
from mlscale.export.session import onnx_session
from mlscale.registry.inputs import call_args

Inputs = np.ndarray | dict[str, np.ndarray]  # a batch's inputs: one array, or one per input name
V2_TO_NUMPY = {v2: np.dtype(name) for v2, name in V2_TO_NAME.items() if v2 != "BF16"}
NUMPY_TO_V2 = {dtype: v2 for v2, dtype in V2_TO_NUMPY.items()}


class Runtime(Protocol):
    kind: str
    datatype: str | None  # the datatype the model computes in, when it is not the registered one

    def run(self, batch: Inputs) -> np.ndarray: ...


class OnnxRuntime:
    kind = "onnx"
    datatype = None

    def __init__(self, model: str | bytes, threads: int = 1) -> None:
        """``model``: the ONNX file's bytes (as verified against the registry: what is hashed is what is
        loaded), or a path."""
        self.session = onnx_session(model, threads=threads)

    def run(self, batch: Inputs) -> np.ndarray:
        return self.session.run(["output"], batch if isinstance(batch, dict) else {"input": batch})[0]


class TorchRuntime:
    """Eager torch; ``datatype`` FP16 or BF16 casts the model's weights to it, and inputs and outputs
    are then that datatype (BF16 carried in float32 arrays, as numpy has no bfloat16). A model that
    returns a tuple, dict or ``ModelOutput`` is served its predictions tensor, the one its ONNX export
    outputs (``mlscale.tasks.outputs.predictions``)."""

    kind = "torch"

    def __init__(self, model: Any, threads: int = 1, datatype: str | None = None) -> None:
        import torch

        from mlscale.tasks.outputs import predictions

        torch.set_num_threads(threads)
        self.datatype, self._torch, self._predictions = datatype, torch, predictions
        self._dtype = getattr(torch, V2_TO_NAME[datatype]) if datatype else None
        self.model = model.to(self._dtype) if self._dtype is not None else model

    def run(self, batch: Inputs) -> np.ndarray:
        torch = self._torch
        with torch.inference_mode():
            if isinstance(batch, dict):
                args, kwargs = call_args({name: self._tensor(array) for name, array in batch.items()})
                output = self._predictions(self.model(*args, **kwargs))
            else:
                output = self._predictions(self.model(self._tensor(batch)))
            return (output.float() if output.dtype == torch.bfloat16 else output).numpy()

    def _tensor(self, array: np.ndarray) -> Any:
        tensor = self._torch.from_numpy(array)
        if self._dtype is not None and tensor.is_floating_point():  # token ids and masks stay integers
            tensor = tensor.to(self._dtype)
        return tensor


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # -1 for the batch dimension and any other the model leaves open (a sequence)
    # the values an integer input may take, both ends included, where the model declares them (the ids
    # an embedding has rows for, recorded at registration); None: any value of the datatype
    value_range: tuple[int, int] | None = None

    @cached_property  # read on every request
    def dtype(self) -> np.dtype:
        """The numpy dtype of arrays of this tensor (BF16: float32 arrays of BF16 values)."""
        return np.dtype(np.float32) if self.datatype == "BF16" else V2_TO_NUMPY[self.datatype]
