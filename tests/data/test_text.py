"""Text for language models (``mlscale.data.text``): documents from JSONL, Parquet or text files tokenized once
with a tokenizer trained here, packed into windows that keep documents apart: a document packed after
another gets the outputs it gets alone, from tinylm and from a Hugging Face Llama; and ``--task text``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mlscale.data.text import PackedText, position_ids, tokenize, train_tokenizer
from mlscale.data.tokens import count_documents, document_range, documents, source_files
from mlscale.errors import UsageError
from mlscale.tasks import make_task
from mlscale.tasks.tinylm import TinyLM, make_corpus
from tests.helpers import run_cli

DOCS = [make_corpus(120 + 40 * (i % 5), seed=i) for i in range(60)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("text")
    with open(root / "docs.jsonl", "w") as out:
        out.writelines(json.dumps({"text": doc}) + "\n" for doc in DOCS)
    train_tokenizer(DOCS, root / "tokenizer.json", vocab_size=200)
    return root


@pytest.fixture(autouse=True)
def token_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLSCALE_CACHE_DIR", str(tmp_path / "cache"))


def test_positions_start_again_after_each_end_of_document():
    ends = torch.tensor([False, False, True, False, True, True, False])
    assert position_ids(ends).tolist() == [0, 1, 2, 0, 1, 0, 0]


def test_documents_are_read_alike_from_jsonl_parquet_and_text_files(corpus, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": DOCS[:5], "other": list(range(5))}), tmp_path / "docs.parquet")
    folder = tmp_path / "folder"
    folder.mkdir()
    for i, doc in enumerate(DOCS[:5]):
        (folder / f"{i:02d}.txt").write_text(doc)
    assert list(documents(source_files(str(tmp_path / "docs.parquet")))) == DOCS[:5]
    assert list(documents(source_files(str(folder)))) == DOCS[:5]
    assert list(documents(source_files(str(corpus / "docs.jsonl"))))[:5] == DOCS[:5]
    with pytest.raises(UsageError, match=r"no \.jsonl, \.parquet, \.txt, \.md files there"):
        source_files(str(tmp_path / "nothing"))


def test_the_text_is_tokenized_once_and_again_when_a_file_changes(corpus, tmp_path):
    tokens, meta = tokenize(str(corpus / "docs.jsonl"), str(corpus / "tokenizer.json"))
    assert meta["documents"] == len(DOCS) and len(tokens) == meta["tokens"]
    assert int((torch.from_numpy(tokens.copy()) == meta["end"]).sum()) == len(DOCS)
    again, _ = tokenize(str(corpus / "docs.jsonl"), str(corpus / "tokenizer.json"))
    assert again.filename == tokens.filename  # memory-mapped from what the first call made
    changed = tmp_path / "docs.jsonl"
    changed.write_text(json.dumps({"text": DOCS[0]}) + "\n")
    other, other_meta = tokenize(str(changed), str(corpus / "tokenizer.json"))
    assert other.filename != tokens.filename and other_meta["documents"] == 1


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """A folder of JSONL (a blank line in it), Parquet (a null in it) and text files: ranges of documents cross
    files and start inside them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("mixed")
    lines = [json.dumps({"text": doc}) + "\n" for doc in DOCS[:25]]
    (root / "a.jsonl").write_text("".join(lines[:10]) + "\n" + "".join(lines[10:]))
    pq.write_table(pa.table({"text": [*DOCS[25:30], None, *DOCS[30:35]]}), root / "b.parquet")
    (root / "c.txt").write_text(DOCS[35])
    (root / "d.jsonl").write_text("".join(json.dumps({"text": doc}) + "\n" for doc in DOCS[36:]))
    return root


def test_a_range_of_documents_is_that_slice_of_them_without_opening_the_files_before(mixed):
    files = source_files(str(mixed))
    every = list(documents(files))
    counts = [count_documents(name) for name in files]
    assert every == DOCS and counts == [25, 10, 1, 24]
    for start, stop in ((0, 60), (3, 12), (25, 26), (30, 36), (35, 37), (59, 60), (20, 20)):
        assert list(document_range(files, counts, start, stop)) == every[start:stop]
    assert list(document_range([files[0], "gone.jsonl"], [25, 5], 0, 25)) == DOCS[:25]  # not opened


