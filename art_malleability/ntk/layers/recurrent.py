"""
Recurrent layers (``nn.LSTM``, ``nn.GRU``, ``nn.RNN``; any number of layers, either direction, with or without
biases, batch first or not, an initial state or none; no ``proj_size``, no packed sequences): the kind replaces the
module's forward during a pass by the recurrence written out, with probes on the input-side pre-activations
``W_ih x_t + b_ih`` (all steps at once) and the hidden-side ones ``W_hh h_{t-1} + b_hh`` (step by step). For each
layer and direction both are Kronecker blocks over the time steps: ``a_t = x_t`` with ``Δ_t`` the input-side
pre-activations' output gradients, and ``a_t = h_{t-1}`` with the hidden side's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from art_malleability.ntk.layers.base import Block, InputSide, ParamGradient, ProbeShapes, Site

#: Gates per mode: the size of the pre-activations is this times the hidden size.
_GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _cell(mode: str, gi: torch.Tensor, gh: torch.Tensor, h: torch.Tensor,
          c: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of the recurrence from the two pre-activations, as PyTorch defines each mode."""
    if mode == "LSTM":
        i, f, g, o = (gi + gh).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c
    if mode == "GRU":
        ir, iz, inn = gi.chunk(3, dim=1)
        hr, hz, hn = gh.chunk(3, dim=1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        return (1.0 - z) * torch.tanh(inn + r * hn) + z * h, None
    act = torch.tanh if mode == "RNN_TANH" else torch.relu
    return act(gi + gh), None


class RecurrentSite(Site):
    """A recurrent layer, its forward written out with probes (see the module docstring)."""

    kind = "recurrent"
    types = (nn.LSTM, nn.GRU, nn.RNN)
    replaces_forward = True

    @classmethod
    def accepts(cls, module: nn.Module) -> bool:
        return (super().accepts(module) and module.mode in _GATES and getattr(module, "proj_size", 0) == 0)

    def __init__(self, name: str, module: nn.RNNBase, params: list[tuple[str, nn.Parameter]]) -> None:
        super().__init__(name, module, params)
        m = module
        self._dirs = 2 if m.bidirectional else 1
        gates = _GATES[m.mode] * m.hidden_size
        for layer in range(m.num_layers):
            width = m.input_size if layer == 0 else m.hidden_size * self._dirs
            for suffix in self._suffixes(layer):
                for side, w in (("ih", width), ("hh", m.hidden_size)):
                    weight = self.trained(getattr(m, f"weight_{side}{suffix}"))
                    bias = self.trained(getattr(m, f"bias_{side}{suffix}", None)) if m.bias else None
                    self.blocks.append(Block(f"{name}.{side}{suffix}", InputSide(w), weight, bias, gates))
        self._keep_block = [bool(b.params) for b in self.blocks]

    def _suffixes(self, layer: int) -> list[str]:
        return [f"_l{layer}", f"_l{layer}_reverse"][: self._dirs]

    def check(self, args: tuple, kwargs: dict, output: Any, n: int) -> ProbeShapes | None:
        if len(args) < 1 or len(args) + len(kwargs) > 2 or (kwargs and "hx" not in kwargs):
            return None
        x = args[0]
        m = self.module
        if not isinstance(x, torch.Tensor) or x.dim() != 3 or x.shape[0 if m.batch_first else 1] != n:
            return None
        steps = x.shape[1 if m.batch_first else 0]
        shape = (steps, _GATES[m.mode] * m.hidden_size)
        self._steps = steps
        return [shape] * (2 * m.num_layers * self._dirs)

    def finish_plan(self, dtype: torch.dtype) -> None:
        self._keep_block = [bool(b.params) for b in self.blocks]
        super().finish_plan(dtype)
        for b in self.blocks:
            b.positions = sum(call[0][0] for call in self.calls)

    def kept_numel(self) -> int:
        return sum(call[0][0] * b.side.width for call in self.calls for b in self.blocks)

    def probed_forward(self, probes: list[torch.Tensor] | None, store: list, input: torch.Tensor,  # noqa: A002
                       hx: Any = None) -> tuple[torch.Tensor, Any]:
        m = self.module
        x = input if m.batch_first else input.transpose(0, 1)  # (n, T, d)
        n, steps = x.shape[:2]
        size = m.num_layers * self._dirs
        lstm = m.mode == "LSTM"
        if hx is None:
            h0 = x.new_zeros((size, n, m.hidden_size))
            c0 = h0 if lstm else None
        else:
            h0, c0 = hx if lstm else (hx, None)
        kept, last_h, last_c = [], [], []
        k = 0
        for layer in range(m.num_layers):
            outs = []
            for direction, suffix in enumerate(self._suffixes(layer)):
                gi = F.linear(x, getattr(m, f"weight_ih{suffix}"), getattr(m, f"bias_ih{suffix}", None) if m.bias
                              else None)
                if probes is not None:
                    gi = gi + probes[k]
                w_hh = getattr(m, f"weight_hh{suffix}")
                b_hh = getattr(m, f"bias_hh{suffix}") if m.bias else None
                idx = layer * self._dirs + direction
                h, c = h0[idx], (c0[idx] if lstm else None)
                hs: list[torch.Tensor | None] = [None] * steps
                prev: list[torch.Tensor | None] = [None] * steps
                for t in (range(steps - 1, -1, -1) if direction else range(steps)):
                    prev[t] = h
                    gh = F.linear(h, w_hh, b_hh)
                    if probes is not None:
                        gh = gh + probes[k + 1][:, t]
                    h, c = _cell(m.mode, gi[:, t], gh, h, c)
                    hs[t] = h
                k += 2
                kept.append((x, torch.stack(prev, dim=1)))
                outs.append(torch.stack(hs, dim=1))
                last_h.append(h)
                last_c.append(c)
            x = outs[0] if self._dirs == 1 else torch.cat(outs, dim=2)
        store.append(kept)
        output = x if m.batch_first else x.transpose(0, 1)
        h_n = torch.stack(last_h, dim=0)
        return (output, (h_n, torch.stack(last_c, dim=0))) if lstm else (output, h_n)

    def factors(self, kept: Any, grads: list[torch.Tensor]) -> tuple[list, list[ParamGradient]]:
        out = []
        for j, (x, prev) in enumerate(kept):
            for side, a in ((0, x), (1, prev)):
                if self._keep_block[2 * j + side]:
                    out.append((a, grads[2 * j + side]))
        return out, []
