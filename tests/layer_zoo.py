"""
Small random networks with every layer kind the NTK engines must handle on a fast path, and the oracle they are tested
against: the Jacobian of the model's outputs on the whole batch by ``torch.func.jacrev`` (no ``vmap`` over the
examples, no per-layer rule), whose rows are the per-example Jacobians since the examples are independent.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.func import functional_call, jacrev


def reference_jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``(n, C, P)``: the per-example Jacobians of every trained parameter, from one whole-batch ``jacrev``."""
    params = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    with warnings.catch_warnings():  # jacrev's vmap runs fused attention's backward output by output: slow, exact
        warnings.filterwarnings("ignore", message=".*performance drop.*")
        jd = jacrev(lambda p: functional_call(model, p, (x,)))(params)
    n = x.shape[0]
    return torch.cat([value.reshape(n, value.shape[1], -1) for value in jd.values()], dim=2)  # (n, C, *p) each


def reference_ntk(model: nn.Module, x1: torch.Tensor, x2: torch.Tensor | None = None,
                  trace: bool = True) -> torch.Tensor:
    """The empirical NTK from :func:`reference_jacobian`."""
    j1 = reference_jacobian(model, x1)
    j2 = j1 if x2 is None else reference_jacobian(model, x2)
    return torch.einsum("acp,bcp->ab", j1, j2) if trace else torch.einsum("acp,bdp->abcd", j1, j2)


class Grouped(nn.Module):
    """Grouped and depthwise convolutions, a 1-D and a 3-D convolution, reflect and 'same' padding."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, padding_mode="reflect")
        self.grouped = nn.Conv2d(8, 8, 3, groups=2, padding="same", bias=False)
        self.depthwise = nn.Conv2d(8, 8, 3, groups=8, stride=2, padding=1)
        self.line = nn.Conv1d(8, 4, 3, dilation=2, padding=2, padding_mode="circular")
        self.volume = nn.Conv3d(1, 2, (2, 3, 3), stride=(1, 2, 1), padding=(0, 1, 1))
        self.head = nn.Linear(4 * 4 + 2 * 3 * 2 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.stem(x))
        h = nn.functional.silu(self.grouped(h))
        h = nn.functional.hardswish(self.depthwise(h))  # (n, 8, 4, 4)
        line = nn.functional.gelu(self.line(h.flatten(2)))  # (n, 4, 16)
        vol = torch.tanh(self.volume(h[:, :4].unsqueeze(1)))  # (n, 2, 3, 2, 4)
        return self.head(torch.cat([line.mean(2).repeat(1, 4), vol.flatten(1)], dim=1))


class SqueezeExcite(nn.Module):
    """MobileNetV3's pattern: a depthwise convolution, batch norm, squeeze-and-excitation with 1x1 convolutions."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.dw = nn.Conv2d(6, 6, 3, groups=6, padding=1)
        self.fc1 = nn.Conv2d(6, 3, 1)
        self.fc2 = nn.Conv2d(3, 6, 1)
        self.head = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = nn.functional.hardswish(self.bn(self.conv(x)))
        h = self.dw(h)
        s = nn.functional.adaptive_avg_pool2d(h, 1)
        s = nn.functional.hardsigmoid(self.fc2(torch.relu(self.fc1(s))))
        return self.head((h * s).mean((2, 3)))


