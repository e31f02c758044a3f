"""The owned decoder (core/model/decoder.py): bit for bit forward.py's layer loop on HF's modules."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specsuite.core import Draft
from specsuite.core.model import forward as llama
from specsuite.core.model.backend import plain_backend
from specsuite.core.model.decoder import Decoder
from conftest import tiny_model

STEPS = [(list(range(10, 40)), None), ([41], None), ([42], Draft.chain([43, 44, 45])),
         ([46], Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])), ([47, 48, 49], Draft.chain([50, 51]))]


def owned_layers(decoder: Decoder):
    """forward.py's `_layers` run by the decoder (the attention still forward.py's)."""
    def layers(model, ids, positions, attend, plan):
        hf = model.model.layers
        return decoder(ids, positions, lambda i, q, k, v: attend(i, hf[i].self_attn, q, k, v), 0)
    return layers


def both(monkeypatch, model, run):
    """run() with forward.py's own layer loop, then with the decoder's."""
    theirs = run()
    decoder = Decoder.from_hf(model)
    with monkeypatch.context() as m:
        m.setattr(llama, "_layers", owned_layers(decoder))
        ours = run()
    return ours, theirs


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_computes_cache_forwards_as_forward_py(kind, dtype, monkeypatch):
    model = tiny_model(kind).to(dtype)

    def run():
        cache, logits = DynamicCache(config=model.config), []
        with torch.inference_mode():
            for fresh, draft in STEPS:
                logits.append(plain_backend(dtype).forward(model, fresh, cache, cache.get_seq_length(), draft))
        return logits + [layer.keys for layer in cache.layers]

    ours, theirs = both(monkeypatch, model, run)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_computes_batched_forwards_as_forward_py(kind, dtype, monkeypatch):
    model = tiny_model(kind).to(dtype)
    kv, dim, layers = model.config.num_key_value_heads, 8, model.config.num_hidden_layers
    ps = [[3, 5, 7, 11], [2, 4, 6] * 7, [1, 9] * 6]

    def run():
        keys = [torch.zeros(4, kv, 64, dim, dtype=dtype) for _ in range(layers)]
        values = [torch.zeros(4, kv, 64, dim, dtype=dtype) for _ in range(layers)]
        backend = plain_backend(dtype)
        prefill = llama.forward(model, backend, keys, values, [llama.Rows(0, p) for p in ps], [None] * 3)
        step = llama.forward(model, backend, keys, values, [llama.Rows(len(p), [5]) for p in ps],
                             [Draft.chain([6, 7]), None, Draft.from_paths([[8, 9], [3]])], where=[0, 1, 2])
        return [prefill, step, *keys, *values]

    ours, theirs = both(monkeypatch, model, run)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoders_norm_and_output_layer_are_the_models(dtype):
    model = tiny_model("qwen2").to(dtype)
    decoder = Decoder.from_hf(model)
    x = torch.randn(1, 7, model.config.hidden_size).to(dtype)
    assert torch.equal(decoder.lm_head(decoder.norm(x), 0), model.lm_head(model.model.norm(x)))
    # shared, not copied
    assert decoder.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert decoder.layers[1].mlp.down.weight is model.model.layers[1].mlp.down_proj.weight
