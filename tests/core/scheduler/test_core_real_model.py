"""The speculative core on a real model (smollm2-135m): exactly HF's greedy output, stop strings
cut where HF cuts, streaming reassembles the text, the prefix cache is reused without changing
the output.

The exactness tests run in fp32 and in bf16. In bf16 on CPU, HF's greedy output is only matched
because exact_attention and exact_linear round every verified row as a one-token decode step does:
bf16 logits tie exactly at ~1% of positions here, and before exact_linear drafting with a model
differed from HF on 3 of 10 prompts through the last bits of multi-row matmuls."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from specsuite.core import EngineConfig, SamplingParams
from specsuite.core import (
    DraftModelDrafter, Generation, NoDrafter, PrefixCache, PromptLookupDrafter, TextPiece, eos_token_ids, generate,
    stream,
)
from specsuite.core.scheduler.chat import chat_prompt_ids
from specsuite.core.model.backend import choose_backend

pytestmark = pytest.mark.real_model

MAX_NEW = 32
PROMPTS = [  # (user, system); several ask to repeat text, so that drafts get accepted
    ("Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.", None),
    ("Correct the grammar of this sentence: She go to school every days and she like it.",
     "You correct grammar. Reply with the corrected sentence only."),
    ("Copy this text: 'Alice was beginning to get very tired of sitting by her sister on the bank.'", None),
    ("List the numbers from 1 to 20, separated by commas.", None),
    ("What is the capital of France?", None),
    ("def add(a, b):\n    return a + b\n\nRewrite this Python function with type hints.", None),
]


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def lm(request, smollm2_fp32):
    model, tok = smollm2_fp32
    if request.param == "bf16":
        model = copy.deepcopy(model).to(torch.bfloat16)
    # bf16: the exact forms, whatever they cost on this CPU
    return model, tok, sorted(eos_token_ids(model, tok)), choose_backend(model, "exact")


def hf_greedy(model, ids, eos, max_new_tokens=MAX_NEW, **kwargs) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos, pad_token_id=eos[0], **kwargs)
    return out[0, len(ids):].tolist()


@pytest.fixture(scope="module")
def cases(lm):
    """(prompt ids, HF greedy continuation) per prompt, computed once."""
    model, tok, eos, _ = lm
    return [(ids, hf_greedy(model, ids, eos)) for ids in (chat_prompt_ids(tok, u, s) for u, s in PROMPTS)]


def _show(tok, out, ref) -> str:
    k = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
    return f"first difference at token {k}: {tok.decode(out)!r} != {tok.decode(ref)!r}"


def test_prompt_lookup_equals_hf_greedy(lm, cases):
    model, tok, eos, backend = lm
    wrong, accepted = [], 0
    for i, (ids, ref) in enumerate(cases):
        out = generate(model, ids, PromptLookupDrafter(), max_new_tokens=MAX_NEW, tokenizer=tok, backend=backend)
        if out.tokens != ref:
            wrong.append(f"prompt {i} ({model.dtype}): {_show(tok, out.tokens, ref)}")
        else:
            assert out.finish_reason == ("eos" if ref[-1] in eos else "length")
        accepted += sum(out.stats.accepted)
    assert not wrong, "\n".join(wrong)
    assert accepted >= 20


def test_draft_model_equals_hf_greedy(lm, cases):
    """The model drafts for itself: the drafts are its own greedy tokens, so most are accepted
    (rejections come only from the tie guard); the output is still exactly HF's."""
    model, tok, eos, backend = lm
    wrong, drafted, accepted = [], 0, 0
    for i, (ids, ref) in enumerate(cases):
        out = generate(model, ids, DraftModelDrafter(model, max_tokens=8), max_new_tokens=MAX_NEW, tokenizer=tok,
                       backend=backend)
        if out.tokens != ref:
            wrong.append(f"prompt {i} ({model.dtype}): {_show(tok, out.tokens, ref)}")
        drafted += sum(out.stats.drafted)
        accepted += sum(out.stats.accepted)
    assert not wrong, "\n".join(wrong)
    assert accepted >= 0.6 * drafted > 0


