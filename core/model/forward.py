"""The forwards of a Llama-family decoder (ARCHITECTURES) on our own model (decoder.py), without
transformers' per-call machinery.

`generate()` makes a forward pass per step, and transformers' modeling code spends a noticeable
share of each around the tensor ops: decorators on every layer and attention call, mask
building, output records (docs/architecture-core.md, Measurements: forward overhead). The owned
decoder computes the same operations in the same order, its linear layers the backend's modules
(`Backend.decoders`), with one of two attentions:

- `cache_forward` (one sequence, a `DynamicCache`): HF's sdpa attention (`sdpa`) with the mask its
  model would build, or the exact attention (exact_attention.py), so its logits are bit for bit
  those of `model(...)` in plain form (tested against it on tiny random and real models);
- `forward` (the batched engine's slots): every slot's [fresh tokens, draft nodes] packed into one
  row list for the linear layers (no padding) and padded per slot only for attention (a mask per
  slot: its cached positions, causal fresh rows, tree ancestors for draft nodes).

Other architectures, and other attention implementations, take `model(...)` (`supports`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from ..speculation.draft import Draft
from ..kernels.exact_attention import exact_attention, sdpa
from ..speculation.verify import tree_attention_mask
from .decoder import Decoder

ARCHITECTURES = ("llama", "qwen2")
LONG_ROWS = 16  # slots with more rows (a prompt being prefilled) attend in a call of their own


def supports(model) -> bool:
    """Whether the owned decoder computes what this model's own forward does: its config asks for
    nothing the decoder lacks (and the model is not training: no dropout here)."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or {}
    return (config.model_type in ARCHITECTURES and not model.training
            and getattr(config, "_attn_implementation", None) == "sdpa" and config.hidden_act == "silu"
            and rope.get("rope_type", "default") == "default"
            and all(t == "full_attention" for t in getattr(config, "layer_types", None) or ()))


def causal_mask(past: int, rows: int) -> torch.Tensor | None:
    """The mask the modeling code gives sdpa for `rows` new tokens after `past` cached ones: None
    where the kernel's own causal flag (or no mask) does the same, else (1, 1, rows, past + rows) bool."""
    if rows == 1 or past == 0:
        return None
    return (torch.arange(past + rows)[None, :] <= past + torch.arange(rows)[:, None])[None, None]


def cache_forward(decoder: Decoder, ids: torch.Tensor, cache: DynamicCache, position_ids: torch.Tensor,
                  attention_mask: torch.Tensor | None, logits_to_keep: int, block: int, exact: bool = False,
                  head=None) -> torch.Tensor:
    """ids, position_ids (1, T); attention_mask: a (1, 1, T, past + T) bool mask, or None for causal
    attention. Appends the T tokens' keys and values to `cache`; returns the logits of the last
    `logits_to_keep` rows, (logits_to_keep, vocab). block: the first rows, computed as one
    prefill-like block (the others are draft rows); exact: the attention rounds the draft rows
    as one-token steps (exact_attention.py). head: computes the logits from the final hidden
    states (1, rows, dim) in place of the decoder's `lm_head`."""
    if attention_mask is None:
        attention_mask = causal_mask(cache.get_seq_length(), ids.shape[1])
    memo: dict = {}  # exact attention's row calls, planned once for all layers

    def attend(i, q, k, v):
        k, v = cache.update(k, v, i)
        if exact:
            out = exact_attention(q, k, v, attention_mask, block, memo, decoder.scaling)
        else:
            out = sdpa(q, k, v, attention_mask, decoder.scaling)
        return out.reshape(q.shape[0], q.shape[2], -1).contiguous()

    x = decoder(ids, position_ids, attend, block)
    hidden = decoder.norm(x)[:, -logits_to_keep:]
    return (head(hidden) if head else decoder.lm_head(hidden, block - (ids.shape[1] - logits_to_keep)))[0]


@dataclass
class Rows:
    """What a forward needs of a sequence: its cached length and the fresh tokens after it."""

    length: int
    fresh: list[int]


