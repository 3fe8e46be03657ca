"""The generation engine against the models' own generate(): continuous batching, the paged KV cache,
prefix caching, chunked prefill and preemption never change a greedy output or its logprobs; seeds,
aborts and the limits.

Tiny GPT-2 and Llama from transformers configs (float32, random weights scaled up so that the top two
logits of a step are rarely within float noise of each other), built once per module.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest
import torch

from mlscale.serve.generation import ContextTooLong, EngineFull, GenerationEngine, SamplingParams, TokenEvent
from mlscale.serve.generation.runner import cached_model

transformers = pytest.importorskip("transformers")

VOCAB, CONTEXT, EOS = 100, 128, 1


def _gpt2() -> torch.nn.Module:
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0, initializer_range=0.3)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=CONTEXT,
                                      bos_token_id=EOS, eos_token_id=EOS, pad_token_id=0, initializer_range=0.3)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


@dataclass(frozen=True)
class Case:
    prompt: list[int]
    new_tokens: int
    delay_s: float


@dataclass(frozen=True)
class Solo:
    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]


def _cases(count: int = 64, seed: int = 0) -> list[Case]:
    """Prompts of 4-64 tokens, a third of them starting with one of three shared prefixes (the prefix
    cache's work), 8-32 new tokens each, arriving over 0.3 s."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(17, 40))] for _ in range(3)]
    cases = []
    for index in range(count):
        length = rng.randint(4, 64)
        head = rng.choice(prefixes)[:length] if index % 3 == 0 else []
        prompt = head + [rng.randrange(2, VOCAB) for _ in range(length - len(head))]
        cases.append(Case(prompt, rng.randint(8, 32), rng.uniform(0, 0.3)))
    return cases


def _solo(model: torch.nn.Module, case: Case) -> Solo:
    """The model's own generate() on the request alone: greedy tokens, and log_softmax of its raw logits."""
    with torch.no_grad():
        prompt = torch.tensor([case.prompt])
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=case.new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(case.prompt):].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1) for step in out.logits]
    top = [list(zip(*(t.tolist() for t in reversed(torch.topk(row, 3))))) for row in logprobs]
    return Solo(tokens, [row[token].item() for row, token in zip(logprobs, tokens)], top)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run ten times faster on one thread than on two busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def model(request):
    return {"gpt2": _gpt2, "llama": _llama}[request.param]()


@pytest.fixture(scope="module")
def cases():
    return _cases()


@pytest.fixture(scope="module")
def solos(model, cases):
    return [_solo(model, case) for case in cases]


def _engine(model: torch.nn.Module, **options) -> GenerationEngine:
    return GenerationEngine(model, eos_token_ids=(EOS,), max_context=CONTEXT, **options)


async def _collect(engine: GenerationEngine, prompt: list[int], params: SamplingParams, delay_s: float = 0.0
                   ) -> list[TokenEvent]:
    await asyncio.sleep(delay_s)
    return [event async for event in engine.generate(prompt, params)]


async def _run_all(engine: GenerationEngine, cases: list[Case]) -> list[list[TokenEvent]]:
    try:
        runs = (_collect(engine, case.prompt, SamplingParams(max_tokens=case.new_tokens, temperature=0, logprobs=3),
                         case.delay_s) for case in cases)
        return await asyncio.wait_for(asyncio.gather(*runs), timeout=120)
    finally:
        await engine.close()


SETTINGS = {
    "prefix+chunked": dict(prefix_caching=True, chunked_prefill=True, max_batch_tokens=48),
    "no-prefix+whole-prompts": dict(prefix_caching=False, chunked_prefill=False, max_batch_tokens=48),
    "preempting": dict(prefix_caching=True, chunked_prefill=True, max_batch_tokens=64, block_size=8),
}


