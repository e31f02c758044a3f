"""The draft-then-verify loop is exactly greedy decoding, whatever the drafter proposes.

Tiny randomly initialised models (built from a config, seeded) stand in for real ones: every test
compares `specsuite.core.generate` token for token with Hugging Face's own `model.generate(do_sample=False)`.
Plus unit tests of the draft tree, the tree attention mask and greedy verification on hand-made logits.
"""

from __future__ import annotations

import copy
import importlib
import random

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig, Qwen2Config

from specsuite.core import Draft, DraftModelDrafter, Drafter, NoDrafter, PromptLookupDrafter, generate
from specsuite.core import decoder_forward, exact_linear
from specsuite.core.backend import EXACT_BF16, FP32_CPU, MIN_SHORT_CALL_ROWS, backend_for, choose_backend, use_backend
from specsuite.core.draft import SizeLadder
from specsuite.core.draft_budget import DraftBudget, GoodputCap, StepCost
from specsuite.core.exact_attention import NAME as EXACT
from specsuite.core.exact_linear import FP32_ROW_BUCKETS
from specsuite.core.verify import tree_attention_mask, verify_greedy

# `specsuite.core.generate` the attribute is the function; the module is needed for monkeypatching
gen_mod = importlib.import_module("specsuite.core.generate")
VOCAB = 96
CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config}


def tiny_model(kind: str = "llama", attn: str = EXACT, seed: int = 0, vocab: int = VOCAB,
               max_positions: int = 256, init: float = 0.3):
    """A 2-layer, 32-wide random model in fp32. A large initializer_range gives peaked, varied
    next-token distributions (the default 0.02 makes every logit nearly equal)."""
    torch.manual_seed(seed)
    config = CONFIGS[kind](
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=max_positions, initializer_range=init,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()
    assert model.config._attn_implementation == attn
    if attn == EXACT:  # as load_model does
        exact_linear.install(model)
    return model


_MODELS: dict = {}


def model_for(kind: str = "llama", attn: str = EXACT, seed: int = 0, **kw):
    key = (kind, attn, seed, tuple(sorted(kw.items())))
    if key not in _MODELS:
        _MODELS[key] = tiny_model(kind, attn, seed, **kw)
    return _MODELS[key]


def hf_greedy(model, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def prompts(count: int, seed: int, vocab: int = VOCAB, lengths=(1, 24)) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*lengths))]
        if len(p) > 6 and rng.random() < 0.5:  # repeated text gives prompt lookup something to copy
            p = p + p[: rng.randint(2, len(p))]
        out.append(p)
    return out


class OracleTreeDrafter(Drafter):
    """Knows the true greedy continuation; proposes trees that mix the true path (of random depth,
    sometimes corrupted after a few tokens) with wrong branches, the true branch in random sibling
    order, so that accepted paths are often not the first laid-out nodes."""

    name = "oracle"

    def __init__(self, prompt: list[int], truth: list[int], seed: int, vocab: int = VOCAB,
                 depth: tuple[int, int] = (1, 8), branches: int = 3, corrupt: float = 0.25,
                 ignore_max_depth: bool = False) -> None:
        self.prompt, self.truth, self.rng, self.vocab = prompt, truth, random.Random(seed), vocab
        self.depth, self.branches, self.corrupt, self.ignore_max_depth = depth, branches, corrupt, ignore_max_depth
        self.accepted = self.drafted = self.proposals = 0

    def reset(self, prompt, sampling=None) -> None:
        assert list(prompt) == self.prompt

    def propose(self, tokens, max_depth):
        rng = self.rng
        done = len(tokens) - len(self.prompt)
        # The loop only ever extends the sequence with the true greedy tokens.
        assert tokens[: len(self.prompt)] == self.prompt and tokens[len(self.prompt):] == self.truth[:done]
        depth = rng.randint(*self.depth)
        if not self.ignore_max_depth:
            depth = min(depth, max_depth)
        true = self.truth[done: done + depth]
        if not true:
            return None
        if len(true) > 1 and rng.random() < self.corrupt:  # partially right: a wrong token after a few
            cut = rng.randrange(1, len(true))
            true = true[:cut] + [(true[cut] + 1 + rng.randrange(self.vocab - 1)) % self.vocab]
        paths = [true]
        for _ in range(rng.randint(0, self.branches)):
            cut = rng.randrange(len(true))
            wrong = (true[cut] + 1 + rng.randrange(self.vocab - 1)) % self.vocab
            paths.append(true[:cut] + [wrong] + [rng.randrange(self.vocab) for _ in range(rng.randint(0, 4))])
        rng.shuffle(paths)
        self.proposals += 1
        return Draft.from_paths(paths)

    def update(self, draft, path):
        self.accepted += len(path)
        self.drafted += len(draft) if draft else 0


