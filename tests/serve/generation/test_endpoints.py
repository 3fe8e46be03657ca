"""The generation endpoints of a real server, asked by clients nobody here wrote: the ``openai`` package
(completions, chat, streaming with usage) and plain ``curl`` (the Open Inference Protocol's generate and
generate_stream). A tiny Llama (registered by ``mlscale models register`` with a character tokenizer and a
generation config holding a chat template) and a tiny GPT-2 (no tokenizer: token ids in and out) from
``transformers`` configs, their runs' weights as built (training them adds nothing here and costs a
process each); greedy output through the server is the model's own ``generate``; every refusal names what
to fix."""

from __future__ import annotations

import json
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from mlscale import TrainConfig
from mlscale.cli import main
from mlscale.registry import Registry, load_torch_model, register_run
from mlscale.registry.models import build_model
from mlscale.rundir import RunDir
from mlscale.tasks.tinylm import ALPHABET
from tests.helpers import shared_copy
from tests.serve.conftest import running_server

pytestmark = pytest.mark.timeout(300)
EOS = 31  # the tokenizer's "</s>": an end id the model rarely picks, so answers run to max_tokens
TEMPLATE = "{% for m in messages %}{{ m['content'] }}. {% endfor %}"
LLAMA_CONTEXT = 64
SPECIAL = {"<pad>", "<s>", "</s>"}


def _char_tokenizer(path):
    """One token per character of the tinylm alphabet (ids 0-28), then three special tokens (29-31)."""
    from tokenizers import Tokenizer, decoders, models

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(["<pad>", "<s>", "</s>"])
    tokenizer.save(str(path))
    return path


def _run(path, task: str, options: dict, seed: int = 7) -> str:
    """A completed run directory of the task's model as built from ``seed`` (what `mlscale train` leaves,
    0 steps): the same weights every run, so that the answers below are checked, not drawn anew each time."""
    config = TrainConfig(task=task, task_options=options, run_dir=str(path))
    torch.manual_seed(seed)
    run = RunDir(path)
    run.write_config(config.model_dump(mode="json"))
    run.write_final_model(build_model(config.flat()))
    run.write_report({"status": "completed", "steps": 0})
    return str(path)


def _build(root):
    location = str(root / "registry")
    config = root / "generation_config.json"
    config.write_text(json.dumps({"eos_token_id": EOS, "chat_template": TEMPLATE, "max_new_tokens": 12}))
    generation = ["--tokenizer", str(_char_tokenizer(root / "tokenizer.json")), "--generation-config", str(config)]
    llama = _run(root / "llama", "tests.user_models:llama", {"seq_len": LLAMA_CONTEXT, "samples": 16})
    assert main(["models", "register", llama, "--name", "llama", *generation, "--registry", location]) == 0
    register_run(Registry(location), _run(root / "gpt2", "tests.user_models:gpt2", {"seq_len": 32, "samples": 16}),
                 "gpt2")
    for name in ("failing", "slow"):
        run = _run(root / name, f"tests.serve.generation.lm_tasks:{name}_llama", {"samples": 16})
        assert main(["models", "register", run, "--name", name, *generation, "--registry", location]) == 0


@pytest.fixture(scope="module")
def location(tmp_path_factory):
    return str(shared_copy(tmp_path_factory, "generation", _build) / "registry")


@pytest.fixture(scope="module")
def server(location):
    with running_server(location, "models:/llama/1", "models:/gpt2/1", "models:/failing/1", "models:/slow/1",
                        "--runtime", "torch",
                        "--no-grpc", "--cache-mb", "0", "--max-sequences", "2", "--queue-limit", "2") as (base, _):
        yield base


@pytest.fixture(scope="module")
def models(location):
    registry = Registry(location)
    return {name: load_torch_model(registry, registry.resolve(f"models:/{name}/1")) for name in ("llama", "gpt2")}


@pytest.fixture(scope="module")
def tokenizer(location):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(location.rsplit("/", 1)[0] + "/tokenizer.json"))


