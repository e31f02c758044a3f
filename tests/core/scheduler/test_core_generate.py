"""The draft-then-verify loop is exactly greedy decoding, whatever the drafter proposes.

Tiny randomly initialised models (built from a config, seeded) stand in for real ones: every test
compares `specsuite.core.scheduler.generate` token for token with Hugging Face's own `model.generate(do_sample=False)`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specsuite.core import Draft, Drafter, DraftModelDrafter, generate, NoDrafter, PromptLookupDrafter, SamplingParams
from specsuite.core.model.backend import EXACT_BF16, choose_backend
from conftest import VOCAB, tiny_model, model_for, hf_greedy, policy, prompts, OracleTreeDrafter


def test_fp32_prefill_verifies_a_draft_too():
    """In fp32 on the CPU the prefill's forward also verifies a draft of up to 16 nodes: the output
    stays greedy's with fewer forward passes. In bf16 the prefill drafts nothing by default."""
    model = model_for("llama")
    assert choose_backend(model).prefill_draft == 16
    for i, p in enumerate(prompts(6, seed=14, lengths=(2, 40))):
        truth = hf_greedy(model, p, 30)
        runs = {k: generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=25, eos_token_id=[],
                            policy=None if k is None else policy(model, prefill_draft=k)) for k in (None, 0, 3)}
        for k, out in runs.items():
            assert out.tokens == truth[:25], (i, k)
        assert 0 < runs[None].stats.drafted[0] <= 16 and runs[3].stats.drafted[0] <= 3
        assert runs[0].stats.drafted[0] == 0
        assert runs[None].stats.forward_passes <= runs[0].stats.forward_passes
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert choose_backend(bf16, "exact").prefill_draft == 0 == choose_backend(bf16, "plain").prefill_draft
    with pytest.raises(ValueError, match="prefill_draft"):
        generate(model, [1, 2, 3], max_new_tokens=2, policy=policy(model, prefill_draft=-1))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_no_drafter_equals_hf_greedy(kind):
    model = model_for(kind)
    for i, p in enumerate(prompts(10, seed=1)):
        n = 1 + (7 * i) % 30
        ref = hf_greedy(model, p, n)
        out = generate(model, p, NoDrafter(), max_new_tokens=n, eos_token_id=[])
        assert out.tokens == ref
        assert out.from_draft == [False] * n and out.finish_reason == "length"
        assert out.stats.forward_passes == n and out.stats.new_tokens == n
        assert out.stats.prompt_tokens == len(p)
    # None means NoDrafter; a (1, T) tensor works as the prompt
    p = prompts(1, seed=2)[0]
    assert generate(model, torch.tensor([p]), None, max_new_tokens=9, eos_token_id=[]).tokens == hf_greedy(model, p, 9)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_prompt_lookup_equals_hf_greedy(kind):
    model = model_for(kind)
    accepted = 0
    for i, p in enumerate(prompts(20, seed=3)):
        n = (5, 17, 40)[i % 3]
        out = generate(model, p, PromptLookupDrafter(max_tokens=4 + i % 7), max_new_tokens=n, eos_token_id=[])
        assert out.tokens == hf_greedy(model, p, n), f"prompt {i}"
        accepted += sum(out.stats.accepted)
        assert sum(out.from_draft) == sum(out.stats.accepted)
    assert accepted > 0  # random tiny models loop, and prompt lookup copies the loops


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_draft_model_equals_hf_greedy(kind):
    target = model_for(kind, seed=0)
    small = model_for(kind, seed=1)  # another random model, same vocabulary
    for i, p in enumerate(prompts(12, seed=4)):
        n = (3, 20, 33)[i % 3]
        ref = hf_greedy(target, p, n)
        out = generate(target, p, DraftModelDrafter(small, max_tokens=8, initial_tokens=2 + i % 5, confidence=0.0),
                       max_new_tokens=n, eos_token_id=[])
        assert out.tokens == ref, f"prompt {i}"
        assert sum(out.stats.drafted) > 0