@pytest.fixture
def keep_path_spy(monkeypatch):
    """Counts cache compactions that keep a path other than the first laid-out nodes."""
    calls = {"non_prefix": 0, "total": 0}
    real = gen_mod._keep_path

    def spy(cache, root, path, n):
        calls["total"] += 1
        if path != list(range(len(path))):
            calls["non_prefix"] += 1
        return real(cache, root, path, n)

    monkeypatch.setattr(gen_mod, "_keep_path", spy)
    return calls


# ---- the draft tree ------------------------------------------------------------------------

def test_draft_chain_and_depths():
    d = Draft.chain([4, 5, 6])
    assert d.parents == [-1, 0, 1] and d.depths == [1, 2, 3] and d.is_chain and len(d) == 3


@pytest.mark.parametrize("parents", [[0], [-1, 1], [-1, 2, 0], [-2], [-1, 0, 5]])
def test_draft_parents_must_precede_children(parents):
    with pytest.raises(ValueError, match="parent"):
        Draft(list(range(len(parents))), parents)


def test_draft_needs_one_parent_per_token():
    with pytest.raises(ValueError):
        Draft([1, 2], [-1])


def test_from_paths_merges_shared_prefixes():
    d = Draft.from_paths([[1, 2, 3], [1, 2, 4], [1, 5], [6], [1, 2, 3, 7]])
    assert d.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert d.parents == [-1, 0, 1, 1, 0, -1, 2]
    assert d.depths == [1, 2, 3, 3, 2, 1, 4]
    assert not d.is_chain
    assert Draft.from_paths([[3, 4, 5]]).is_chain
    assert len(Draft.from_paths([])) == 0


def test_limit_depth_keeps_a_valid_tree_and_its_probs():
    d = Draft.from_paths([[1, 2, 3], [1, 4], [5, 6, 7, 8]])
    d.probs = torch.arange(len(d), dtype=torch.float32)[:, None].repeat(1, 3)
    assert d.limit_depth(4) is d
    two = d.limit_depth(2)
    # kept nodes in order: 1 (d1), 2 (d2), 4 (d2), 5 (d1), 6 (d2)
    assert two.tokens == [1, 2, 4, 5, 6]
    assert two.parents == [-1, 0, 0, -1, 3]
    assert two.depths == [1, 2, 2, 1, 2]
    old = [d.tokens.index(t) for t in two.tokens]
    assert torch.equal(two.probs[:, 0], torch.tensor(old, dtype=torch.float32))
    one = d.limit_depth(1)
    assert one.tokens == [1, 5] and one.parents == [-1, -1]
    assert len(d.limit_depth(0)) == 0


def test_limit_size_keeps_the_shallowest_nodes_as_a_valid_tree():
    d = Draft.from_paths([[1, 2, 3], [1, 4], [5, 6, 7, 8]])  # nodes 1 2 3 4 5 6 7 8, depths 1 2 3 2 1 2 3 4
    d.probs = torch.arange(len(d), dtype=torch.float32)[:, None].repeat(1, 3)
    assert d.limit_size(8) is d
    four = d.limit_size(4)  # depth 1 (1, 5), then depth 2 in layout order (2, 4)
    assert four.tokens == [1, 2, 4, 5] and four.parents == [-1, 0, 0, -1]
    assert torch.equal(four.probs[:, 0], torch.tensor([0.0, 1.0, 3.0, 4.0]))
    chain = Draft.chain([9, 8, 7, 6, 5])
    assert chain.limit_size(3).tokens == [9, 8, 7] and chain.limit_size(3).is_chain


def test_size_ladder_climbs_on_whole_acceptances_and_drops_on_a_partial_one():
    ladder = SizeLadder((3, 7, 15))
    assert ladder.value == 3
    ladder.update(accepted=3, deepest=3)
    assert ladder.value == 7
    ladder.update(accepted=7, deepest=7)
    ladder.update(accepted=15, deepest=15)
    assert ladder.value == 15  # the top rung holds
    ladder.update(accepted=4, deepest=15)
    assert ladder.value == 3
    with pytest.raises(ValueError):
        SizeLadder((3, 0))