@pytest.mark.parametrize("setting", SETTINGS)
def test_greedy_outputs_and_logprobs_equal_generate_on_each_request_alone(model, cases, solos, setting):
    options = dict(SETTINGS[setting])
    if setting == "preempting":  # a pool of 40 blocks of 8 tokens: a handful of sequences at once
        options["kv_cache_mb"] = 40 * cached_model(model).shape.block_bytes(8) / 2**20
    engine = _engine(model, **options)
    results = asyncio.run(_run_all(engine, cases))
    for case, solo, events in zip(cases, solos, results):
        assert [event.token_id for event in events] == solo.tokens, case
        assert events[-1].finish_reason == ("stop" if solo.tokens[-1] == EOS else "length")
        assert [event.logprob for event in events] == pytest.approx(solo.logprobs, abs=1e-5)
        for event, top in zip(events, solo.top):
            assert [token for token, _ in event.top_logprobs] == [token for token, _ in top]
            assert [value for _, value in event.top_logprobs] == pytest.approx([value for _, value in top], abs=1e-5)
    stats = engine.stats()
    assert stats.generated_tokens_total == sum(len(solo.tokens) for solo in solos)
    assert stats.running == stats.waiting == stats.kv_blocks_used == 0
    if setting == "preempting":
        assert stats.preemptions_total > 0
    if options["prefix_caching"]:
        assert stats.prefix_hits_total > 0
    else:
        assert stats.prefix_hits_total == 0


def test_a_seeded_request_gives_the_same_tokens_whatever_its_neighbours(model, cases):
    params = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, seed=7)
    prompt = cases[1].prompt

    async def alone() -> list[int]:
        engine = _engine(model)
        try:
            return [event.token_id for event in await _collect(engine, prompt, params)]
        finally:
            await engine.close()

    async def among_others() -> list[int]:
        engine = _engine(model, max_batch_tokens=32)
        try:
            others = [_collect(engine, case.prompt, SamplingParams(max_tokens=20, seed=index), case.delay_s / 10)
                      for index, case in enumerate(cases[2:14])]
            results = await asyncio.wait_for(asyncio.gather(_collect(engine, prompt, params, 0.01), *others), 60)
            return [event.token_id for event in results[0]]
        finally:
            await engine.close()

    first = asyncio.run(alone())
    assert asyncio.run(among_others()) == first
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.9, seed=8)
    assert asyncio.run(_tokens_alone(model, prompt, other_seed)) != first  # the seed, not luck, fixes them


async def _tokens_alone(model, prompt, params) -> list[int]:
    engine = _engine(model)
    try:
        return [event.token_id for event in await _collect(engine, prompt, params)]
    finally:
        await engine.close()


def test_a_closed_stream_stops_within_a_step_and_gives_its_blocks_back(model):

    async def scenario() -> None:
        engine = _engine(model, prefix_caching=False)
        try:
            stream = engine.generate(list(range(2, 40)), SamplingParams(max_tokens=80, temperature=0, ignore_eos=True))
            async for event in stream:
                if event.token_id is not None and engine.stats().generated_tokens_total >= 3:
                    break
            await stream.aclose()
            closed_at = engine.stats().generated_tokens_total
            await _until(lambda: engine.stats().running == 0)
            stats = engine.stats()
            assert stats.generated_tokens_total - closed_at <= 1  # the step in flight, at most
            assert stats.kv_blocks_used == 0

            events, made = [], []  # what the reader saw; tokens the engine had made when abort was called
            ids, before = "to-abort", engine.stats().generated_tokens_total

            async def read() -> None:
                async for event in engine.generate(list(range(2, 30)), SamplingParams(max_tokens=80, temperature=0,
                                                                                       ignore_eos=True), ids):
                    events.append(event)
                    if len(events) == 2:
                        made.append(engine.stats().generated_tokens_total - before)
                        engine.abort(ids)

            await asyncio.wait_for(read(), 30)
            assert events[-1].finish_reason == "abort" and events[-1].token_id is None
            # tokens the engine made before the call (a slow reader sees them late), then the step in flight
            assert len(events) - 1 <= made[0] + 1 < 80
            assert engine.stats().kv_blocks_used == 0
        finally:
            await engine.close()

    asyncio.run(scenario())


async def _until(condition, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.005)


def test_the_limits_are_refused_before_the_first_event(model):

    async def scenario() -> None:
        engine = _engine(model, max_running=1, max_waiting=2)
        try:
            with pytest.raises(ContextTooLong) as raised:
                await engine.generate([5] * 100, SamplingParams(max_tokens=40)).__anext__()
            assert (raised.value.prompt_tokens, raised.value.max_tokens, raised.value.max_context) == (100, 40, CONTEXT)
            assert "100" in str(raised.value) and "40" in str(raised.value) and str(CONTEXT) in str(raised.value)

            long = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
            streams = [engine.generate([3, 4, 5], long) for _ in range(3)]
            first = asyncio.ensure_future(streams[0].__anext__())
            await _until(lambda: engine.stats().running == 1)
            waiting = [asyncio.ensure_future(stream.__anext__()) for stream in streams[1:]]
            await _until(lambda: engine.stats().waiting == 2)
            with pytest.raises(EngineFull):
                await engine.generate([3, 4, 5], long).__anext__()
            await first
            await streams[0].aclose()
            for task in waiting:  # a cancelled read closes its stream too
                task.cancel()
            await asyncio.gather(*waiting, return_exceptions=True)
            await _until(lambda: engine.stats().running + engine.stats().waiting == 0)
        finally:
            await engine.close(drain=False)

    asyncio.run(scenario())