def test_fallback_drafter_drafts_with_the_model_only_where_the_input_has_nothing():
    """Prompt lookup first, the draft model where it finds no match: greedy's output, and the draft
    model runs on fewer steps than it would alone."""
    from specsuite.core.speculation.draft import FallbackDrafter

    target, small = model_for("llama", seed=0), model_for("llama", seed=0)  # the target drafts for itself
    for i, p in enumerate(prompts(6, seed=9, lengths=(10, 40))):
        both = FallbackDrafter(PromptLookupDrafter(), DraftModelDrafter(small, max_tokens=6, confidence=0.0))
        proposals = {"prompt_lookup": 0, "draft_model": 0}
        propose = both.propose

        def counted(tokens, max_depth, propose=propose):
            draft = propose(tokens, max_depth)
            proposals[both.last.name] += draft is not None
            return draft

        both.propose = counted
        out = generate(target, p, both, max_new_tokens=30, eos_token_id=[])
        assert out.tokens == hf_greedy(target, p, 30), i
        assert proposals["draft_model"] > 0 and sum(out.stats.accepted) > 0
        assert both.name == "prompt_lookup+draft_model"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_target_as_its_own_draft_model_is_almost_always_accepted(kind):
    target = model_for(kind)
    drafted = accepted = 0
    for i, p in enumerate(prompts(8, seed=5)):
        out = generate(target, p, DraftModelDrafter(target, max_tokens=8, confidence=0.0), max_new_tokens=30,
                       eos_token_id=[])
        assert out.tokens == hf_greedy(target, p, 30), f"prompt {i}"
        drafted += sum(out.stats.drafted)
        accepted += sum(out.stats.accepted)
        assert out.stats.forward_passes < 15
    assert drafted > 0 and accepted / drafted > 0.95


@pytest.mark.parametrize("sizes", [None, ()], ids=["size-ladder", "uncapped"])
@pytest.mark.parametrize("kind,attn,count", [
    ("llama", "sdpa", 20), ("qwen2", "sdpa", 20), ("llama", "eager", 10), ("qwen2", "eager", 10),
])
def test_oracle_token_trees_equal_hf_greedy(kind, attn, count, sizes, keep_path_spy):
    model = model_for(kind, attn)
    accepted = 0
    for i, p in enumerate(prompts(count, seed=6)):
        n = (1, 4, 17, 40)[i % 4]
        truth = hf_greedy(model, p, n + 10)
        oracle = OracleTreeDrafter(p, truth, seed=i)
        out = generate(model, p, oracle, max_new_tokens=n, eos_token_id=[], policy=policy(model, draft_sizes=sizes))
        assert out.tokens == truth[:n], f"prompt {i}"
        assert out.finish_reason == "length" and len(out.from_draft) == n
        assert sum(out.from_draft) == sum(out.stats.accepted) == oracle.accepted
        accepted += oracle.accepted
        if n > 1:
            assert out.stats.forward_passes < n  # a right draft is always offered: fewer passes
    assert accepted > 0
    # accepted paths that are not nodes 0..k: the cache kept scattered nodes (the non-crop branch)
    assert keep_path_spy["non_prefix"] > 0


def test_eos_inside_a_draft_ends_the_generation_there():
    model = model_for("llama")
    eos_from_draft = tested = 0
    for i, p in enumerate(prompts(20, seed=7)):
        truth = hf_greedy(model, p, 40)
        # the first token that makes its first appearance mid-continuation becomes the EOS
        k = next((k for k in range(3, 30) if truth[k] not in truth[:k]), None)
        if k is None:
            continue
        eos = truth[k]
        ref = hf_greedy(model, p, 40, eos=eos)
        assert ref == truth[: k + 1]
        oracle = OracleTreeDrafter(p, truth, seed=i, depth=(6, 8), branches=1, corrupt=0.0)
        out = generate(model, p, oracle, max_new_tokens=40, eos_token_id=eos)
        assert out.tokens == ref and out.finish_reason == "eos", f"prompt {i}"
        assert len(out.from_draft) == len(out.tokens) == out.stats.new_tokens
        tested += 1
        eos_from_draft += out.from_draft[-1]
    assert tested >= 10 and eos_from_draft >= 5  # the oracle drafted past the EOS and it was cut there