def test_fp32_drafts_are_capped_by_their_expected_goodput():
    """In fp32 on the CPU, drafts are capped by `GoodputCap` on the step costs measured for the
    model: the output stays greedy's. Given draft_sizes, they climb that ladder instead (3 nodes,
    then 7, 15, 31 while accepted whole); draft_sizes=() verifies every node the drafter proposes."""
    model = model_for("llama")
    backend = backend_for(model)
    assert isinstance(backend.draft_cost, StepCost) and backend.draft_cost.rows == list(FP32_ROW_BUCKETS)
    p = prompts(1, seed=3)[0]
    truth = hf_greedy(model, p, 60)
    out = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                   prefill_draft=0)
    assert out.tokens == truth[:50] and max(out.stats.drafted) <= DraftBudget.CAPS[-1]
    laddered = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                        prefill_draft=0, draft_sizes=(3, 7, 15, 31))
    assert laddered.tokens == truth[:50]
    assert laddered.stats.drafted[1] <= 3 and max(laddered.stats.drafted) <= 31
    uncapped = generate(model, p, OracleTreeDrafter(p, truth, seed=0), max_new_tokens=50, eos_token_id=[],
                        draft_sizes=(), prefill_draft=0)
    assert uncapped.tokens == truth[:50] and uncapped.stats.drafted[1] > 3
    bf16 = tiny_model("llama").to(torch.bfloat16)
    # exact bf16: one rung, what its forms verify in one call per layer; plain: no cap
    assert choose_backend(bf16, "exact").draft_sizes == (31,) and choose_backend(bf16, "plain").draft_sizes == ()
    assert choose_backend(bf16, "exact").draft_cost is None


def test_goodput_cap_follows_the_step_cost_and_the_acceptance_seen():
    """A cap of c nodes gains sum(a^i, i = 1..c) tokens at acceptance rate a and costs cost(1 + c):
    where every row costs a step, one node; where rows are free, the most; in between, fewer
    nodes once drafts keep failing at their first node than while they pass whole."""
    assert GoodputCap(StepCost({1: 0.1, 2: 0.2})).value == 1
    assert GoodputCap(StepCost({1: 0.1, 64: 0.1})).value == DraftBudget.CAPS[-1]
    sloped = StepCost({1: 0.10, 8: 0.13, 32: 0.25})
    passing, failing = GoodputCap(sloped), GoodputCap(sloped)
    for _ in range(10):
        passing.update(accepted=passing.value, deepest=passing.value)
        failing.update(accepted=0, deepest=failing.value)
    assert failing.value < sloped.rows[1] < passing.value
    assert failing.tried == 10 and passing.accepted == passing.tried


def test_fp32_prefill_verifies_a_draft_too():
    """In fp32 on the CPU the prefill's forward also verifies a draft of up to 16 nodes: the output
    stays greedy's with fewer forward passes. In bf16 the prefill drafts nothing by default."""
    model = model_for("llama")
    assert backend_for(model).prefill_draft == 16
    for i, p in enumerate(prompts(6, seed=14, lengths=(2, 40))):
        truth = hf_greedy(model, p, 30)
        runs = {k: generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=25, eos_token_id=[],
                            prefill_draft=k) for k in (None, 0, 3)}
        for k, out in runs.items():
            assert out.tokens == truth[:25], (i, k)
        assert 0 < runs[None].stats.drafted[0] <= 16 and runs[3].stats.drafted[0] <= 3
        assert runs[0].stats.drafted[0] == 0
        assert runs[None].stats.forward_passes <= runs[0].stats.forward_passes
    bf16 = tiny_model("llama").to(torch.bfloat16)
    assert choose_backend(bf16, "exact").prefill_draft == 0 == choose_backend(bf16, "plain").prefill_draft
    with pytest.raises(ValueError, match="prefill_draft"):
        generate(model, [1, 2, 3], max_new_tokens=2, prefill_draft=-1)


# ---- the tree attention mask ---------------------------------------------------------------

def _rows(mask):
    return [[int(v) for v in row] for row in mask[0, 0]]


def test_tree_attention_mask_small_tree():
    d = Draft([10, 11, 12, 13], [-1, 0, 0, 1])  # node 0 with children 1 and 2; node 3 under node 1
    m = tree_attention_mask(d, past=2)
    assert m.shape == (1, 1, 5, 7) and m.dtype == torch.bool
    assert _rows(m) == [
        # past  root  n0 n1 n2 n3
        [1, 1, 1, 0, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0, 0],  # node 0
        [1, 1, 1, 1, 1, 0, 0],  # node 1
        [1, 1, 1, 1, 0, 1, 0],  # node 2: not its sibling
        [1, 1, 1, 1, 1, 0, 1],  # node 3: root, 0, 1, itself
    ]


