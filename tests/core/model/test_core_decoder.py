"""The owned decoder (core/model/decoder.py): bit for bit forward.py's layer loop on HF's modules."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specsuite.core import Draft
from specsuite.core.model import forward as llama
from specsuite.core.kernels.exact_linear import packed_bf16_runs
from specsuite.core.kernels.int8_linear import int8_runs
from specsuite.core.model.backend import EXACT_BF16, FP32_CPU, INT8, PLAIN_PACKED, plain_backend
from specsuite.core.model.decoder import Decoder
from conftest import tiny_model

STEPS = [(list(range(10, 40)), None), ([41], None), ([42], Draft.chain([43, 44, 45])),
         ([46], Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])), ([47, 48, 49], Draft.chain([50, 51]))]


def owned_layers(decoder: Decoder):
    """forward.py's `_layers` run by the decoder (the attention still forward.py's), the plan's
    block passed on: its linear layers are the decoder's own modules."""
    def layers(model, ids, positions, attend, plan):
        hf = model.model.layers
        return decoder(ids, positions, lambda i, q, k, v: attend(i, hf[i].self_attn, q, k, v),
                       ids.shape[1] if plan is None else plan.block)
    return layers


def backends(dtype):
    """The backends whose forms run here, owned (their packed weights made once)."""
    out = [plain_backend(dtype), EXACT_BF16 if dtype == torch.bfloat16 else FP32_CPU]
    out += [PLAIN_PACKED] if dtype == torch.bfloat16 and packed_bf16_runs() else []
    return [b.owned() for b in out + ([INT8] if int8_runs() else [])]


def both(monkeypatch, model, run, decoder=None):
    """run() with forward.py's own layer loop, then with the decoder's (default: plain layers)."""
    theirs = run()
    decoder = decoder or Decoder.from_hf(model)
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


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backends_modules_compute_as_their_row_plans(kind, dtype, monkeypatch):
    """Each backend's decoder (its forms as swapped modules) computes one-sequence forwards and
    batched forwards bit for bit as forward.py's layer loop does with the backend's `RowPlan`."""
    model = tiny_model(kind).to(dtype)
    kv, dim, layers = model.config.num_key_value_heads, 8, model.config.num_hidden_layers
    for backend in backends(dtype):
        def cached():
            cache, logits = DynamicCache(config=model.config), []
            with torch.inference_mode():
                for fresh, draft in STEPS:
                    logits.append(backend.forward(model, fresh, cache, cache.get_seq_length(), draft))
            return logits

        def batched():
            keys = [torch.zeros(3, kv, 64, dim, dtype=dtype) for _ in range(layers)]
            values = [torch.zeros(3, kv, 64, dim, dtype=dtype) for _ in range(layers)]
            ps = [[3, 5, 7, 11], [2, 4, 6] * 7, [1, 9] * 6]
            prefill = llama.forward(model, backend, keys, values, [llama.Rows(0, p) for p in ps], [None] * 3)
            step = llama.forward(model, backend, keys, values, [llama.Rows(len(p), [5]) for p in ps],
                                 [Draft.chain([6, 7]), None, Draft.from_paths([[8, 9], [3]])])
            return [prefill, step, *keys]

        for run, decoder in ((cached, backend.decoder(model)), (batched, backend.decoder(model, engine=True))):
            ours, theirs = both(monkeypatch, model, run, decoder)
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (backend.name, run.__name__)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_output_layer_module_counts_its_block_from_the_end(dtype):
    """The lm_head sees only the kept rows: its block is the plan's, less the rows it does not see."""
    model = tiny_model("qwen2").to(dtype)
    x = torch.randn(1, 12, model.config.hidden_size).to(dtype)
    for backend in backends(dtype):
        head = backend.decoder(model).lm_head
        for block, keep in ((12, 12), (9, 4), (1, 12), (3, 2)):
            plan = backend.plan(block, 12)
            want = model.lm_head(x[:, -keep:]) if plan is None else plan.project(model.lm_head, x[:, -keep:])
            assert torch.equal(head(x[:, -keep:], block - (12 - keep)), want), backend.name