def test_a_request_bigger_than_the_pool_is_refused(model):
    block = cached_model(model).shape.block_bytes(16)
    engine = _engine(model, kv_cache_mb=3 * block / 2**20)

    async def scenario() -> None:
        try:
            with pytest.raises(EngineFull, match="3"):
                await engine.generate([5] * 40, SamplingParams(max_tokens=20)).__anext__()
        finally:
            await engine.close()

    asyncio.run(scenario())


def test_tinylm_greedy_equals_its_full_forward_argmax():
    from mlscale.tasks.tinylm import TinyLM

    torch.manual_seed(0)
    model = TinyLM(vocab=29, dim=32, layers=2, heads=4, seq_len=96, hidden=64).eval()
    for parameter in model.parameters():  # a wider spread of logits than training's initialisation
        parameter.data.mul_(8)
    rng = random.Random(1)
    cases = [Case([rng.randrange(29) for _ in range(rng.randint(4, 40))], rng.randint(8, 24), rng.uniform(0, 0.1))
             for _ in range(12)]
    engine = GenerationEngine(model, eos_token_ids=(), max_context=96, block_size=8, max_batch_tokens=24)
    results = asyncio.run(_run_all(engine, cases))
    for case, events in zip(cases, results):
        tokens = list(case.prompt)
        with torch.no_grad():
            for _ in range(case.new_tokens):
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert [event.token_id for event in events] == tokens[len(case.prompt):]


def test_a_failing_step_ends_its_sequences_with_an_error_and_the_engine_goes_on():
    from mlscale.tasks.tinylm import TinyLM

    class Failing(TinyLM):
        def forward_cached(self, input_ids, *args):
            if (input_ids == 13).any():
                raise RuntimeError("token 13 is cursed")
            return super().forward_cached(input_ids, *args)

    torch.manual_seed(0)
    engine = GenerationEngine(Failing(vocab=29, dim=32, layers=2, heads=4, seq_len=64, hidden=64), eos_token_ids=(),
                              max_context=64, block_size=8)

    async def scenario() -> tuple[list[TokenEvent], list[TokenEvent]]:
        try:
            failed = await asyncio.wait_for(_collect(engine, [3, 13, 5], SamplingParams(max_tokens=4)), 30)
            fine = await asyncio.wait_for(_collect(engine, [3, 4, 5], SamplingParams(max_tokens=4, temperature=0)), 30)
            return failed, fine
        finally:
            await engine.close()

    failed, fine = asyncio.run(scenario())
    assert [(event.token_id, event.finish_reason) for event in failed] == [(None, "error")]
    assert "token 13 is cursed" in failed[0].error
    assert len(fine) == 4 and fine[-1].finish_reason == "length"
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("drain", [True, False])
def test_close_lets_running_sequences_finish_or_aborts_them(drain):
    from mlscale.tasks.tinylm import TinyLM

    torch.manual_seed(0)
    model = TinyLM(vocab=29, dim=32, layers=2, heads=4, seq_len=64, hidden=64)
    engine = GenerationEngine(model, eos_token_ids=(), max_context=64, block_size=8, max_running=2)
    params = SamplingParams(max_tokens=30, temperature=0)

    async def scenario() -> list[list[TokenEvent]]:
        streams = [asyncio.ensure_future(_collect(engine, [3, 4, 5 + index], params)) for index in range(3)]
        await _until(lambda: engine.stats().generated_tokens_total >= 2)
        await asyncio.wait_for(engine.close(drain=drain), 30)
        with pytest.raises(EngineFull, match="closing"):
            await engine.generate([3, 4, 5], params).__anext__()
        return await asyncio.wait_for(asyncio.gather(*streams), 30)

    results = asyncio.run(scenario())
    if drain:  # the two running and the one waiting: every token
        assert [(len(events), events[-1].finish_reason) for events in results] == [(30, "length")] * 3
    else:
        assert [events[-1].finish_reason for events in results] == ["abort"] * 3
        assert all(len(events) < 30 for events in results)
    assert engine.stats().kv_blocks_used == 0
