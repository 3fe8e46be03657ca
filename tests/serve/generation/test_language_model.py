"""Which registered signatures are served as language models: token ids in (alone, or beside the positions
a model trained on packed text takes), logits per position out."""

from __future__ import annotations

from mlscale.serve.generation.language_model import lm_signature


def _tensor(name: str, datatype: str, dims: int) -> dict:
    return {"name": name, "datatype": datatype, "shape": [-1] * dims}


LOGITS = [_tensor("output", "FP32", 3)]


def test_token_ids_alone_or_beside_positions_are_a_language_model():
    assert lm_signature({"inputs": [_tensor("input", "INT64", 2)], "outputs": LOGITS})
    packed = [_tensor("input_ids", "INT64", 2), _tensor("position_ids", "INT64", 2)]
    assert lm_signature({"inputs": packed, "outputs": LOGITS})
    assert lm_signature({"inputs": [*packed, _tensor("attention_mask", "INT64", 2)], "outputs": LOGITS})


def test_other_signatures_are_not():
    assert not lm_signature({"inputs": [], "outputs": LOGITS})
    assert not lm_signature({"inputs": [_tensor("pixels", "FP32", 2)], "outputs": LOGITS})
    two = [_tensor("input_ids", "INT64", 2), _tensor("token_type_ids", "INT64", 2)]  # not positions
    assert not lm_signature({"inputs": two, "outputs": LOGITS})
    assert not lm_signature({"inputs": [_tensor("input_ids", "INT64", 2)], "outputs": [_tensor("y", "FP32", 2)]})
