"""
Attention.

- ``nn.MultiheadAttention`` (without ``add_bias_kv`` or ``add_zero_attn``): the kind replaces its ``forward`` during
  a pass by the same computation written out (projections, scaled scores, masks, softmax, output projection), with
  probes on the query, key and value projections and on the output projection. Each projection is a Kronecker block
  over the sequence positions: the packed ``in_proj_weight`` one block (for self-attention the input once, its three
  projections side by side; otherwise the three inputs' positions one after the other, each with its own third of the
  output gradients), or separate ``q/k/v_proj_weight`` blocks with the shared ``in_proj_bias`` explicit; the output
  projection another block.
- ``torch.nn.functional.scaled_dot_product_attention`` called anywhere in the model: during a pass it is computed
  as ``softmax(q kᵀ · scale + mask) v`` (:func:`math_attention`), whose backward has batching rules, where the fused
  kernels' backward has none and would run class by class.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from art_malleability.ntk.layers.base import Block, InputSide, ParamGradient, ProbeShapes, Site

_MHA_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def math_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                   dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                   enable_gqa: bool = False) -> torch.Tensor:
    """
    ``scaled_dot_product_attention`` written out (the same arguments and result).

    :raises ValueError: If ``dropout_p > 0`` (a kernel needs a deterministic forward pass).
    """
    if dropout_p > 0.0:
        raise ValueError(f"scaled_dot_product_attention must run without dropout while a kernel is computed, got "
                         f"dropout_p={dropout_p}; pass dropout_p=0.0 in evaluation mode")
    length, source = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(length, source, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return torch.softmax(scores, dim=-1) @ value


class MathAttention(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` runs as :func:`math_attention`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func is F.scaled_dot_product_attention:
            return math_attention(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (``True``: not attended) as ``-inf`` where set, a float mask as it is."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))


class AttentionSite(Site):
    """``nn.MultiheadAttention``, its forward written out with probes (see the module docstring)."""

    kind = "attention"
    types = (nn.MultiheadAttention,)
    replaces_forward = True
    covers_children = True

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return (super().accepts(module) and module.bias_k is None and module.bias_v is None
                and not module.add_zero_attn)

    def __init__(self, name: str, module: nn.MultiheadAttention, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        m = module
        e = m.embed_dim
        self._packed = bool(m._qkv_same_embed_dim)
        self._self: list[bool] = []  # per call: query, key and value the same tensor
        # (what the block projects: "in" the packed projection, "q"/"k"/"v" a separate one, "o" the output's, block)
        if self._packed:
            blocks = [("in", Block(f"{name}.in_proj", InputSide(e), self.trained(m.in_proj_weight),
                                   self.trained(m.in_proj_bias), 3 * e))]
        else:
            blocks = [(w[0], Block(f"{name}.{w}", InputSide(width), self.trained(getattr(m, w)), None, e))
                      for w, width in (("q_proj_weight", e), ("k_proj_weight", m.kdim), ("v_proj_weight", m.vdim))]
        blocks.append(("o", Block(f"{name}.out_proj", InputSide(e), self.trained(m.out_proj.weight),
                                  self.trained(m.out_proj.bias), e)))
        self._roles = [role for role, b in blocks if b.params]
        self.blocks = [b for _, b in blocks if b.params]


    def _inputs(self, args: tuple, kwargs: dict) -> inspect.BoundArguments:
        bound = _MHA_SIGNATURE.bind(self.module, *args, **kwargs)
        bound.apply_defaults()
        return bound

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        try:
            b = self._inputs(args, kwargs).arguments
        except TypeError:
            return None
        q, k, v = b["query"], b["key"], b["value"]
        axis = 0 if self.module.batch_first else 1
        if not all(isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[axis] == n for t in (q, k, v)):
            return None
        e = self.module.embed_dim
        lq, lk, lv = q.shape[1 - axis], k.shape[1 - axis], v.shape[1 - axis]
        same = q is k and k is v
        self._self.append(same)
        if same and self._packed:
            return [(lq, 3 * e), (lq, e)]
        return [(lq, e), (lk, e), (lv, e), (lq, e)]

    def finish_plan(self, dtype: torch.dtype) -> None:
        self._roles = [r for r, b in zip(self._roles, self.blocks, strict=True) if b.params]
        super().finish_plan(dtype)
        for role, b in zip(self._roles, self.blocks, strict=True):
            if role in ("o", "q"):
                b.positions = sum(call[0][0] for call in self.calls)
            elif role in ("k", "v"):
                b.positions = sum(call["qkv".index(role)][0] for call in self.calls)
            else:  # the packed projection: the input once for self-attention, else the three inputs' positions
                b.positions = sum(call[0][0] if len(call) == 2 else call[0][0] + call[1][0] + call[2][0]
                                  for call in self.calls)

    def kept_numel(self) -> int:
        m = self.module
        return sum(2 * call[0][0] * m.embed_dim if len(call) == 2
                   else call[0][0] * 2 * m.embed_dim + call[1][0] * m.kdim + call[2][0] * m.vdim
                   for call in self.calls)

    def probed_forward(self, probes: list[torch.Tensor] | None, store: list, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                       attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                       is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        m = self.module
        same = query is key and key is value
        if not m.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        n, length, e = query.shape
        source, heads = key.shape[1], m.num_heads
        hd = e // heads

        def probed(t: torch.Tensor, k: int) -> torch.Tensor:
            return t if probes is None else t + probes[k]

        w, b = m.in_proj_weight, m.in_proj_bias
        kept = {"q": query, "k": key, "v": value}
        if self._packed and same:
            q, k, v = probed(F.linear(query, w, b), 0).chunk(3, dim=-1)
            out_probe = 1
            kept = {"in": query}
        else:
            if self._packed:
                ws = w.chunk(3)
            else:
                ws = (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)
            bs = (None,) * 3 if b is None else b.chunk(3)
            q = probed(F.linear(query, ws[0], bs[0]), 0)
            k = probed(F.linear(key, ws[1], bs[1]), 1)
            v = probed(F.linear(value, ws[2], bs[2]), 2)
            out_probe = 3
        q = q.reshape(n, length, heads, hd).transpose(1, 2)
        k = k.reshape(n, source, heads, hd).transpose(1, 2)
        v = v.reshape(n, source, heads, hd).transpose(1, 2)
        scores = (q * math.sqrt(1.0 / hd)) @ k.transpose(-2, -1)  # (n, heads, length, source)
        mask = _additive(attn_mask, scores.dtype)
        if mask is not None:
            scores = scores + (mask.reshape(n, heads, length, source) if mask.dim() == 3 else mask)
        padding = _additive(key_padding_mask, scores.dtype)
        if padding is not None:
            scores = scores + padding.reshape(n, 1, 1, source)
        weights = torch.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(n, length, e)
        kept["o"] = out
        store.append(kept)
        out = probed(F.linear(out, m.out_proj.weight, m.out_proj.bias), out_probe)
        if not m.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        return out, weights.mean(dim=1) if average_attn_weights else weights

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        e = self.module.embed_dim
        if len(grads) == 2:  # self-attention, packed: the input once, the three projections side by side
            pairs = {"in": (kept["in"], grads[0]), "o": (kept["o"], grads[1])}
        else:
            pairs = {r: (kept[r], grads[i]) for i, r in enumerate("qkvo")}
        if len(grads) == 4 and self._packed:
            # the packed projection: the three inputs' positions, each with its third of the 3E outputs, zeros elsewhere
            pairs["in"] = (torch.cat([kept[r] for r in "qkv"], dim=1),
                           torch.cat([F.pad(grads[i], (i * e, (2 - i) * e)) for i in range(3)], dim=2))
        factors = [pairs[role] for role in self._roles]
        explicit: list[ParamGradient] = []
        in_bias = None if self._packed else self.trained(self.module.in_proj_bias)
        if in_bias is not None:
            explicit.append((in_bias, torch.cat([grads[i].sum(2) for i in range(3)], dim=2)))
        return factors, explicit