class Norms(nn.Module):
    """Layer, group and RMS norms, and batch norms in 1 and 3 dimensions (one with only its scale trained)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)
        self.group = nn.GroupNorm(2, 4)
        self.bn3 = nn.BatchNorm3d(1)
        self.layer = nn.LayerNorm([4, 4])
        self.fc = nn.Linear(16, 8)
        self.rms = nn.RMSNorm(8)
        self.bn1 = nn.BatchNorm1d(8)
        self.bn1.bias.requires_grad_(False)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.group(self.conv(x))  # (n, 4, 4, 4)
        h = self.bn3(h.unsqueeze(1)).squeeze(1)
        h = torch.tanh(self.layer(h)).mean(1).flatten(1)  # (n, 16)
        h = self.rms(torch.tanh(self.fc(h)))
        return self.head(torch.tanh(self.bn1(h)))


class Attention(nn.Module):
    """Self-attention (batch first), cross-attention with separate key and value sizes and masks (sequence first),
    a hand-written attention with ``scaled_dot_product_attention``, GELU and layer norm."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.self_attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(8, 2, kdim=4, vdim=6)
        self.packed_cross = nn.MultiheadAttention(8, 2, batch_first=True, bias=False)
        self.qkv = nn.Linear(8, 24)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(x.shape[0], 5, 4)  # (n, 5, 4)
        h = nn.functional.gelu(self.embed(tokens))
        a, _ = self.self_attn(h, h, h, need_weights=False)
        h = self.norm(h + a)
        mask = torch.zeros(5, 5, dtype=torch.bool)
        mask[0, 4] = True
        pad = tokens[:, :, 0] > 1.5  # a padding mask from the data
        pad[:, 0] = False
        c, w = self.cross(h.transpose(0, 1), tokens.transpose(0, 1), torch.cat([tokens, tokens[..., :2]], 2)
                          .transpose(0, 1), attn_mask=mask, key_padding_mask=pad)
        h = h + c.transpose(0, 1) + w.sum(2, keepdim=True)
        p, _ = self.packed_cross(h, h[:, :3], h[:, :3])
        h = h + p
        q, k, v = self.qkv(h).reshape(h.shape[0], 5, 3, 2, 4).permute(2, 0, 3, 1, 4)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.head((h + o.transpose(1, 2).reshape(h.shape[0], 5, 8)).mean(1))


