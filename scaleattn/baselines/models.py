"""PyTorch models of the baselines: multi-head linear attention (one layer computes exactly [Y25] Def. 2.1)
and a softmax transformer. Needs the optional ``torch`` extra."""
from __future__ import annotations

import math

import numpy as np

try:
    import torch
    from torch import nn
except ImportError as e:  # pragma: no cover - exercised only without the extra
    from ..errors import MissingDependencyError

    raise MissingDependencyError.for_extra("scaleattn.baselines", "torch", "PyTorch") from e

from ..errors import ParameterError
from ..heads._algebra import coef_from_heads

__all__ = ["MHLA", "SoftmaxTransformer", "make_model"]


def valid_positions(tokens, lengths):
    """(B, T) bool mask of the positions within each sample's length; None without lengths."""
    B, T, _ = tokens.shape
    if lengths is None:
        return None
    return torch.arange(T, device=tokens.device)[None, :] < lengths[:, None]


def _last(h, lengths):
    if lengths is None:
        return h[:, -1]
    return h[torch.arange(h.shape[0], device=h.device), lengths - 1]


class MHLA(nn.Module):
    """Multi-head linear attention ([Y25] Def. 2.1; DESIGN §1) with ``heads`` heads and ``layers`` layers.

    Parameters: ``V[i]`` (H, d_i, d) with ``d_i = d_out`` for the last layer and ``d`` before, ``Q[i]`` (H, d, d),
    initialised ``N(0, 1) * init_scale`` (default ``1/sqrt(d)``, the teacher scale of [Y25] §4.1).
    ``fused=True`` evaluates each layer through ``W = sum_h V_h (x) Q_h`` and the cubic features: the same
    function and gradients (chain rule through W), faster for small d, O(d^3) per token.
    ``forward(tokens (B, T, d), lengths (B,) | None)`` returns (B, d_out), or (B, T, d_out) when ``causal``.
    """

    def __init__(self, d: int, d_out: int | None = None, heads: int = 1, layers: int = 1, causal: bool = False,
                 init_scale: float | None = None, dtype=torch.float64, seed: int | None = None,
                 fused: bool = False):
        super().__init__()
        self.fused = fused
        if min(d, heads, layers) < 1:
            raise ParameterError(f"d, heads and layers must be >= 1, got {d}, {heads}, {layers}")
        self.d, self.d_out = d, d if d_out is None else d_out
        self.heads, self.layers, self.causal = heads, layers, causal
        g = torch.Generator().manual_seed(0 if seed is None else int(seed))
        sc = 1.0 / math.sqrt(d) if init_scale is None else init_scale
        shape_v = [(heads, self.d_out if i == layers - 1 else d, d) for i in range(layers)]
        self.V = nn.ParameterList([nn.Parameter(torch.randn(s, generator=g, dtype=dtype) * sc) for s in shape_v])
        self.Q = nn.ParameterList([nn.Parameter(torch.randn((heads, d, d), generator=g, dtype=dtype) * sc)
                                   for _ in range(layers)])

    def _attend(self, z, V, Q, x=None):
        """``sum_h V_h S Q_h x`` for every position (causal prefixes / whole sequence) or, with ``x`` (B, d),
        for that query only. Batched matmuls (a 3-operand einsum is several times slower on CPU)."""
        H, a, d = V.shape
        Vm = V.permute(2, 0, 1).reshape(d * H, a)  # [(j, h), a] = V_h[a, j]
        if self.fused:  # W (d^3, a): the same function through the cubic features (DESIGN §2)
            Wf = torch.einsum("haj,hkl->jkla", V, Q).reshape(d ** 3, a)
        if x is not None:
            S = torch.einsum("btj,btk->bjk", z, z)
            if self.fused:
                return (S[..., None] * x[:, None, None, :]).reshape(x.shape[0], -1) @ Wf
            q = (x @ Q.reshape(H * d, d).T).reshape(-1, H, d).transpose(1, 2)  # (B, k, h)
            return (S @ q).reshape(-1, d * H) @ Vm
        B, T, _ = z.shape
        if self.causal:
            S = torch.cumsum(z[..., :, None] * z[..., None, :], dim=1)  # (B, T, d, d) prefix Grams
        else:
            S = torch.einsum("btj,btk->bjk", z, z)[:, None].expand(B, T, d, d)
        if self.fused:
            return (S[..., None] * z[:, :, None, None, :]).reshape(B, T, -1) @ Wf
        q = (z @ Q.reshape(H * d, d).T).reshape(B, T, H, d).transpose(2, 3)  # (B, T, k, h) = Q_h z_t
        return (S @ q).reshape(B, T, d * H) @ Vm

    def forward(self, tokens, lengths=None):
        valid = valid_positions(tokens, lengths)
        z = tokens if valid is None else tokens * valid[..., None]
        for i in range(self.layers - 1):
            z = z + self._attend(z, self.V[i], self.Q[i])
            if valid is not None:
                z = z * valid[..., None]
        if self.causal:
            return self._attend(z, self.V[-1], self.Q[-1])
        return self._attend(z, self.V[-1], self.Q[-1], _last(z, lengths))  # only the query's output

    def coef(self) -> np.ndarray:
        """``c(Theta)`` (psi, d_out) float64 of a one-layer model ([Y25] Cor. 2.4; :func:`coef_from_heads`).
        Raises :class:`~scaleattn.errors.ParameterError` for deeper models (not in the cubic class)."""
        if self.layers != 1:
            raise ParameterError(f"coef() is defined for one-layer MHLA only, this model has {self.layers} layers")
        return coef_from_heads(self.V[0].detach().cpu().double().numpy(), self.Q[0].detach().cpu().double().numpy())


