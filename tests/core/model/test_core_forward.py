"""The Llama forward (core/model/forward.py): bit for bit the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specsuite.core import Draft
from specsuite.core.model import forward as llama
from specsuite.core.model.backend import plain_backend
from conftest import tiny_model


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_forward_equals_the_models_own_forward(kind, dtype, monkeypatch):
    """`forward.cache_forward` runs the model's modules without transformers' per-call machinery: the
    logits and the cached keys and values must be bit for bit those of `model(...)`, at a prefill, a
    decode step, a chain of draft rows, a token tree and a block of fresh tokens with a draft."""
    model = tiny_model(kind).to(dtype)
    assert llama.supports(model)
    steps = [(list(range(10, 40)), None), ([41], None), ([42], Draft.chain([43, 44, 45])),
             ([46], Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])), ([47, 48, 49], Draft.chain([50, 51]))]
    caches = {}
    for lean in (True, False):
        monkeypatch.setattr(llama, "supports", lambda m, lean=lean: lean)
        cache, logits = DynamicCache(config=model.config), []
        with torch.inference_mode():
            for fresh, draft in steps:
                # plain: plain linear modules, the layers as the model computes them
                logits.append(plain_backend(dtype).forward(model, fresh, cache, cache.get_seq_length(), draft))
        caches[lean] = (cache, logits)
    for ours, theirs in zip(caches[True][1], caches[False][1]):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(caches[True][0].layers, caches[False][0].layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_forward_leaves_eager_attention_to_the_model():
    assert not llama.supports(tiny_model("llama", "eager"))


@pytest.mark.parametrize("where", [[0, 2, 3], [9, 0, 4]])
def test_slots_with_gaps_compute_as_contiguous_slots(where):
    """The batched forward reads the cache slots of a step as one view where the sequences in
    flight fill at least half of them (the gaps padded), else by index: the same logits either way
    (bit for bit between views; within 1e-5 by index, as fp32 kernels order their sums by shape)."""
    model = tiny_model("qwen2")
    backend = plain_backend(model.dtype)
    layers = model.config.num_hidden_layers
    kv, dim = model.config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
    ps = [p[:n] for p, n in zip(([3, 5, 7, 11] * 8, [2, 4, 6] * 8, [1, 9] * 12), (4, 20, 11))]  # short and long

    def run(slots: list[int]) -> list[torch.Tensor]:
        keys = [torch.zeros(10, kv, 64, dim) for _ in range(layers)]
        values = [torch.zeros(10, kv, 64, dim) for _ in range(layers)]
        prefill = llama.forward(model, backend, keys, values, [llama.Rows(0, p) for p in ps], [None] * 3, where=slots)
        step = llama.forward(model, backend, keys, values, [llama.Rows(len(p), [5]) for p in ps],
                             [Draft.chain([6, 7]), None, Draft.chain([8])], where=slots)
        return [prefill, step]

    view, other = run([0, 1, 2]), run(where)
    if where == [0, 2, 3]:  # a view either way: the same calls, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(view, other))
    else:  # by index: on an AVX2-only CPU fp32 kernels may sum a gathered copy in another order
        assert all(torch.allclose(a, b, rtol=0, atol=1e-5) for a, b in zip(view, other))