def test_tree_attention_mask_with_extra_rows():
    d = Draft([10, 11, 12], [-1, -1, 1])  # two roots' children; node 2 under node 1
    m = tree_attention_mask(d, past=1, extra=2)
    assert m.shape == (1, 1, 6, 7)
    assert _rows(m) == [
        # past x0 x1 root n0 n1 n2
        [1, 1, 0, 0, 0, 0, 0],  # extra 0
        [1, 1, 1, 0, 0, 0, 0],  # extra 1
        [1, 1, 1, 1, 0, 0, 0],  # root
        [1, 1, 1, 1, 1, 0, 0],  # node 0
        [1, 1, 1, 1, 0, 1, 0],  # node 1
        [1, 1, 1, 1, 0, 1, 1],  # node 2
    ]


def test_tree_attention_mask_of_a_chain_is_causal():
    m = tree_attention_mask(Draft.chain([1, 2, 3]), past=3, extra=1)
    assert torch.equal(m[0, 0], torch.ones(5, 8, dtype=torch.bool).tril(3))


# ---- greedy verification on hand-made logits -----------------------------------------------

def logits_with_argmax(best: list[int], vocab: int = 10, gap: float = 1.0) -> torch.Tensor:
    """Rows whose argmax is `best[i]`, beating the runner-up (the next index) by `gap`."""
    rows = torch.zeros(len(best), vocab)
    for i, b in enumerate(best):
        rows[i, b] = 2.0
        rows[i, (b + 1) % vocab] = 2.0 - gap
    return rows


def test_verify_greedy_chain():
    d = Draft.chain([5, 7, 9])
    assert verify_greedy(d, logits_with_argmax([5, 7, 3, 0])) == ([0, 1], 3)
    assert verify_greedy(d, logits_with_argmax([5, 7, 9, 4])) == ([0, 1, 2], 4)
    assert verify_greedy(d, logits_with_argmax([1, 7, 9, 4])) == ([], 1)


def test_verify_greedy_tree_follows_the_matching_child():
    d = Draft.from_paths([[1, 2], [1, 3], [4]])  # tokens [1, 2, 3, 4], parents [-1, 0, 0, -1]
    assert (d.tokens, d.parents) == ([1, 2, 3, 4], [-1, 0, 0, -1])
    assert verify_greedy(d, logits_with_argmax([1, 3, 0, 6, 0])) == ([0, 2], 6)
    assert verify_greedy(d, logits_with_argmax([1, 2, 8, 0, 0])) == ([0, 1], 8)
    assert verify_greedy(d, logits_with_argmax([4, 0, 0, 0, 7])) == ([3], 7)
    assert verify_greedy(d, logits_with_argmax([1, 5, 0, 0, 0])) == ([0], 5)
    assert verify_greedy(d, logits_with_argmax([9, 0, 0, 0, 0])) == ([], 9)


def test_verify_greedy_exact_tie_takes_the_first_index_like_generate():
    logits = torch.zeros(2, 10)
    logits[0, [3, 6]] = 1.0
    logits[1, 2] = 1.0
    assert verify_greedy(Draft.chain([6]), logits) == ([], 3)
    assert verify_greedy(Draft.chain([3]), logits) == ([0], 2)


def test_verify_greedy_tie_margin_stops_before_an_unsure_row():
    d = Draft.chain([5, 7, 9])
    near = logits_with_argmax([5, 7, 9, 4], gap=1.0)
    near[1, 8] = near[1, 7] - 0.05  # row 1 (after node 0) is a near-tie
    assert verify_greedy(d, near) == ([0, 1, 2], 4)  # no margin: trusted
    assert verify_greedy(d, near, tie_margin=0.01) == ([0, 1, 2], 4)
    assert verify_greedy(d, near, tie_margin=0.1) == ([0], None)  # recompute after node 0
    root_tie = logits_with_argmax([5, 7, 3, 0], gap=0.05)
    assert verify_greedy(d, root_tie, tie_margin=0.1) == ([], None)


def test_verify_greedy_tie_margin_in_a_tree():
    d = Draft.from_paths([[1, 2], [1, 3]])
    logits = logits_with_argmax([1, 3, 0, 6])
    logits[3, 7] = logits[3, 6] - 0.01  # the row after node 2 is unsure
    assert verify_greedy(d, logits, tie_margin=0.1) == ([0, 2], None)
    assert verify_greedy(d, logits, tie_margin=0.001) == ([0, 2], 6)


# ---- the loop equals Hugging Face greedy decoding -------------------------------------------

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
    from specsuite.core.draft import FallbackDrafter

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
    ("llama", EXACT, 20), ("qwen2", EXACT, 20),
    ("llama", "sdpa", 10), ("qwen2", "sdpa", 10), ("llama", "eager", 10), ("qwen2", "eager", 10),
])
def test_oracle_token_trees_equal_hf_greedy(kind, attn, count, sizes, keep_path_spy):
    model = model_for(kind, attn)
    accepted = 0
    for i, p in enumerate(prompts(count, seed=6)):
        n = (1, 4, 17, 40)[i % 4]
        truth = hf_greedy(model, p, n + 10)
        oracle = OracleTreeDrafter(p, truth, seed=i)
        out = generate(model, p, oracle, max_new_tokens=n, eos_token_id=[], draft_sizes=sizes)
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
        out = generate(model, p, oracle, max_new_tokens=20, eos_token_id=[], tie_margin=margin)
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