def test_eos_as_a_set_and_as_the_first_token():
    model = model_for("llama")
    p = prompts(1, seed=8)[0]
    truth = hf_greedy(model, p, 10)
    out = generate(model, p, PromptLookupDrafter(), max_new_tokens=10, eos_token_id={truth[0], 12345})
    assert out.tokens == truth[:1] and out.finish_reason == "eos"
    # ignore_eos: the greedy continuation goes on through the end token to max_new_tokens
    out = generate(model, p, PromptLookupDrafter(), SamplingParams(10, ignore_eos=True), eos_token_id={truth[0], 12345})
    assert out.tokens == truth and out.finish_reason == "length"


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_drafts_past_max_new_tokens_are_cut(n):
    model = model_for("qwen2")
    for i, p in enumerate(prompts(6, seed=9)):
        truth = hf_greedy(model, p, n + 10)
        oracle = OracleTreeDrafter(p, truth, seed=i, depth=(8, 8), corrupt=0.0, ignore_max_depth=True)
        out = generate(model, p, oracle, max_new_tokens=n, eos_token_id=[])
        assert out.tokens == truth[:n] == hf_greedy(model, p, n)
        assert out.finish_reason == "length" and len(out.tokens) == n


def test_max_new_tokens_one_is_one_forward_without_a_draft():
    model = model_for("llama")
    calls = []

    class Spy(PromptLookupDrafter):
        def propose(self, tokens, max_depth):
            calls.append(max_depth)
            return super().propose(tokens, max_depth)

    for p in prompts(5, seed=10):
        out = generate(model, p, Spy(), max_new_tokens=1, eos_token_id=[])
        assert out.tokens == hf_greedy(model, p, 1)
        assert out.stats.forward_passes == 1 and out.stats.drafted == [0]
    assert calls == []  # no room for a draft: the drafter is not even asked


def test_empty_draft_is_no_draft():
    model = model_for("llama")

    class Empty(Drafter):
        def propose(self, tokens, max_depth):
            return Draft([], [])

    p = prompts(1, seed=11)[0]
    out = generate(model, p, Empty(), max_new_tokens=7, eos_token_id=[])
    assert out.tokens == hf_greedy(model, p, 7) and out.stats.drafted == [0] * 7


@pytest.mark.parametrize("margin", [1e9, 0.3])
def test_tie_guard_redo_keeps_greedy_output(margin):
    """A large tie margin makes rows 'unsure' (all of them, or the closer calls): the loop then
    recomputes those positions one token at a time, and the output is still exactly greedy."""
    model = model_for("llama")
    redone = 0
    for i, p in enumerate(prompts(8, seed=12)):
        truth = hf_greedy(model, p, 25)
        oracle = OracleTreeDrafter(p, truth, seed=i, depth=(3, 8))
        out = generate(model, p, oracle, max_new_tokens=20, eos_token_id=[], policy=policy(model, tie_margin=margin))
        assert out.tokens == truth[:20], f"prompt {i}"
        # the oracle always drafts: an undrafted step is a redo, or the last step when one token is left
        redone += sum(d == 0 for d in out.stats.drafted) - 1
    assert redone > 8


def test_generation_stops_at_the_context_length():
    model = model_for("llama", max_positions=32)
    p = prompts(1, seed=13, lengths=(29, 29))[0][:29]
    truth = hf_greedy(model, p, 3)
    out = generate(model, p, PromptLookupDrafter(), max_new_tokens=10, eos_token_id=[])
    assert out.tokens == truth and out.finish_reason == "context"


def test_empty_prompt_is_rejected():
    model = model_for("llama")
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], max_new_tokens=3)
    with pytest.raises(ValueError, match="empty"):
        generate(model, torch.zeros(1, 0, dtype=torch.long), max_new_tokens=3)


def test_no_room_for_new_tokens_is_rejected():
    model = model_for("llama")
    for n in (0, -1):
        with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
            generate(model, [1, 2, 3], max_new_tokens=n)


def test_prompt_longer_than_the_context_is_rejected():
    model = model_for("llama", max_positions=32)
    for length in (32, 40):
        with pytest.raises(ValueError, match="context"):
            generate(model, [5] * length, max_new_tokens=3)


def test_negative_tie_margin_is_rejected():
    with pytest.raises(ValueError, match="tie_margin"):
        generate(model_for("llama"), [1, 2, 3], max_new_tokens=2, policy=policy(model_for("llama"), tie_margin=-0.1))


