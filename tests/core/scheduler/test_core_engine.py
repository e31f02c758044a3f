"""The batched engine (core/scheduler/engine.py) on tiny random models in fp32: every sequence of a batch
decodes token for token as its own greedy decoding, whatever its neighbours do (ragged prompts,
sequences ending mid-batch, slots refilled, tree drafts, EOS inside an accepted draft, a shared
prefix, a KV budget that makes requests wait); speculative sampling keeps its distribution."""

from __future__ import annotations

import random

import pytest
import torch

from specsuite.core import Draft, EngineConfig, PrefixCache, PromptLookupDrafter, Sampling, SamplingParams
from specsuite.core.speculation.draft_budget import DraftBudget, StepCost
from specsuite.core.scheduler.engine import BatchEngine, Request, engine_supports, generate_many
from conftest import REPO, OracleTreeDrafter, hf_greedy, model_for, prompts

FLAT = StepCost({1: 1.0, 512: 1.0})  # rows cost nothing: every draft is verified whole


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_batch_equals_per_sequence_greedy_with_tree_drafts(kind, batch_size):
    model = model_for(kind)
    ps = prompts(9, seed=batch_size, lengths=(1, 30))
    budgets = [5 + 3 * i for i in range(len(ps))]  # sequences end at different steps
    truths = [hf_greedy(model, p, n) for p, n in zip(ps, budgets)]
    drafters = [OracleTreeDrafter(p, t, seed=i) for i, (p, t) in enumerate(zip(ps, truths))]
    requests = [Request(p, d, SamplingParams(max_new_tokens=n)) for p, d, n in zip(ps, drafters, budgets)]
    engine = BatchEngine(model, EngineConfig(batch_size), eos_token_id=[], cost=FLAT)
    outs = generate_many_with(engine, requests)
    assert [o.tokens for o in outs] == truths
    assert all(o.finish_reason == "length" for o in outs)
    assert sum(d.accepted for d in drafters) > 0  # drafts were accepted, trees' non-first paths too
    assert engine.forward_passes < sum(budgets)


def generate_many_with(engine: BatchEngine, requests: list[Request]):
    results = dict(engine.run(requests))
    for r in results.values():
        if isinstance(r, Exception):
            raise r
    return [results[i] for i in range(len(requests))]


def test_stepping_by_hand_adds_aborts_and_equals_greedy():
    """add_request / step / abort: requests added between steps join the batch, an aborted one
    (waiting or decoding) is never reported and frees its slot, the others decode as greedy."""
    model = model_for("qwen2")
    ps = prompts(6, seed=11, lengths=(2, 20))
    truths = [hf_greedy(model, p, 10) for p in ps]
    engine = BatchEngine(model, EngineConfig(2), eos_token_id=[], cost=FLAT)
    ids = [engine.add_request(Request(p, PromptLookupDrafter(), SamplingParams(max_new_tokens=10))) for p in ps[:4]]
    assert engine.abort(ids[3])  # still waiting
    ended = dict(engine.step())
    assert ended == {} and engine.in_flight == 2 and len(engine.waiting) == 1
    assert engine.abort(ids[1])  # decoding: its slot takes the waiting request at the next step
    assert not engine.abort(ids[1]) and not engine.abort(99)
    late = None
    while engine.has_unfinished_requests():
        for request_id, result in engine.step():
            ended[request_id] = result
        if late is None:
            late = engine.add_request(Request(ps[4], params=SamplingParams(max_new_tokens=10)))  # joins mid-flight
    assert set(ended) == {ids[0], ids[2], late}
    assert [ended[i].tokens for i in (ids[0], ids[2], late)] == [truths[0], truths[2], truths[4]]
    assert engine.step() == []  # nothing left: a step does nothing


def test_prompt_lookup_and_no_drafter_in_one_batch():
    model = model_for("llama")
    ps = prompts(8, seed=3)
    truths = [hf_greedy(model, p, 12) for p in ps]
    requests = [Request(p, PromptLookupDrafter() if i % 2 else None, SamplingParams(max_new_tokens=12)) for i, p in enumerate(ps)]
    assert [g.tokens for g in generate_many(model, requests, EngineConfig(batch_size=4), eos_token_id=[], cost=FLAT)] == truths


def test_eos_inside_an_accepted_draft_ends_the_sequence_there():
    model = model_for("qwen2")
    p = prompts(1, seed=5, lengths=(6, 6))[0]
    truth = hf_greedy(model, p, 20)
    eos = truth[6]
    expected = hf_greedy(model, p, 20, eos=eos)
    assert expected[-1] == eos and len(expected) <= 7

    class Whole(OracleTreeDrafter):  # the whole true continuation, past the EOS
        def propose(self, tokens, max_depth):
            done = len(tokens) - len(self.prompt)
            return Draft.chain(self.truth[done:]) if done < len(self.truth) else None

    out = generate_many(model, [Request(p, Whole(p, truth, 0), SamplingParams(max_new_tokens=20))], eos_token_id=[eos], cost=FLAT)[0]
    assert out.tokens == expected and out.finish_reason == "eos"
    assert out.stats.forward_passes <= 2 and out.from_draft[-1]