# ---- bad input -----------------------------------------------------------------------------

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
        generate(model_for("llama"), [1, 2, 3], max_new_tokens=2, tie_margin=-0.1)


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
        generate(model_for("llama"), [1, 2, 3], max_new_tokens=5, stop_strings=["x"])


def test_grouped_draft_rows_round_like_one_row_decode_steps_in_bf16():
    """exact_attention runs draft rows of similar length as one batched call over keys padded with
    masked zeros (see `_groups`); each row must come out bit for bit as its own one-row call, the
    call of a decode step. Qwen2.5-0.5B's attention shapes; chains (prefixes) and trees (gathered keys).
    The grouping rule is torch 2.13's AMX kernel's; where the self-check finds that this machine's
    kernel rounds otherwise (seen on an AVX2-only CPU), rows run one per call, and that must hold too."""
    from specsuite.core.exact_attention import _grouping_is_exact, _groups, _one_row_calls

    grouped = _grouping_is_exact(14, 2, 64)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for trial in range(80):
        past, n = int(torch.randint(1, 1100, (), generator=gen)), int(torch.randint(2, 24, (), generator=gen))
        q = torch.randn(1, 14, n, 64, generator=gen).bfloat16()
        k, v = (torch.randn(1, 2, past + n, 64, generator=gen).bfloat16() for _ in range(2))
        if trial % 2:  # a chain: row j sees a prefix
            visible = [past + j + 1 for j in range(n)]
        else:  # a tree: the cache plus a random subset of the draft rows before it
            visible = [torch.cat([torch.arange(past + 1), past + 1 + torch.nonzero(
                torch.rand(j, generator=gen) < 0.5).squeeze(-1)]) for j in range(n)]
        lengths = [v_ if isinstance(v_, int) else len(v_) for v_ in visible]
        groups = _groups(lengths) if grouped else [[i] for i in range(n)]
        assert sorted(i for g in groups for i in g) == list(range(n))
        for group in groups:
            out = _one_row_calls(q[:, :, group], k, v, [visible[i] for i in group], 0.125, True)
            for col, i in enumerate(group):
                keys = torch.arange(visible[i]) if isinstance(visible[i], int) else visible[i]
                one = torch.nn.functional.scaled_dot_product_attention(
                    q[:, :, i: i + 1], k[:, :, keys], v[:, :, keys], scale=0.125, enable_gqa=True)
                assert torch.equal(out[0, col], one[0, :, 0]), (trial, past, i)
                checked += 1
    assert checked > 800


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_after_a_cached_prefix_rounds_like_the_whole_prompts_prefill(dtype):
    """With a prefix cache, the new prompt rows run after the cached keys; their attention must come
    out bit for bit as in one causal prefill of the whole prompt (what runs without the cache).
    Qwen2.5-0.5B's attention shapes, random prompt lengths and numbers of new rows."""
    import types

    from specsuite.core.exact_attention import _prefill_block
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = types.SimpleNamespace(is_causal=True, training=False, num_key_value_groups=7)
    gen = torch.Generator().manual_seed(1)
    for trial in range(30):
        end = int(torch.randint(100, 1300, (), generator=gen))
        block = int(torch.randint(2, 90, (), generator=gen))
        q = torch.randn(1, 14, end, 64, generator=gen).to(dtype)
        k, v = (torch.randn(1, 2, end, 64, generator=gen).to(dtype) for _ in range(2))
        whole = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)[0]
        block_out = _prefill_block(module, q[:, :, end - block:], k, v, end - block, {"scaling": 0.125})
        assert torch.equal(block_out, whole[:, end - block:]), (trial, end, block)


QWEN_LINEARS = [(896, 896, True), (128, 896, True), (4864, 896, False), (896, 4864, False)]
QWEN_15B_DOWN = (1536, 8960, False)  # Qwen2.5-1.5B's down projection