def test_tokens_made_by_two_worker_processes_are_the_bytes_one_process_makes(mixed, corpus, tmp_path, monkeypatch):
    made = {}
    for workers in (0, 2):
        monkeypatch.setenv("MLSCALE_CACHE_DIR", str(tmp_path / f"cache-{workers}"))
        tokens, meta = tokenize(str(mixed), str(corpus / "tokenizer.json"), workers=workers)
        made[workers] = (Path(tokens.filename).read_bytes(), meta)
        assert not [p for p in Path(tokens.filename).parent.iterdir() if p.name.startswith(".")]  # no parts left
    assert made[2] == made[0] and made[0][1]["documents"] == len(DOCS)


def test_data_workers_is_the_runs_setting_not_a_task_option(corpus):
    with pytest.raises(UsageError, match="gives task 'text' its --data-workers"):
        make_task("text", {"path": str(corpus / "docs.jsonl"), "tokenizer": str(corpus / "tokenizer.json"),
                           "data_workers": 2})


def _second_document(window: dict, targets: torch.Tensor) -> slice:
    """The first document that begins inside the window (after its first token), to its end or the window's."""
    starts = [i for i in range(1, len(targets)) if int(window["position_ids"][i]) == 0]
    return slice(starts[0], starts[1] if len(starts) > 1 else len(targets))


def _packed(corpus):
    tokens, meta = tokenize(str(corpus / "docs.jsonl"), str(corpus / "tokenizer.json"))
    data = PackedText(tokens, 48, meta["end"])
    for index in range(len(data)):
        window, targets = data[index]
        if bool((window["position_ids"][1:] == 0).any()):
            return data, window, targets, meta
    raise AssertionError("no window where a document begins after its first token")


def test_a_packed_document_gets_the_outputs_it_gets_alone_from_tinylm(corpus):
    _, window, targets, meta = _packed(corpus)
    part = _second_document(window, targets)
    torch.manual_seed(0)
    model = TinyLM(meta["vocab"], 32, 2, 4, 48, 64).double().eval()
    with torch.no_grad():
        packed = model(window["input_ids"][None], window["position_ids"][None])[0, part]
        alone = model(window["input_ids"][None, part])[0]
    assert torch.allclose(packed, alone, atol=1e-12)
    seam = part.start - 1  # the previous document's end token: its target, this document's first, is ignored
    assert targets[seam] == -100 and window["input_ids"][seam] == meta["end"]


def test_a_packed_document_gets_the_outputs_it_gets_alone_from_a_hugging_face_llama(corpus):
    from transformers import LlamaConfig, LlamaForCausalLM

    _, window, targets, meta = _packed(corpus)
    part = _second_document(window, targets)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=meta["vocab"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():
        # Packed sequences are read from the position ids when no cache is kept (what training with
        # use_cache=False does; a model kept for generation keeps one, and attends across documents).
        packed = model(input_ids=window["input_ids"][None], position_ids=window["position_ids"][None],
                       use_cache=False).logits[0, part]
        alone = model(input_ids=window["input_ids"][None, part], use_cache=False).logits[0]
    assert torch.allclose(packed, alone, atol=1e-10)


def test_task_text_trains_tinylm_on_the_files(corpus, tmp_path):
    result = run_cli("train", "--task", "text", "--task-opt", f"path={corpus / 'docs.jsonl'}",
                     "--task-opt", f"tokenizer={corpus / 'tokenizer.json'}", "--task-opt", "seq_len=32",
                     "--task-opt", "dim=32", "--task-opt", "layers=2", "--workers", "2", "--batch-size", "8",
                     "--steps", "20", "--data-workers", "1", "--no-progress", "--run-dir", str(tmp_path / "run"),
                     timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("in 1 data-worker process") == 1  # once, before the training workers start
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["data"]["dataset"] == "PackedText" and report["eval"]["perplexity"] < meta_vocab(corpus)


def meta_vocab(corpus) -> int:
    return json.loads((corpus / "tokenizer.json").read_text())["model"]["vocab"].__len__()