def test_stop_strings_cut_where_hf_cuts(lm, cases):
    model, tok, eos, backend = lm
    text0, text3 = tok.decode(cases[0][1]), tok.decode(cases[3][1])  # the copied sentence, the number list
    assert "fox" in text0 and "own f" in text0 and "5, 6" in text3, (text0, text3)
    # a word inside a copied (drafted) span, a span across tokens with a second never-seen string,
    # a span in a list, the very first comma
    for i, stops in [(0, ["fox"]), (0, ["zzz", "own f"]), (3, ["5, 6"]), (3, [","])]:
        ids, ref = cases[i]
        hf = hf_greedy(model, ids, eos, stop_strings=stops, tokenizer=tok)
        out = generate(model, ids, PromptLookupDrafter(), params=SamplingParams(max_new_tokens=MAX_NEW, stop_strings=stops), tokenizer=tok, backend=backend)
        assert out.tokens == hf, (stops, tok.decode(out.tokens), tok.decode(hf))
        assert out.finish_reason == "stop_string"
        assert out.tokens == ref[: len(out.tokens)]
        assert any(s in tok.decode(out.tokens) for s in stops)
        assert not any(s in tok.decode(out.tokens[:-1]) for s in stops)  # the shortest such prefix
        assert len(out.from_draft) == len(out.tokens) == out.stats.new_tokens
    # a stop string that never appears changes nothing
    ids, ref = cases[2]
    out = generate(model, ids, PromptLookupDrafter(), params=SamplingParams(max_new_tokens=MAX_NEW, stop_strings=["qqqq"]), tokenizer=tok, backend=backend)
    assert out.tokens == ref and out.finish_reason != "stop_string"


def test_the_batched_engine_cuts_at_stop_strings_as_generate_does(smollm2_fp32):
    """Stop strings per request in one batch (fp32: a batch's rows round within the tie margin
    of one-row steps here, so each output is generate()'s)."""
    from specsuite.core.scheduler.engine import BatchEngine, Request

    model, tok = smollm2_fp32
    eos = sorted(eos_token_ids(model, tok))
    asks = [(0, ["fox"]), (3, ["5, 6"]), (2, ["qqqq"]), (3, [","])]
    ids = [chat_prompt_ids(tok, *PROMPTS[i]) for i, _ in asks]
    requests = [Request(p, PromptLookupDrafter(), SamplingParams(max_new_tokens=MAX_NEW, stop_strings=stops))
                for p, (_, stops) in zip(ids, asks)]
    results = dict(BatchEngine(model, EngineConfig(4, draft_budget=False), eos_token_id=eos, tokenizer=tok).run(requests))
    for k, (p, (_, stops)) in enumerate(zip(ids, asks)):
        alone = generate(model, p, PromptLookupDrafter(), params=SamplingParams(max_new_tokens=MAX_NEW, stop_strings=stops), tokenizer=tok)
        assert results[k].tokens == alone.tokens and results[k].finish_reason == alone.finish_reason, stops
    assert [results[k].finish_reason for k in range(4)].count("stop_string") == 3


@pytest.mark.xfail(strict=True, reason="HF also matches stop strings that begin in the prompt; specsuite "
                                       "searches the generated text only (reported, not decided here)")
def test_stop_string_spanning_the_prompt_boundary_like_hf(lm, cases):
    model, tok, eos, backend = lm
    ids, ref = cases[0]
    stop = "\n" + tok.decode(ref[:1])  # the prompt ends with "assistant\n"
    hf = hf_greedy(model, ids, eos, max_new_tokens=4, stop_strings=[stop], tokenizer=tok)
    out = generate(model, ids, NoDrafter(), params=SamplingParams(max_new_tokens=4, stop_strings=[stop]), tokenizer=tok, backend=backend)
    assert out.tokens == hf


def test_stream_reassembles_the_text_and_marks_drafted_pieces(lm, cases):
    model, tok, eos, backend = lm
    ids, ref = cases[0]
    *pieces, final = stream(functools.partial(generate, model, ids, PromptLookupDrafter(), max_new_tokens=MAX_NEW,
                                              backend=backend),
                            tok)
    assert isinstance(final, Generation) and all(isinstance(p, TextPiece) for p in pieces)
    assert final.tokens == ref
    assert "".join(p.text for p in pieces) == tok.decode(final.tokens, skip_special_tokens=True)
    assert any(p.from_draft for p in pieces) and any(not p.from_draft for p in pieces)
    assert all(p.text for p in pieces)