def test_linear_rows_round_like_one_row_decode_steps_in_bf16():
    """exact_linear computes draft rows (and one-token steps) in the form `_form` chose; each row
    must come out bit for bit as its own one-row `F.linear`, the call of HF's decode step.
    Qwen2.5-0.5B's shapes and Qwen2.5-1.5B's down projection. On torch 2.13's AMX kernel plain
    multi-row calls do not always round so (the down projections' wide inputs), which the last
    checks keep in view."""
    gen = torch.Generator().manual_seed(0)
    plain_differs = 0
    for out_f, in_f, bias in QWEN_LINEARS + [QWEN_15B_DOWN]:
        weight = (torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5).bfloat16()
        b = torch.randn(out_f, generator=gen).bfloat16() if bias else None
        for m in (1, 2, 9, 17, 32, 33, 40, 70, 128, 161, 200):
            x = (torch.randn(m, in_f, generator=gen) * 2).bfloat16()
            alone = torch.cat([torch.nn.functional.linear(x[i: i + 1], weight, b) for i in range(m)])
            assert torch.equal(exact_linear.one_row_rounding(x, weight, b), alone), (out_f, in_f, m)
            plain_differs += not torch.equal(torch.nn.functional.linear(x, weight, b), alone)
    if exact_linear._form(896, 4864, False)[:2] == ("padded", 33):  # the kernel this was found on
        assert plain_differs
        # and no Qwen layer falls back to one call per row (exact, but a verify step ~1.5x slower)
        assert all(exact_linear._form(*shape).kind == "packed" for shape in QWEN_LINEARS if shape != (896, 4864, False))
        assert exact_linear._form(*QWEN_15B_DOWN) == ("padded", 192, 15)


def test_exact_bf16_drafts_fit_the_short_calls_of_a_wide_down_projection():
    """A one-layer model with Qwen2.5-1.5B's MLP shapes: where its down projection rounds as
    one-row calls column-major only up to `short` rows, drafts are capped to fit (the padded calls
    beyond cost ~1.3x a forward); every row still rounds as a decode step, so the output is greedy's."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=1536, intermediate_size=8960, num_hidden_layers=1,
                         num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=EXACT, dtype=torch.bfloat16).eval()
    exact_linear.install(model)
    rows = exact_linear.short_call_rows(model)
    assert 2 <= rows <= exact_linear.PLAIN_ROWS
    cap = use_backend(model, "exact").draft_sizes
    assert cap == ((rows - 1,) if MIN_SHORT_CALL_ROWS <= rows < exact_linear.PLAIN_ROWS else (31,))
    if exact_linear._form(*QWEN_15B_DOWN) == ("padded", 192, 15):  # torch 2.13's AMX kernel, where this was found
        assert rows == 15 and cap == (14,)
    for i, p in enumerate(prompts(3, seed=21, vocab=512, lengths=(5, 40))):
        truth = hf_greedy(model, p, 40)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i, vocab=512, depth=(4, 24)), max_new_tokens=30,
                       eos_token_id=[])
        assert out.tokens == truth[:30], f"prompt {i}"
        assert max(out.stats.drafted) <= cap[0]


def test_split_sums_finds_where_a_matmul_sums_its_input_apart():
    """`_split_sums` on matmuls whose order of summation is known: one running sum over the input
    (blocks of 32 in turn), and two halves summed apart then added, as a kernel's threads may."""

    def blocks(x: torch.Tensor, weight: torch.Tensor, start: int, end: int) -> torch.Tensor:
        acc = torch.zeros(x.shape[0], weight.shape[0])
        for k in range(start, end, 32):  # each block holds at most one nonzero product per output
            acc = acc + x[:, k: k + 32].float() @ weight[:, k: k + 32].float().T
        return acc

    one_sum = lambda x, w, b: blocks(x, w, 0, x.shape[1]).bfloat16()  # noqa: E731
    halves = lambda x, w, b: (blocks(x, w, 0, 320) + blocks(x, w, 320, x.shape[1])).bfloat16()  # noqa: E731
    assert exact_linear._split_sums(one_sum, 64, 640, [1, 2]) == [[], []]
    assert exact_linear._split_sums(halves, 64, 640, [1, 2]) == [[320], [320]]


def test_exact_linear_does_without_packed_calls_where_onednn_refuses_them(monkeypatch):
    """On a CPU without avx512 torch refuses bf16 oneDNN calls on packed weights: the forms then
    do without them, and rows still round as one-row calls."""
    def refused(x, weight, bias):
        raise RuntimeError("mkldnn_linear: bf16 path needs the cpu support avx_ne_convert or avx512bw")

    monkeypatch.setattr(exact_linear, "_packed_call", refused)
    for cached in (exact_linear.packed_bf16_runs, exact_linear._form):
        cached.cache_clear()
    try:
        assert not exact_linear.packed_bf16_runs()
        gen = torch.Generator().manual_seed(4)
        weight = (torch.randn(128, 896, generator=gen) * 896 ** -0.5).bfloat16()
        x = torch.randn(9, 896, generator=gen).bfloat16()
        assert exact_linear._form(128, 896, False).kind != "packed"
        alone = torch.cat([torch.nn.functional.linear(x[i: i + 1], weight) for i in range(9)])
        assert torch.equal(exact_linear.one_row_rounding(x, weight, None), alone)
    finally:  # the forms of this machine again for the other tests
        monkeypatch.undo()
        for cached in (exact_linear.packed_bf16_runs, exact_linear._form):
            cached.cache_clear()