def greedy(model, ids: list[int], new: int, eos: int) -> list[int]:
    """What the model's own ``generate`` gives: up to ``new`` tokens, its end id included."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=new, eos_token_id=eos,
                             pad_token_id=eos, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_completions_are_the_models_greedy_output_with_logprobs(server, models, tokenizer):
    prompt = "the quick fox"
    answer = client(server).completions.create(model="llama", prompt=prompt, max_tokens=10, temperature=0,
                                                logprobs=2, extra_body={"return_token_ids": True})
    (choice,) = answer.choices
    expected = greedy(models["llama"], tokenizer.encode(prompt).ids, 10, EOS)
    assert choice.token_ids == expected
    assert choice.text == tokenizer.decode(expected)
    assert choice.finish_reason == ("stop" if expected[-1] == EOS else "length")
    assert len(choice.logprobs.tokens) == len(expected) == answer.usage.completion_tokens
    assert all(len(top) == 2 and max(top.values()) >= lp - 1e-6
               for top, lp in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs))
    assert answer.usage.prompt_tokens == len(prompt)  # one token a character


def test_token_ids_in_and_out_for_a_version_without_a_tokenizer(server, models):
    ids = [3, 4, 5, 6, 7]
    answer = httpx.post(f"{server}/v1/completions", json={"model": "gpt2", "prompt": ids, "max_tokens": 6,
                                                           "temperature": 0}, timeout=60).json()
    assert answer["choices"][0]["token_ids"] == greedy(models["gpt2"], ids, 6, eos=0)


def test_openai_chat_streams_the_same_answer_with_usage_last(server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a small bird"}]
    chat = client(server).chat.completions
    whole = chat.create(model="llama", messages=messages, max_tokens=9, temperature=0, logprobs=True, top_logprobs=2)
    logprobs = whole.choices[0].logprobs.content
    assert len(logprobs) == whole.usage.completion_tokens and all(len(e.top_logprobs) == 2 for e in logprobs)
    spoken = [e.token for e in logprobs if e.token not in SPECIAL]  # the content skips special tokens
    assert "".join(spoken).startswith(whole.choices[0].message.content)
    chunks = list(chat.create(model="llama", messages=messages, max_tokens=9, temperature=0, stream=True,
                              stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert whole.usage.prompt_tokens == len("be brief. a small bird. ")  # the template's text, a token a character


def test_n_choices_and_stop_strings_across_tokens(server, models, tokenizer):
    prompt = "every child"
    expected = tokenizer.decode(greedy(models["llama"], tokenizer.encode(prompt).ids, 12, EOS))
    assert len(expected) >= 4, expected
    stop = expected[2:4]  # two characters: two tokens, found across them
    answer = client(server).completions.create(model="llama", prompt=prompt, max_tokens=12, temperature=0, n=2,
                                                stop=[stop])
    assert [c.text for c in answer.choices] == [expected[:expected.index(stop)]] * 2
    assert [c.finish_reason for c in answer.choices] == ["stop", "stop"]
    sampled = client(server).completions.create(model="llama", prompt=prompt, max_tokens=8, n=3, seed=5,
                                                 temperature=1.0, extra_body={"top_k": 5})
    again = client(server).completions.create(model="llama", prompt=prompt, max_tokens=8, n=3, seed=5,
                                               temperature=1.0, extra_body={"top_k": 5})
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # a seed repeats


def _curl(url: str, body: dict) -> str:
    done = subprocess.run(["curl", "-sS", "-N", "--max-time", "60", "-X", "POST", url, "-H",
                           "Content-Type: application/json", "-d", json.dumps(body)],
                          capture_output=True, text=True, timeout=90, check=True)
    return done.stdout


def test_curl_generate_and_generate_stream(server, models, tokenizer):
    body = {"text_input": "one old stone", "parameters": {"max_tokens": 7, "temperature": 0}, "id": "r1"}
    answer = json.loads(_curl(f"{server}/v2/models/llama/generate", body))
    expected = greedy(models["llama"], tokenizer.encode(body["text_input"]).ids, 7, EOS)
    assert answer["text_output"] == tokenizer.decode(expected)
    assert (answer["model_name"], answer["model_version"], answer["id"]) == ("llama", "1", "r1")
    assert answer["details"]["completion_tokens"] == len(expected)
    stream = _curl(f"{server}/v2/models/llama/versions/1/generate_stream", body)
    events = [json.loads(line[len("data: "):]) for line in stream.splitlines() if line.startswith("data: ")]
    assert "".join(e["text_output"] for e in events) == answer["text_output"]
    assert [e["done"] for e in events] == [False] * (len(events) - 1) + [True]
    assert events[-1]["details"]["finish_reason"] == answer["details"]["finish_reason"]
    ids = json.loads(_curl(f"{server}/v2/models/gpt2/generate", {"input_ids": [1, 2, 3], "parameters": {
        "max_tokens": 5, "temperature": 0}}))
    assert ids["output_ids"] == greedy(models["gpt2"], [1, 2, 3], 5, eos=0)


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "the fox " * 6, "max_tokens": 40}, "max_tokens", ["48", "40", "64"]),  # prompt + max_tokens > context
    ({"prompt": "a", "temperature": -1}, "temperature", ["temperature"]),
    ({"prompt": "a", "top_p": 0}, "top_p", ["top_p"]),
    ({"prompt": "a", "best_of": 3}, "best_of", ["best_of"]),
    ({"prompt": "a", "frobnicate": True}, "frobnicate", ["Unrecognized", "frobnicate"]),
    ({"prompt": [1, 99]}, "prompt", ["99"]),  # past the vocabulary
])
def test_bad_requests_get_400_in_openais_shape_naming_the_field(server, body, param, words):
    with pytest.raises(openai.BadRequestError) as error:
        client(server).completions.create(model="llama", prompt=body.pop("prompt"), extra_body=body)
    assert error.value.status_code == 400 and error.value.body["param"] == param
    assert all(word in error.value.body["message"] for word in words), error.value.body


def test_refusals_of_the_other_routes(server):
    chat = httpx.post(f"{server}/v1/chat/completions", json={"model": "gpt2", "messages": [
        {"role": "user", "content": "hi"}]}, timeout=30)
    assert chat.status_code == 400 and "chat template" in chat.json()["error"]["message"]
    unknown = httpx.post(f"{server}/v1/completions", json={"model": "nope", "prompt": "a"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    oip = httpx.post(f"{server}/v2/models/llama/generate", json={"text_input": "a", "parameters": {"top_p": 2}},
                     timeout=30)
    assert oip.status_code == 400 and "top_p" in oip.json()["error"]
    assert [m["id"] for m in httpx.get(f"{server}/v1/models").json()["data"]] == ["llama", "gpt2", "failing", "slow"]


def test_a_full_engine_answers_429_for_openai_and_503_for_the_protocol(server):
    """Two running and two waiting at most (--max-sequences 2 --queue-limit 2): of 16 requests at once,
    some are refused at once, with Retry-After; the others are answered."""

    def completion(_: int) -> httpx.Response:
        return httpx.post(f"{server}/v1/completions", json={"model": "llama", "prompt": "the", "max_tokens": 50,
                                                             "ignore_eos": True, "temperature": 0}, timeout=120)

    def generate(_: int) -> httpx.Response:
        return httpx.post(f"{server}/v2/models/llama/generate", json={"text_input": "the", "parameters": {
            "max_tokens": 50, "ignore_eos": True}}, timeout=120)

    for ask, refused in ((completion, 429), (generate, 503)):
        with ThreadPoolExecutor(16) as pool:
            statuses = [(r.status_code, r.headers.get("retry-after")) for r in pool.map(ask, range(16))]
        assert (refused, "1") in statuses and (200, None) in statuses, statuses
        assert {status for status, _ in statuses} == {200, refused}


def test_a_failure_during_generation_ends_the_stream_with_an_error_event(server):
    """The failing model's head breaks after a few tokens: the stream ends with an error event (which
    the openai client raises), never a hung connection; the protocol's stream ends with error and done."""
    pieces = []
    with pytest.raises(openai.APIError, match="internal error"):
        for chunk in client(server).completions.create(model="failing", prompt="the", max_tokens=40, stream=True,
                                                       temperature=0, extra_body={"ignore_eos": True}):
            pieces.append(chunk.choices[0].text)
    assert pieces  # tokens came before the failure
    stream = _curl(f"{server}/v2/models/failing/generate_stream", {"text_input": "a", "parameters": {
        "max_tokens": 40}})
    last = json.loads(stream.strip().splitlines()[-1][len("data: "):])
    assert last["done"] is True and "internal error" in last["error"]