def test_shared_prefix_is_computed_once_and_reused():
    model = model_for("llama", max_positions=512)
    rng = random.Random(0)
    prefix = [rng.randrange(96) for _ in range(40)]
    ps = [prefix + q for q in prompts(6, seed=7, lengths=(1, 12))] + [prompts(1, seed=8)[0]]  # one without it
    truths = [hf_greedy(model, p, 10) for p in ps]
    engine = BatchEngine(model, EngineConfig(4, prefix=prefix), eos_token_id=[], cost=FLAT)
    outs = generate_many_with(engine, [Request(p, PromptLookupDrafter(), SamplingParams(max_new_tokens=10)) for p in ps])
    assert [o.tokens for o in outs] == truths
    assert [o.stats.cached_prompt_tokens for o in outs] == [40] * 6 + [0]



def test_prompts_reuse_the_kv_of_earlier_prompts_in_a_prefix_cache():
    """With a `PrefixCache`, a prompt starts from the longest prefix an earlier prompt left there
    (RAG: the same passages, another question; or the same question again) and decodes as without."""
    model = model_for("qwen2", max_positions=512)
    passages = prompts(1, seed=21, lengths=(60, 60))[0]
    questions = prompts(3, seed=22, lengths=(9, 15))
    ps = [passages + q for q in questions] + [passages + questions[0]]  # the last one asked again
    truths = [hf_greedy(model, p, 10) for p in ps]
    cache = PrefixCache(model.config)
    engine = BatchEngine(model, EngineConfig(2, prefix_cache=cache), eos_token_id=[], cost=FLAT)
    first = generate_many_with(engine, [Request(ps[0], PromptLookupDrafter(), SamplingParams(max_new_tokens=10))])
    rest = generate_many_with(engine, [Request(p, PromptLookupDrafter(), SamplingParams(max_new_tokens=10)) for p in ps[1:]])
    assert [o.tokens for o in first + rest] == truths
    assert first[0].stats.cached_prompt_tokens == 0
    assert [o.stats.cached_prompt_tokens for o in rest] == [60, 60, len(ps[3]) - cache.fresh_tokens]

def test_kv_budget_makes_requests_wait_not_fail():
    model = model_for("llama")
    ps = prompts(6, seed=9)
    truths = [hf_greedy(model, p, 16) for p in ps]
    engine = BatchEngine(model, EngineConfig(6, kv_budget_bytes=1), eos_token_id=[], cost=FLAT)
    one = engine.store.token_bytes * 128  # the smallest cache the engine makes holds one slot of 128 positions
    engine.store.kv_budget_bytes = 2 * one
    assert [o.tokens for o in generate_many_with(engine, [Request(p, params=SamplingParams(max_new_tokens=16)) for p in ps])] == truths
    assert engine.store.keys[0].shape[0] == 2  # never more than two slots


def test_a_long_request_after_a_full_batch_gets_a_cache_made_to_its_size():
    # Four short sequences fill the budget as four slots; the long one fits the budget only alone:
    # it waits for them, then the empty batch's cache is made anew for it (not a "does not fit").
    model = model_for("llama", max_positions=512)
    short, long_ = prompts(4, seed=13, lengths=(4, 10)), prompts(1, seed=14, lengths=(20, 20))[0]
    requests = [Request(p, params=SamplingParams(max_new_tokens=8)) for p in short] + [Request(long_, params=SamplingParams(max_new_tokens=200))]
    engine = BatchEngine(model, EngineConfig(6, kv_budget_bytes=1), eos_token_id=[], cost=FLAT)
    engine.store.kv_budget_bytes = 4 * 128 * engine.store.token_bytes
    outs = generate_many_with(engine, requests)
    assert [o.tokens for o in outs] == [hf_greedy(model, r.prompt, r.params.max_new_tokens) for r in requests]
    assert engine.store.keys[0].shape[0] * engine.store.keys[0].shape[2] <= 4 * 128


def test_a_bad_request_fails_alone():
    model = model_for("llama")
    good = prompts(2, seed=11)
    requests = [Request(good[0], params=SamplingParams(max_new_tokens=5)), Request([], params=SamplingParams(max_new_tokens=5)),
                Request(good[1], params=SamplingParams(max_new_tokens=0)), Request(good[1], params=SamplingParams(max_new_tokens=5))]
    results = dict(BatchEngine(model, EngineConfig(2), eos_token_id=[], cost=FLAT).run(requests))
    assert isinstance(results[1], ValueError) and "empty" in str(results[1])
    assert isinstance(results[2], ValueError) and "max_new_tokens" in str(results[2])
    assert results[0].tokens == hf_greedy(model, good[0], 5) and results[3].tokens == hf_greedy(model, good[1], 5)