class SoftmaxTransformer(nn.Module):
    """Small softmax transformer ("full"): linear embedding to ``width``, ``layers`` pre-LayerNorm blocks of
    ``heads``-head softmax attention (scaled dot product, causal mask when ``causal``) and a GELU MLP
    (``mlp_ratio * width``), final LayerNorm and a linear read-out to ``d_out``. No positional encoding (the
    MHLA tasks are permutation-invariant in the context). Output shapes as :class:`MHLA`."""

    def __init__(self, d: int, d_out: int | None = None, width: int = 32, heads: int = 4, layers: int = 1,
                 mlp_ratio: int = 4, causal: bool = False, dtype=torch.float64, seed: int | None = None):
        super().__init__()
        if width % heads:
            raise ParameterError(f"width {width} must be divisible by heads {heads}")
        torch.manual_seed(0 if seed is None else int(seed))
        self.d, self.d_out, self.heads, self.causal = d, d if d_out is None else d_out, heads, causal
        self.embed = nn.Linear(d, width, dtype=dtype)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(width, dtype=dtype), "qkv": nn.Linear(width, 3 * width, dtype=dtype),
                "proj": nn.Linear(width, width, dtype=dtype), "ln2": nn.LayerNorm(width, dtype=dtype),
                "mlp": nn.Sequential(nn.Linear(width, mlp_ratio * width, dtype=dtype), nn.GELU(),
                                     nn.Linear(mlp_ratio * width, width, dtype=dtype))}))
        self.ln = nn.LayerNorm(width, dtype=dtype)
        self.out = nn.Linear(width, self.d_out, dtype=dtype)

    def forward(self, tokens, lengths=None):
        B, T, _ = tokens.shape
        valid = valid_positions(tokens, lengths)
        mask = None
        if self.causal:
            mask = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()
        elif valid is not None:
            mask = valid[:, None, None, :]  # keys beyond the length are padding
        h = self.embed(tokens)
        for blk in self.blocks:
            q, k, v = blk["qkv"](blk["ln1"](h)).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + blk["proj"](a.transpose(1, 2).reshape(B, T, -1))
            h = h + blk["mlp"](blk["ln2"](h))
        y = self.out(self.ln(h))
        return y if self.causal else _last(y, lengths)


def make_model(kind: str, d: int, d_out: int | None = None, causal: bool = False, **kw) -> nn.Module:
    """``kind`` ``"mhla"`` (:class:`MHLA`, keywords heads, layers, init_scale, seed) or ``"full"``
    (:class:`SoftmaxTransformer`). :class:`~scaleattn.errors.ParameterError` otherwise."""
    if kind == "mhla":
        return MHLA(d, d_out, causal=causal, **kw)
    if kind == "full":
        return SoftmaxTransformer(d, d_out, causal=causal, **kw)
    raise ParameterError(f"model kind must be 'mhla' or 'full', got {kind!r}")