@torch.inference_mode()
def forward(model, backend, keys: list[torch.Tensor], values: list[torch.Tensor], slots: list,
            drafts: list[Draft | None], logits_rows: int | None = None, where: list[int] | None = None) -> torch.Tensor:
    """One forward over every slot's [fresh tokens, draft nodes] (`slots[i]`: a `Rows` or a
    `Sequence`), their keys and values written into `keys`/`values` (per layer: slots x heads x
    positions x dim) at cache slot `where[i]` (default i), on `backend`'s engine decoder (a
    `core.backend.Backend`'s, its linear layers in the engine's forms). Returns the logits, slot after slot, of its root (last
    fresh token) and each draft node (`logits_rows`=1: the root only): (rows, vocab)."""
    decoder = backend.decoders(model).engine
    device = decoder.device
    where = list(range(len(slots))) if where is None else where
    ids, positions, slot_of_row, write_at, wanted = [], [], [], [], []
    masks, pasts = [], []
    for s, (slot, draft) in enumerate(zip(slots, drafts)):
        nodes = draft.tokens if draft is not None else []
        f = len(slot.fresh)
        first = len(ids)
        ids += slot.fresh + nodes
        positions += list(range(slot.length, slot.length + f))
        positions += [slot.length + f - 1 + d for d in (draft.depths if draft is not None else [])]
        slot_of_row += [where[s]] * (f + len(nodes))
        write_at += list(range(slot.length, slot.length + f + len(nodes)))
        wanted += list(range(first + f - 1, first + f + (len(nodes) if logits_rows is None else 0)))
        pasts.append(slot.length)
        # who sees whom among the slot's own new rows (its cached positions are seen by all)
        if draft is not None:
            masks.append(tree_attention_mask(draft, 0, f - 1)[0, 0])
        else:
            masks.append(torch.ones(f, f, dtype=torch.bool).tril())
    n = len(ids)
    kv_heads, head_dim = keys[0].shape[1], keys[0].shape[3]
    share = decoder.config.num_attention_heads // kv_heads  # query heads per key/value head
    groups = _attention_groups(masks, pasts, where, device, decoder.dtype, share)
    to_dev = lambda t: t.to(device)  # noqa: E731
    slot_t, write_t = to_dev(torch.tensor(slot_of_row)), to_dev(torch.tensor(write_at))

    def attend(i, xq, xk, xv):
        keys[i][slot_t, :, write_t] = xk[0].transpose(0, 1)
        values[i][slot_t, :, write_t] = xv[0].transpose(0, 1)
        rows = xq[0].transpose(0, 1)  # (n, heads, dim)
        out = rows.new_empty(n, xq.shape[1] * head_dim)
        for g in groups:
            k, v = keys[i][g.slots, :, : g.width], values[i][g.slots, :, : g.width]
            # The query heads of one key/value head as rows of one call (count, kv_heads, share * q, dim):
            # CPU sdpa's grouped-query path (enable_gqa) is slower on these short queries
            # (docs/architecture-core.md, Measurements: batched attention).
            query = rows[g.pad].view(g.count, g.q, kv_heads, share, head_dim).permute(0, 2, 3, 1, 4)
            o = F.scaled_dot_product_attention(query.reshape(g.count, kv_heads, share * g.q, head_dim), k, v,
                                               attn_mask=g.mask, scale=decoder.scaling)
            o = o.view(g.count, kv_heads, share, g.q, head_dim).permute(0, 3, 1, 2, 4)
            out[g.rows] = o.reshape(g.count * g.q, -1)[g.flat]
        return out[None]

    block = 0 if backend.engine_linear is not None else n  # the engine's own form: every row alike
    x = decoder(to_dev(torch.tensor([ids])), to_dev(torch.tensor([positions])), attend, block)
    return decoder.lm_head(decoder.norm(x[:, to_dev(torch.tensor(wanted))]), block - (n - len(wanted)))[0]


@dataclass
class _AttentionGroup:
    """Slots whose rows attend in one padded call: `count` slots x `q` query rows x `width` keys."""

    slots: slice | torch.Tensor  # their cache slots (a slice where contiguous: a view, no copy)
    count: int
    q: int
    width: int
    mask: torch.Tensor  # (count, 1, share * q, width) additive: 0 where a row attends, the dtype's min elsewhere
    pad: torch.Tensor  # (count * q,) padded query row -> packed row
    flat: torch.Tensor  # the padded indices of the real rows, in packed order
    rows: torch.Tensor  # the packed rows of these slots


def _attention_groups(masks: list[torch.Tensor], pasts: list[int], where: list[int],
                      device: torch.device, dtype: torch.dtype, share: int) -> list[_AttentionGroup]:
    """The attention calls of a step. masks[s]: (rows, rows) bool, which of slot s's new rows see
    which; every row also sees the slot's `pasts[s]` cached positions. The mask is repeated for the
    `share` query heads that run as rows of one key/value head. Padding every slot to the
    longest one's rows would make a step with one prompt being prefilled pay attention for ~30
    rows in every slot: short and long slots attend apart."""
    starts = [0]
    for m in masks:
        starts.append(starts[-1] + m.shape[0])
    groups = []
    for members in ([s for s, m in enumerate(masks) if m.shape[0] <= LONG_ROWS],
                    [s for s, m in enumerate(masks) if m.shape[0] > LONG_ROWS]):
        if not members:
            continue
        members.sort(key=lambda s: where[s])
        first, last = where[members[0]], where[members[-1]]
        # The cache slots first..last as a view where the members fill at least half of them
        # (the others attend one position as padding): indexing the members' slots copies their
        # keys and values in every layer (docs/architecture-core.md, Measurements: batched attention).
        span = last - first + 1 <= 2 * len(members)
        at = [where[s] - first for s in members] if span else list(range(len(members)))
        count, q = (last - first + 1 if span else len(members)), max(masks[s].shape[0] for s in members)
        width = max(pasts[s] + masks[s].shape[0] for s in members)
        past = torch.zeros(count, dtype=torch.long)
        past[at] = torch.tensor([pasts[s] for s in members])
        mask = (torch.arange(width)[None, None, :] < past[:, None, None]).expand(count, q, width).clone()
        mask[:, :, 0] = True  # padding rows attend somewhere (no NaN); their output is dropped
        pad = torch.zeros(count, q, dtype=torch.long)
        real = torch.zeros(count, q, dtype=torch.bool)
        for j, s in zip(at, members):
            rows = masks[s].shape[0]
            mask[j, :rows, pasts[s]: pasts[s] + rows] = masks[s]
            pad[j, :rows] = torch.arange(starts[s], starts[s] + rows)
            real[j, :rows] = True
        groups.append(_AttentionGroup(
            slots=slice(first, first + count) if span else torch.tensor([where[s] for s in members], device=device),
            # An additive mask: CPU sdpa converts a bool mask at every call, at a cost beyond the
            # call's own (docs/architecture-core.md, Measurements: batched attention)
            count=count, q=q, width=width, pad=pad.reshape(-1).to(device),
            mask=torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, torch.finfo(dtype).min).repeat(1, share, 1)[:, None].to(device),
            flat=(torch.arange(count)[:, None] * q + torch.arange(q)[None, :])[real].to(device),
            rows=torch.cat([torch.arange(starts[s], starts[s + 1]) for s in members]).to(device)))
    return groups