def test_context_limit_ends_a_sequence():
    model = model_for("llama", max_positions=32)
    p = prompts(1, seed=12, lengths=(28, 28))[0]
    out = generate_many(model, [Request(p, params=SamplingParams(max_new_tokens=50))], eos_token_id=[], cost=FLAT)[0]
    assert len(out.tokens) == 4 and out.finish_reason == "context"


def test_unsupported_models_are_refused():
    eager = model_for("llama", attn="eager")
    assert not engine_supports(eager)
    with pytest.raises(ValueError, match="Llama-family"):
        BatchEngine(eager, EngineConfig(2), cost=FLAT)


# ---- the draft budget ----------------------------------------------------------------------

def test_step_cost_interpolates_and_extrapolates():
    cost = StepCost({1: 0.1, 32: 0.1, 64: 0.2})
    assert cost(1) == cost(16) == 0.1
    assert cost(48) == pytest.approx(0.15) and cost(96) == pytest.approx(0.3)


def test_draft_budget_spends_rows_only_while_a_step_is_cheap():
    drafts = [Draft.chain(list(range(16)))] * 4
    cheap = DraftBudget(StepCost({1: 0.1, 128: 0.1, 256: 0.4}))
    assert cheap.cap(4, drafts, [0.9] * 4) == 16  # four sequences: long drafts are free
    steep = DraftBudget(StepCost({1: 0.1, 2: 0.2}))  # every row costs a step
    assert steep.cap(4, drafts, [0.9] * 4) == 0
    many = [Draft.chain(list(range(16)))] * 32
    knee = DraftBudget(StepCost({1: 0.1, 32: 0.1, 64: 0.25, 256: 1.0}))
    assert knee.cap(32, many, [0.95] * 32) == 0  # a full batch past the knee: rows go to sequences
    gentle = DraftBudget(StepCost({1: 0.1, 32: 0.1, 64: 0.12, 256: 0.3}))
    assert gentle.cap(32, many, [0.5] * 32) < gentle.cap(32, many, [0.95] * 32) < 16  # drafts that pay, and no more


def test_step_cost_is_measured_once_and_kept(tmp_path):
    model = model_for("llama")
    engine = BatchEngine(model, EngineConfig(2), eos_token_id=[], cost=FLAT)
    first = engine.measure_step_cost(rows=(1, 4), reps=1, cache_dir=tmp_path)
    assert len(list(tmp_path.iterdir())) == 1 and all(s > 0 for s in first.secs)
    again = engine.measure_step_cost(rows=(1, 4), reps=1, cache_dir=tmp_path)
    assert again.secs == first.secs  # read back, not measured again


# ---- speculative sampling per sequence -----------------------------------------------------

def test_sampling_per_sequence_keeps_the_distribution(monkeypatch):
    monkeypatch.syspath_prepend(REPO / "tests" / "core" / "speculation")  # test_core_sampling's folder
    from test_core_sampling import PROMPT, FixedDrafter, _e2e_draft, assert_matches, empirical, exact_two_tokens
    from test_core_sampling import tiny_model as sampling_model

    model = sampling_model(seed=0)
    sampling = Sampling(temperature=1.0)
    exact = exact_two_tokens(model, sampling)
    g = torch.Generator().manual_seed(0)
    draft = _e2e_draft(exact, chain=False)
    requests = [Request(PROMPT, FixedDrafter(draft), SamplingParams(max_new_tokens=4, sampling=sampling, generator=g))
                for _ in range(3000)]
    outs = generate_many(model, requests, EngineConfig(batch_size=64), eos_token_id=[], cost=FLAT)
    assert sum(o.stats.accepted[1] for o in outs) > 0
    assert_matches(empirical([(o.tokens[1], o.tokens[2]) for o in outs]), exact)


# ---- serving concurrent callers ------------------------------------------------------------

def test_server_batches_concurrent_callers_and_streams_steps():
    from concurrent.futures import ThreadPoolExecutor

    from specsuite.apps.serving.batch_server import BatchServer

    model = model_for("qwen2")
    ps = prompts(6, seed=13)
    truths = [hf_greedy(model, p, 12) for p in ps]
    engine = BatchEngine(model, EngineConfig(4), eos_token_id=[], cost=FLAT)
    server = BatchServer(engine)
    steps: list[list[int]] = [[] for _ in ps]

    def call(i: int):
        request = Request(ps[i], PromptLookupDrafter(), SamplingParams(max_new_tokens=12), on_step=lambda t, f: steps[i].extend(t))
        return server.submit(request).result(timeout=60)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(call, range(len(ps))))
    assert [o.tokens for o in outs] == truths
    assert steps == truths  # every step's tokens reached its caller
    assert engine.forward_passes < sum(len(t) for t in truths)  # steps were shared

    class Stop(Exception):
        pass

    def stop(tokens, flags):
        raise Stop("the caller is gone")

    with pytest.raises(Stop):  # an on_step that raises ends its own sequence only
        server.submit(Request(ps[0], params=SamplingParams(max_new_tokens=12), on_step=stop)).result(timeout=60)
    assert server.submit(Request(ps[1], params=SamplingParams(max_new_tokens=12))).result(timeout=60).tokens == truths[1]