class Recurrent(nn.Module):
    """A convolution feeding a two-layer bidirectional LSTM over the image's rows (sequence first), a GRU with an
    initial state, an Elman RNN without biases, and an embedding of the digits of the input (with a padding index)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.lstm = nn.LSTM(2 * 6, 5, num_layers=2, bidirectional=True)
        self.gru = nn.GRU(10, 4, batch_first=True)
        self.rnn = nn.RNN(4, 3, nonlinearity="relu", bias=False, batch_first=True)
        self.embed = nn.Embedding(7, 3, padding_idx=0)
        self.head = nn.Linear(3 + 3, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.conv(x))  # (n, 2, 6, 6)
        rows = h.permute(2, 0, 1, 3).flatten(2)  # (6, n, 12): sequence first
        out, _ = self.lstm(rows)
        h0 = torch.tanh(x[:, 0, 0, :4]).unsqueeze(0).contiguous()
        out, _ = self.gru(out.transpose(0, 1), h0)
        out, _ = self.rnn(out)
        tokens = (x[:, 0, 1].abs() * 3).long().clamp(max=6)  # (n, 6)
        return self.head(torch.cat([out[:, -1], self.embed(tokens).mean(1)], dim=1))


class Shared(nn.Module):
    """Tied weights: a layer called twice, two layers sharing one weight (an embedding and a read-out of the same
    matrix), and a weight used outside its module (``F.linear`` in the model's own forward)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.twice = nn.Linear(6, 6)
        self.embed = nn.Embedding(6, 4)
        self.readout = nn.Linear(4, 6, bias=True)
        self.readout.weight = self.embed.weight  # tied
        self.outside = nn.Linear(6, 6)
        self.head = nn.Linear(6, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        tokens = (x.abs() * 2).long().clamp(max=5)
        h = h + self.readout(self.embed(tokens).mean(1))
        h = h + torch.nn.functional.linear(torch.tanh(h), self.outside.weight)
        return self.head(torch.tanh(self.outside(h)))


class Free(nn.Module):
    """Parameters used outside any layer's own forward: a class token and position embeddings (a ViT's), a layer
    scale (a ConvNeXt block's); and a module the registry does not know (its own forward)."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.patch = nn.Conv2d(1, 4, 3, stride=3)
        self.cls = nn.Parameter(torch.randn(1, 1, 4))
        self.pos = nn.Parameter(torch.randn(1, 5, 4))
        self.scale = nn.Parameter(torch.full((4,), 0.5))
        self.custom = Custom(4)
        self.up = nn.ConvTranspose2d(4, 2, 2)
        self.head = nn.Linear(4 + 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x)  # (n, 4, 2, 2)
        t = torch.cat([self.cls.expand(x.shape[0], -1, -1), p.flatten(2).transpose(1, 2)], dim=1) + self.pos
        t = t + self.scale * self.custom(t)
        u = torch.tanh(self.up(p)).mean((2, 3))
        return self.head(torch.cat([t[:, 0], u], dim=1))


class Custom(nn.Module):
    """A layer of its own: ``tanh(x W) ⊙ g`` with a gate vector."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w) * self.g


class SmallMaps(nn.Module):
    """Convolutions on maps no larger than their kernels (ResNet-18's last stages at 32 x 32), which a pass runs as
    matrices: circular padding, a stride, a 1x1, a 1-D and a 3-D one; beside them a large map and a convolution called
    on two map sizes, which keep the stock convolution. With ``free``, a scale used outside any layer (a fallback
    parameter: the pass runs per example under ``vmap``)."""

    #: The convolutions a pass runs as matrices.
    dense = {"wrap", "down", "point", "line", "volume"}

    def __init__(self, classes: int, free: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(2, 4, 3, stride=3)  # 6 x 6 -> 2 x 2
        self.wrap = nn.Conv2d(4, 5, 3, padding=1, padding_mode="circular")  # 2 x 2 -> 2 x 2
        self.down = nn.Conv2d(5, 6, 3, stride=2, padding=1, bias=False)  # 2 x 2 -> 1 x 1
        self.point = nn.Conv2d(6, 6, 1)
        self.line = nn.Conv1d(6, 3, 3, padding=1)  # length 2
        self.volume = nn.Conv3d(1, 2, (1, 2, 2))  # (1, 2, 2) -> one position
        self.twice = nn.Conv2d(4, 4, 1)  # on 2 x 2 and on 1 x 1
        self.scale = nn.Parameter(torch.full((6,), 0.5)) if free else None
        self.head = nn.Linear(6 + 6 + 4 + 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        t = self.twice(h).mean((2, 3)) + self.twice(h.mean((2, 3), keepdim=True)).flatten(1)
        d = torch.tanh(self.down(torch.tanh(self.wrap(h))))
        if self.scale is not None:
            d = d * self.scale.reshape(1, -1, 1, 1)
        p = self.point(d).flatten(1)
        line = self.line(torch.stack([p, d.flatten(1)], dim=2)).flatten(1)
        v = self.volume(h[:, :1].unsqueeze(2)).flatten(1)
        return self.head(torch.cat([p, line, t, v], dim=1))


def randomised(model: nn.Module, seed: int = 8) -> nn.Module:
    """Batch norms' statistics and affine maps away from their initial values; float64, evaluation mode."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.copy_(0.3 * torch.randn(m.running_mean.shape, generator=gen))
                m.running_var.copy_(0.5 + torch.rand(m.running_var.shape, generator=gen))
                m.weight.copy_(1.0 + 0.3 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.2 * torch.randn(m.bias.shape, generator=gen))
    return model.double().eval()


#: name -> (constructor of a model with ``classes`` outputs, input shape, the kinds its plan must hold)
ZOO = {
    "grouped": (Grouped, (3, 8, 8), {"conv", "linear"}),
    "squeeze-excite": (SqueezeExcite, (3, 6, 6), {"conv", "batchnorm", "linear"}),
    "norms": (Norms, (2, 6, 6), {"conv", "groupnorm", "batchnorm", "layernorm", "rmsnorm", "linear"}),
    "attention": (Attention, (20,), {"linear", "attention", "layernorm"}),
    "recurrent": (Recurrent, (1, 6, 6), {"conv", "recurrent", "embedding", "linear"}),
    "shared": (Shared, (6,), {"linear", "embedding"}),
    "free": (Free, (1, 6, 6), {"conv", "module", "linear"}),
    "small-maps": (SmallMaps, (2, 6, 6), {"conv", "linear"}),
    "small-maps-free": (lambda classes: SmallMaps(classes, free=True), (2, 6, 6), {"conv", "linear"}),
}