def test_a_version_records_its_tokenizer_and_generation_config_bounded(location, tmp_path, capsys):
    assert main(["models", "show", "models:/llama/1", "--registry", location]) == 0
    shown = capsys.readouterr().out
    assert "tokenizer.json" in shown and "generation_config.json" in shown
    assert "tokenizer, chat template, max_new_tokens 12, eos_token_id 31" in shown
    run = str(RunDir(location).path.parent / "llama")
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({"chat_template": "x" * (2 << 20)}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"temperature": "hot"}))
    for flags, words in ((["--generation-config", str(huge)], "over the 1,048,576-byte limit"),
                         (["--generation-config", str(bad)], "temperature is 'hot'"),
                         (["--tokenizer", str(bad)], "not a tokenizers file")):
        assert main(["models", "register", run, "--name", "refused", *flags, "--registry", location]) == 2
        assert words in capsys.readouterr().err


def _slow(server: str, name: str) -> float:
    """The slow model's ``name`` in /metrics, summed over its series (every worker's, every label)."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines()
               if line.startswith(name + "{") and 'model="slow"' in line)


def test_a_client_that_disconnects_frees_its_sequence_within_a_step(server):
    """Two streams of the slow model (60 tokens each at 50 ms a step: 3 s at least) hold the engine;
    once their clients have gone, their sequences end within a few steps: none runs, and the tokens
    generated stop far short of the 120 asked (a sequence left running would go on for seconds)."""
    running, generated = "mlscale_generation_sequences_running", "mlscale_generation_generated_tokens_total"
    before = _slow(server, generated)
    streams = []
    for _ in range(2):
        session = httpx.Client(timeout=60)
        response = session.send(session.build_request("POST", f"{server}/v1/completions", json={
            "model": "slow", "prompt": "a", "max_tokens": 60, "stream": True, "ignore_eos": True}), stream=True)
        lines = response.iter_lines()  # kept: a dropped iterator closes the response, which disconnects
        assert response.status_code == 200 and next(lines).startswith("data: ")  # generating
        streams.append((session, response, lines))
    assert _slow(server, running) == 2  # both sequences hold the engine
    for session, response, _ in streams:
        response.close()
        session.close()
    deadline = time.monotonic() + 5
    while _slow(server, running) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _slow(server, running) == 0
    stopped_at = _slow(server, generated) - before
    time.sleep(0.5)  # ten steps of the slow model
    assert _slow(server, generated) - before == stopped_at < 120