def test_fp32_rows_are_the_linear_layer_in_padded_column_calls():
    """`fp32_rows` (2-4-row calls in fp32): `weight @ x.T` in calls of 2, 4, 8, 16 or 32 zero-padded
    columns, `F.linear`'s values up to fp32 rounding, as contiguous rows."""
    gen = torch.Generator().manual_seed(2)
    for out_f, in_f, bias in QWEN_LINEARS:
        weight = torch.randn(out_f, in_f, generator=gen) * in_f ** -0.5
        b = torch.randn(out_f, generator=gen) if bias else None
        for m in (1, 2, 3, 5, 9, 17, 32, 40):
            x = torch.randn(m, in_f, generator=gen)
            out = exact_linear.fp32_rows(x, weight, b)
            assert out.shape == (m, out_f) and out.is_contiguous()
            torch.testing.assert_close(out, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_fp32_forwards_take_the_fast_kernels_and_plain_calls_stay_plain():
    """In fp32 under block_rows: 2-4 rows as `fp32_rows`, other counts (a one-token step, a
    prefill, long drafts) on oneDNN with packed weights, all `F.linear`'s values up to rounding;
    outside block_rows (HF's own generate) bit for bit `F.linear`. The packed weights follow
    in-place changes of the weight and stay out of copies of the model."""
    gen = torch.Generator().manual_seed(3)
    layer = torch.nn.Linear(896, 128)
    model = torch.nn.Sequential(layer)
    exact_linear.install(model)
    for rows, block in ((1, 1), (3, 1), (4, 4), (9, 4), (40, 40)):
        x = torch.randn(1, rows, 896, generator=gen)
        with FP32_CPU.rows(block, rows):
            out = layer(x)
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5)
        if 2 <= rows <= 4:
            assert torch.equal(out[0], exact_linear.fp32_rows(x[0], layer.weight, layer.bias))
        elif exact_linear.ONEDNN:
            packed = exact_linear.packed_weight(layer.weight)
            assert torch.equal(out, torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], ""))
        assert torch.equal(layer(x), plain)  # outside block_rows
    x = torch.randn(1, 9, 896, generator=gen)
    with torch.no_grad():
        layer.weight.mul_(2)
    with FP32_CPU.rows(9, 9):
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   rtol=1e-5, atol=1e-5)
    twin = copy.deepcopy(model)
    assert torch.equal(twin[0].weight, layer.weight)


def test_exact_linear_splits_block_rows_from_draft_rows():
    """Under block_rows(n, total): the n block rows as one call of their own (a prefill), every
    other row as a one-row call; an lm_head that sees only the last rows counts from the end."""
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(896, 4864, bias=False).bfloat16()
    assert exact_linear.install(torch.nn.Sequential(layer)) == 1 and isinstance(layer, exact_linear.ExactLinear)
    x = torch.randn(1, 50, 896, generator=gen).bfloat16()
    alone = torch.cat([torch.nn.functional.linear(x[:, i: i + 1], layer.weight) for i in range(50)], dim=1)
    with EXACT_BF16.rows(40, 50):
        out = layer(x)
        tail = layer(x[:, -11:])  # logits_to_keep=11: the last block row and the draft rows
    assert torch.equal(out[:, :40], torch.nn.functional.linear(x[:, :40], layer.weight))
    assert torch.equal(out[:, 40:], alone[:, 40:])
    assert torch.equal(tail, alone[:, -11:])
    assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight))  # outside: plain


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_oracle_token_trees_equal_hf_greedy_in_bf16(kind, keep_path_spy):
    """The same in bf16, where draft rows run grouped (a tiny model's matmuls round alike for one
    row and many, so this isolates the attention)."""
    model = tiny_model(kind, max_positions=512).to(torch.bfloat16)
    assert use_backend(model, "exact") is EXACT_BF16  # the exact forms, whatever they cost here
    for i, p in enumerate(prompts(12, seed=8, lengths=(1, 200))):
        n = (17, 40, 60)[i % 3]
        truth = hf_greedy(model, p, n + 10)
        out = generate(model, p, OracleTreeDrafter(p, truth, seed=i), max_new_tokens=n, eos_token_id=[])
        assert out.tokens == truth[:n], f"prompt {i}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [96, 1024, 151936])
