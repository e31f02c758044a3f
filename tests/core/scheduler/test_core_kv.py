"""The KV stores (core/scheduler/kv.py): the one rollback `keep_path`, and each store's keep after a step."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specsuite.core.model.backend import choose_backend
from specsuite.core.speculation.draft import Draft
from specsuite.core.scheduler.kv import CacheStore, keep_path
from specsuite.core.scheduler.sequence import Request, Sequence
from conftest import model_for, prompts


def test_keep_path_moves_the_accepted_nodes_behind_the_base():
    t = torch.arange(2 * 10 * 3).reshape(2, 10, 3)  # positions on dim -2
    before = t.clone()
    keep_path([t], 4, [1, 3, 4])  # nodes 1, 3, 4 laid out at 5, 7, 8
    assert torch.equal(t[:, 4:7], before[:, [5, 7, 8]])
    assert torch.equal(t[:, :4], before[:, :4])  # the positions before the nodes are untouched


def test_keep_path_of_the_first_laid_out_nodes_moves_nothing():
    t = torch.randn(1, 2, 8, 4)
    before = t.clone()
    keep_path([t], 3, [0, 1, 2])
    assert torch.equal(t, before)


def test_cache_store_keeps_a_tree_path_as_if_only_it_had_been_computed():
    """After a forward over [root, tree], keeping a path leaves the cache a forward over
    [root, path] as a chain would have left it (positions and values of the path's nodes)."""
    model = model_for("llama", "sdpa")
    prompt = prompts(1, seed=3)[0] + [7]
    tree = Draft.from_paths([[5, 6, 7], [8, 9], [5, 3]])  # nodes: 5, 6, 7, 8, 9, 3
    path = [0, 5]  # 5 then 3
    backend = choose_backend(model)
    store = CacheStore(model, backend)
    chain = DynamicCache(config=model.config)
    with torch.inference_mode():
        backend.forward(model, prompt, store.cache, 0, tree)
        backend.forward(model, prompt, chain, 0, Draft.chain([5, 3]))
        seq = Sequence(0, Request(prompt), eos=set(), context=256)
        seq.length = len(prompt) + len(path)  # as `Sequence.settle` leaves it after accepting `path`
        store.keep(0, seq, len(prompt), path, prefilled=False)
    assert store.cache.get_seq_length() == chain.get_seq_length()
    for ours, theirs in zip(store.cache.layers, chain.layers):
        torch.testing.assert_close(ours.keys, theirs.keys)
        torch.testing.assert_close(ours.values, theirs.values)