def test_stream_reraises_errors_in_the_consumer(lm):
    model, tok, eos, backend = lm
    with pytest.raises(ValueError, match="empty"):
        list(stream(functools.partial(generate, model, [], max_new_tokens=4, backend=backend), tok))


def test_prefix_cache_reuses_the_prompt_and_keeps_the_output(smollm2_fp32):
    """fp32 only: in bf16 a cache hit can change the answer on this CPU (here at the 6th token): the
    prompt rows after the cached prefix run through the linear layers in a call of fewer rows than
    a whole-prompt prefill, which rounds some of them otherwise (see the README, *Exactness*)."""
    model, tok = smollm2_fp32
    system = "You are a careful assistant. Answer the question briefly and precisely, in one sentence."
    ids = chat_prompt_ids(tok, "Who wrote Hamlet?", system)
    other = chat_prompt_ids(tok, "Why is the sky blue?", system)
    cache = PrefixCache(model.config)
    first = generate(model, ids, PromptLookupDrafter(), max_new_tokens=24, tokenizer=tok, prefix_cache=cache)
    assert first.stats.cached_prompt_tokens == 0
    second = generate(model, ids, PromptLookupDrafter(), max_new_tokens=24, tokenizer=tok, prefix_cache=cache)
    assert 0 < second.stats.cached_prompt_tokens <= len(ids) - cache.fresh_tokens
    assert second.tokens == first.tokens
    # another question after the same system prompt reuses the shared prefix, same output as without
    shared = generate(model, other, PromptLookupDrafter(), max_new_tokens=24, tokenizer=tok, prefix_cache=cache)
    plain = generate(model, other, PromptLookupDrafter(), max_new_tokens=24, tokenizer=tok)
    assert shared.stats.cached_prompt_tokens > 16 and shared.tokens == plain.tokens
    assert cache.hits == 2 and cache.misses == 1


def test_exact_linear_rounds_real_activations_as_one_row_calls_in_bf16(smollm2_fp32):
    """Every linear layer's inputs on a real text (a hook), 1..70 rows at a time: `one_row_rounding`
    gives each row bit for bit as its own one-row call, the call of a decode step."""
    from specsuite.core.kernels.exact_linear import one_row_rounding

    model = copy.deepcopy(smollm2_fp32[0]).to(torch.bfloat16)
    tok = smollm2_fp32[1]
    inputs = {}

    def keep(mod, args) -> None:  # returns None: the layer's input is unchanged
        inputs.setdefault(mod, args[0].reshape(-1, args[0].shape[-1]))

    hooks = [m.register_forward_pre_hook(keep) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    text = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
            "nothing to do: once or twice she had peeped into the book her sister was reading, but it had "
            "no pictures or conversations in it, 'and what is the use of a book,' thought Alice, 'without "
            "pictures or conversations?' So she was considering in her own mind.")
    ids = tok(text, return_tensors="pt").input_ids[:, :70]
    with torch.inference_mode():
        model(ids, logits_to_keep=ids.shape[1])
    for h in hooks:
        h.remove()
    assert len(inputs) == 7 * model.config.num_hidden_layers + 1
    with torch.inference_mode():
        for layer, x in inputs.items():
            alone = torch.cat([torch.nn.functional.linear(x[i: i + 1], layer.weight, layer.bias)
                               for i in range(len(x))])
            for m in (1, 2, 7, 20, 33, 50, len(x)):
                assert torch.equal(one_row_rounding(x[:m], layer.weight, layer.bias), alone[:m]), (layer, m)


def test_a_stop_string_is_searched_in_the_new_tail_only_and_found_across_its_start(smollm2):
    """Each step decodes only the output's tail (`_first_stop`): a stop string that began in
    tokens searched before and ends in the new ones is found, at the shortest prefix."""
    from specsuite.core.scheduler.sequence import _first_stop

    tok = smollm2[1]
    ids = tok("one two three four " * 40 + "the end of it")["input_ids"]
    ends = [k for k in range(1, len(ids) + 1) if "end of" in tok.decode(ids[:k])]
    for start in (ends[0] - 1, ends[0] - 2, 0):
        assert _first_stop(tok, ids, ["end of"], start) == ends[0]
    assert _first_stop(tok, ids, ["never here"], len(ids) - 1) is None