def test_top_two_equals_argmax_and_topk_with_ties(dtype, vocab):
    from specsuite.core.verify import top_two

    gen = torch.Generator().manual_seed(vocab)
    for trial in range(30):
        logits = (torch.randn(5, vocab, generator=gen) * 4).to(dtype)
        if trial % 2:  # exact ties of the maximum, in one block or across blocks
            spots = torch.randint(0, vocab, (3,), generator=gen)
            logits[:, spots] = logits.max() + 1
            if trial % 4 == 1:
                logits[:, spots[0] // 128 * 128 + 1 if vocab > 256 else 0] = logits.max()
        best, first, second = top_two(logits)
        ref = logits.float().topk(2, dim=-1).values
        assert torch.equal(best, logits.argmax(-1)), trial
        assert torch.equal(first, ref[:, 0]) and torch.equal(second, ref[:, 1]), trial


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", [EXACT, "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_forward_equals_the_models_own_forward(kind, attn, dtype, monkeypatch):
    """`decoder_forward` runs the model's modules without transformers' per-call machinery: the
    logits and the cached keys and values must be bit for bit those of `model(...)`, at a prefill, a
    decode step, a chain of draft rows, a token tree and a block of fresh tokens with a draft."""
    model = tiny_model(kind, attn).to(dtype)
    assert decoder_forward.supports(model)
    steps = [(list(range(10, 40)), None), ([41], None), ([42], Draft.chain([43, 44, 45])),
             ([46], Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])), ([47, 48, 49], Draft.chain([50, 51]))]
    caches = {}
    for lean in (True, False):
        monkeypatch.setattr(decoder_forward, "supports", lambda m, lean=lean: lean)
        cache, logits = DynamicCache(config=model.config), []
        with torch.inference_mode():
            for fresh, draft in steps:
                logits.append(backend_for(model).forward(model, fresh, cache, cache.get_seq_length(), draft))
        caches[lean] = (cache, logits)
    for ours, theirs in zip(caches[True][1], caches[False][1]):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(caches[True][0].layers, caches[False][0].layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_decoder_forward_leaves_eager_attention_to_the_model():
    assert not decoder_forward.supports(tiny_model("llama", "eager"))


def test_step_cost_times_every_row_count_in_each_backend():
    """`specsuite step-cost` times verify forwards by row count in the model's exact form and the
    plain one, and leaves the model's backend as it was."""
    from specsuite.step_cost import format_costs, measure_step_costs

    model = model_for("qwen2")
    costs = measure_step_costs(model, [1, 3, 6], context=10, reps=2)
    assert set(costs) == {"fp32-cpu", "plain"}
    assert all(set(c) == {1, 3, 6} and min(c.values()) > 0 for c in costs.values())
    assert backend_for(model).name == FP32_CPU.name
    assert len(format_costs(costs).splitlines()) == 4


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
                       tie_margin=margin)
        assert out.tokens == hf_greedy(model, b, 12)
        assert (out.stats.cached_prompt_tokens > 0) == reused


def test_fp32_near_ties_of_prefill_and_one_token_steps_are_redone_as_plain_decoding():
    """In fp32 on the CPU our prefill and one-token steps run on other kernels than plain decoding's
    (exact_linear.fp32_linear): a near-tie there is redone as plain decoding computes it, the first
    token by a plain whole-prompt prefill, later ones by a plain one-token step. In bf16 these
    forwards are plain decoding's own and nothing is redone. (A huge margin makes every row a near-tie.)"""
    model = model_for("llama")
    p = prompts(1, seed=5, lengths=(20, 21))[0]
    forwards = []  # every forward of the model embeds its tokens once
    hook = model.model.embed_tokens.register_forward_hook(lambda *a: forwards.append(1))
    out = generate(model, p, NoDrafter(), max_new_tokens=6, eos_token_id=[], tie_margin=1e9)
    hook.remove()
    assert out.tokens == hf_greedy(model, p, 6)
    assert out.stats.forward_passes == 2 + 2 * 5 == len(forwards)  # each forward counted once
    assert len(out.stats.accepted) == 1 + 2 * 5 and out.stats.prefill_s <= out.stats.total_s
    assert generate(model, p, NoDrafter(), max_new_tokens=6, eos_token_id=[]).tokens == out.tokens
    bf16 = tiny_model("llama").to(torch.bfloat16)
    use_backend(bf16, "exact")
    out = generate(bf16, p, NoDrafter(), max_new_tokens=6, eos_token_id=[], tie_margin=1e9)
    assert out.tokens == hf_greedy(bf16, p, 6) and out.stats.forward_passes == 6
