"""The owned decoder (core/model/decoder.py): bit for bit HF's model, its linear layers the backend's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import DynamicCache

from specsuite.core import Draft
from specsuite.core.kernels.exact_linear import packed_bf16_runs
from specsuite.core.kernels.int8_linear import int8_runs
from specsuite.core.kernels.linear import FormLinear
from specsuite.core.model import forward as llama
from specsuite.core.model.backend import EXACT_BF16, FP32_CPU, INT8, PLAIN_PACKED, Backend, Decoders, plain_backend
from specsuite.core.model.decoder import Decoder, Linear
from conftest import tiny_model

STEPS = [(list(range(10, 40)), None), ([41], None), ([42], Draft.chain([43, 44, 45])),
         ([46], Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])), ([47, 48, 49], Draft.chain([50, 51]))]


class HFLayers:
    """The decoder's interface on HF's own submodules and rotary function, as forward.py ran them
    before the decoder was ours: the reference the owned decoder must equal bit for bit."""

    def __init__(self, model) -> None:
        self.model, self.config = model, model.config
        attn = model.model.layers[0].self_attn
        self.scaling, self.device, self.dtype = attn.scaling, model.device, model.dtype
        self.norm = model.model.norm
        self.lm_head = lambda x, block: model.lm_head(x)

    def __call__(self, ids, positions, attend, block):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        body = self.model.model
        x = body.embed_tokens(ids)
        cos, sin = body.rotary_emb(x, positions)
        for i, layer in enumerate(body.layers):
            attn, h = layer.self_attn, layer.input_layernorm(x)
            shape = (*h.shape[:-1], -1, attn.head_dim)
            q, k, v = (p(h).view(shape).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            x = x + attn.o_proj(attend(i, q, k, v))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


def batched(model, backend):
    kv, dim, layers, dtype = model.config.num_key_value_heads, 8, model.config.num_hidden_layers, model.dtype
    keys = [torch.zeros(4, kv, 64, dim, dtype=dtype) for _ in range(layers)]
    values = [torch.zeros(4, kv, 64, dim, dtype=dtype) for _ in range(layers)]
    ps = [[3, 5, 7, 11], [2, 4, 6] * 7, [1, 9] * 6]
    with torch.inference_mode():
        prefill = llama.forward(model, backend, keys, values, [llama.Rows(0, p) for p in ps], [None] * 3)
        step = llama.forward(model, backend, keys, values, [llama.Rows(len(p), [5]) for p in ps],
                             [Draft.chain([6, 7]), None, Draft.from_paths([[8, 9], [3]])], where=[0, 1, 3])
    return [prefill, step, *keys, *values]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decoder_computes_batched_forwards_as_hfs_modules(kind, dtype, monkeypatch):
    """The batched forward on the owned decoder, bit for bit the same forward on HF's submodules.
    (One-sequence forwards are checked against `model(...)` itself: test_core_forward.py.)"""
    model = tiny_model(kind).to(dtype)
    backend = plain_backend(dtype)
    ours = batched(model, backend)
    monkeypatch.setattr(Backend, "decoders", lambda self, m: Decoders(m, HFLayers(m), HFLayers(m)))
    theirs = batched(model, backend)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_the_decoder_shares_the_models_tensors():
    model = tiny_model("qwen2")
    decoder = Decoder.from_hf(model)
    assert decoder.embed is model.model.embed_tokens.weight
    assert decoder.layers[1].mlp.down.weight is model.model.layers[1].mlp.down_proj.weight
    assert decoder.layers[0].q_proj.bias is model.model.layers[0].self_attn.q_proj.bias
    assert decoder.lm_head.weight is model.lm_head.weight


def test_each_backend_swaps_its_forms_in_once():
    """The modules are chosen when the decoder is built: plain `Linear` for `plain`, the backend's
    forms (on its packed store) otherwise; the engine's decoder in the engine's form."""
    model = tiny_model("llama").to(torch.bfloat16)
    plain = plain_backend(torch.bfloat16).loaded(model)
    assert all(type(m) is Linear for m in plain.decoders(model).one.modules() if hasattr(m, "weight")
               and m.weight.dim() == 2 and m is not plain.decoders(model).one)
    exact = EXACT_BF16.loaded(model)
    decoders = exact.decoders(model)
    assert decoders is exact.decoders(model) and decoders.model is model  # built once, kept by the backend
    q = decoders.one.layers[0].q_proj
    assert isinstance(q, FormLinear) and q.form is EXACT_BF16.linear and q.weights is exact.packed
    assert decoders.engine.layers[0].q_proj.form is (exact.engine_linear or exact.linear)


def backends(dtype):
    out = [plain_backend(dtype), EXACT_BF16 if dtype == torch.bfloat16 else FP32_CPU]
    out += [PLAIN_PACKED] if dtype == torch.bfloat16 and packed_bf16_runs() else []
    return out + ([INT8] if int8_runs() else [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_loaded_backend_computes_as_one_whose_decoders_are_made_per_forward(dtype):
    """A backend's kept decoders (`loaded`) and decoders made for each forward (a backend that kept
    none) compute alike; a copy changed in its forms by `replace` does not use the kept ones."""
    model = tiny_model("qwen2").to(dtype)
    for backend in backends(dtype):
        loaded = backend.loaded(model)
        unloaded = replace(loaded, loaded_decoders=None)
        assert loaded.decoders(model) is loaded.loaded_decoders is not None
        assert replace(loaded, draft_cost=None).decoders(model) is loaded.loaded_decoders  # the same forms
        changed = replace(loaded, mlp_rows=7, exact_rows=True)
        assert changed.decoders(model) is not loaded.loaded_decoders and changed.decoders(model).forms == changed.forms()

        def cached(b):
            cache, logits = DynamicCache(config=model.config), []
            with torch.inference_mode():
                for fresh, draft in STEPS:
                    logits.append(b.forward(model, fresh, cache, cache.get_seq_length(), draft))
            return logits

        ours = cached(loaded) + batched(model, loaded)
        theirs = cached(unloaded) + batched(model, unloaded)
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), backend.name