@pytest.mark.parametrize("n", [0, -1])
def test_max_new_tokens_below_one_is_rejected(n):
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model_for("llama"), [1, 2, 3], max_new_tokens=n)


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_drafted_ids_outside_the_vocabulary_are_rejected(bad):
    class Bad(Drafter):
        name = "bad"

        def propose(self, tokens, max_depth):
            return Draft.from_paths([[3, bad], [4]])

    with pytest.raises(ValueError, match="vocabulary"):
        generate(model_for("llama"), [1, 2, 3], Bad(), max_new_tokens=5)


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        generate(model_for("llama"), [1, 2, 3], params=SamplingParams(max_new_tokens=5, stop_strings=["x"]))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_oracle_token_trees_equal_hf_greedy_in_bf16(kind, keep_path_spy):
    """The same in bf16, where draft rows run grouped (a tiny model's matmuls round alike for one
    row and many, so this isolates the attention)."""
    model = tiny_model(kind, max_positions=512).to(torch.bfloat16)
    exact = choose_backend(model, "exact")  # the exact forms, whatever they cost here
    assert replace(exact, engine_linear=None) == EXACT_BF16 and exact.packed is not None and exact.packed is not choose_backend(model, "exact").packed
    for i, p in enumerate(prompts(12, seed=8, lengths=(1, 200))):
        n = (17, 40, 60)[i % 3]
        truth = hf_greedy(model, p, n + 10)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=n, eos_token_id=[], backend=exact)
        assert out.tokens == truth[:n], f"prompt {i}"


def test_a_near_tie_after_a_cached_prefix_is_decided_by_the_whole_prefill():
    """The first token after a cached prefix is taken from the cached rows unless its top two
    logits are closer than the tie margin; then the whole prompt is prefilled, as plain decoding
    does. (A huge margin makes every first token a near-tie.)"""
    from specsuite.core import PrefixCache

    model = model_for("llama")
    shared = prompts(1, seed=4, lengths=(40, 41))[0]
    a, b = shared + [7, 8, 9, 10, 11, 12, 13, 14, 15], shared + [21, 22, 23, 24, 25, 26, 27, 28, 29]
    for margin, reused in ((1e-4, True), (1e9, False)):
        cache = PrefixCache(model.config)
        generate(model, a, max_new_tokens=2, eos_token_id=[], prefix_cache=cache)
        out = generate(model, b, PromptLookupDrafter(), max_new_tokens=12, eos_token_id=[], prefix_cache=cache,
                       policy=policy(model, tie_margin=margin))
        assert out.tokens == hf_greedy(model, b, 12)
        assert (out.stats.cached_prompt_tokens > 0) == reused


def test_fp32_near_ties_of_prefill_and_one_token_steps_are_redone_as_plain_decoding(monkeypatch):
    """In fp32 on the CPU our prefill and one-token steps run on other kernels than plain decoding's
    (exact_linear.fp32_linear): a near-tie there is redone as plain decoding computes it, the first
    token by a plain whole-prompt prefill, later ones by a plain one-token step. In bf16 these
    forwards are plain decoding's own and nothing is redone. (A huge margin makes every row a near-tie.)"""
    model = model_for("llama")
    p = prompts(1, seed=5, lengths=(20, 21))[0]
    forwards = []  # every forward embeds its tokens once, on our decoder or HF's model alike
    embedding = torch.nn.functional.embedding
    monkeypatch.setattr(torch.nn.functional, "embedding", lambda *a, **k: forwards.append(1) or embedding(*a, **k))
    out = generate(model, p, NoDrafter(), max_new_tokens=6, eos_token_id=[], policy=policy(model, tie_margin=1e9))
    monkeypatch.undo()
    assert out.tokens == hf_greedy(model, p, 6)
    assert out.stats.forward_passes == 2 + 2 * 5 == len(forwards)  # each forward counted once
    assert len(out.stats.accepted) == 1 + 2 * 5 and out.stats.prefill_s <= out.stats.total_s
    assert generate(model, p, NoDrafter(), max_new_tokens=6, eos_token_id=[]).tokens == out.tokens
    bf16 = tiny_model("llama").to(torch.bfloat16)
    exact = choose_backend(bf16, "exact")
    out = generate(bf16, p, NoDrafter(), max_new_tokens=6, eos_token_id=[],
                   policy=replace(exact.policy, tie_margin=1e9), backend=exact)
    assert out.tokens == hf_greedy(bf16, p, 6) and out.stats.forward_passes == 6
