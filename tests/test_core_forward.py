"""The Llama forward (core/forward.py): bit for bit the model's own forward."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specsuite.core import Draft
from specsuite.core import forward as llama
from specsuite.core.backend import plain_backend
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
                # plain: no row plan, the layers as the model computes them
                logits.append(plain_backend(dtype).forward(model, fresh, cache, cache.get_seq_length(), draft))
        caches[lean] = (cache, logits)
    for ours, theirs in zip(caches[True][1], caches[False][1]):
        assert torch.equal(ours, theirs)
    for ours, theirs in zip(caches[True][0].layers, caches[False][0].layers):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_forward_leaves_eager_attention_to_the_model():
    assert not llama.supports(tiny_model("llama", "eager"))
