"""DPMultiheadAttention: a drop-in ``nn.MultiheadAttention`` built from hookable parts.

Multi-head attention (Vaswani et al. 2017, arXiv 1706.03762, §3.2) with PyTorch's options:

    q, k, v = x_q W_qᵀ + b_q,  x_k W_kᵀ + b_k,  x_v W_vᵀ + b_v       InProjection (one call)
    k, v    = [k ; β_k], [v ; β_v]                  add_bias_kv:  SequenceBias parts
    k, v    = [k ; 0], [v ; 0]   per head           add_zero_attn (no parameters)
    A_h     = softmax(q_h k_hᵀ / √d_h + M)          M: attn_mask + key_padding_mask (-inf)
    o       = concat_h(dropout(A_h) v_h) W_oᵀ + b_o  out_proj: an ordinary nn.Linear

Every parameter sits in a matrix product or an appended row, so the per-sample gradients
come from the Linear rule per block and from the backprop of the appended row (the Opacus
blog "Efficient per-sample gradient computation for more layers", multi-head attention
section: "Linear layers plus a SequenceBias"; parts.py has the rules). The softmax part has
no parameters: it only carries the backprops.

Drop-in: the constructor and forward signatures, parameter names (``in_proj_weight`` or
``q/k/v_proj_weight`` when kdim/vdim differ, ``in_proj_bias``, ``bias_k``, ``bias_v``,
``out_proj.weight/bias``), shapes and initialisation are torch.nn's, so ``state_dict`` loads
both ways; ``from_torch`` / ``to_torch`` convert. Inputs are made batch-first before any
hooked call, so per-sample results are (n, ...) whatever ``batch_first`` is. A 3-D
``attn_mask`` (n·heads, L, S) is per sample and so belongs to the batch like the inputs.

Notation: n batch, L target length, S source length, E embed dim, d_h = E / heads.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from workbench.layers.parts import InProjection, PartsOwner, SequenceBias, owner_grad_sampler
from workbench.per_sample.registry import register_grad_sampler


class DPMultiheadAttention(PartsOwner):
    """Drop-in ``nn.MultiheadAttention`` whose parameters all get hookable per-sample rules."""

    torch_class = nn.MultiheadAttention

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False,
                 add_zero_attn=False, kdim=None, vdim=None, batch_first=False, device=None,
                 dtype=None):
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0 or embed_dim % num_heads:
            raise ValueError(f"DPMultiheadAttention: embed_dim={embed_dim} must be a positive "
                             f"multiple of num_heads={num_heads}")
        factory = {"device": device, "dtype": dtype}
        E = embed_dim
        self.embed_dim, self.num_heads, self.head_dim = E, num_heads, E // num_heads
        self.kdim, self.vdim = kdim or E, vdim or E
        self._qkv_same_embed_dim = self.kdim == E and self.vdim == E
        self.dropout, self.batch_first, self.add_zero_attn = dropout, batch_first, add_zero_attn

        def param(*shape):
            return nn.Parameter(torch.empty(shape, **factory))

        # Parameters in torch.nn's order and names (None where torch.nn has None).
        packed = self._qkv_same_embed_dim
        self.register_parameter("in_proj_weight", param(3 * E, E) if packed else None)
        self.register_parameter("q_proj_weight", None if packed else param(E, E))
        self.register_parameter("k_proj_weight", None if packed else param(E, self.kdim))
        self.register_parameter("v_proj_weight", None if packed else param(E, self.vdim))
        self.register_parameter("in_proj_bias", param(3 * E) if bias else None)
        self.out_proj = nn.Linear(E, E, bias=bias, **factory)
        self.register_parameter("bias_k", param(1, 1, E) if add_bias_kv else None)
        self.register_parameter("bias_v", param(1, 1, E) if add_bias_kv else None)

        self.parts = nn.ModuleDict(dict(in_proj=InProjection(
            self, weight="in_proj_weight", q_weight="q_proj_weight", k_weight="k_proj_weight",
            v_weight="v_proj_weight", bias="in_proj_bias")))
        if add_bias_kv:
            self.parts["bias_k"] = SequenceBias(self, bias="bias_k")
            self.parts["bias_v"] = SequenceBias(self, bias="bias_v")
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        """torch.nn's initialisation: Xavier-uniform projections, zero biases."""
        for w in (self.in_proj_weight, self.q_proj_weight, self.k_proj_weight,
                  self.v_proj_weight):
            if w is not None:
                nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)
        for b in (self.bias_k, self.bias_v):
            if b is not None:
                nn.init.xavier_normal_(b)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        """Same inputs and outputs as ``nn.MultiheadAttention.forward``.

        Returns ``(attn_output, attn_weights)``; the weights (after dropout, as torch.nn
        returns them) are averaged over heads unless ``average_attn_weights=False``, and
        None when ``need_weights=False``.
        """
        if is_causal and attn_mask is None:
            raise RuntimeError("DPMultiheadAttention: is_causal=True is only a hint; pass the "
                               "causal mask as attn_mask (e.g. nn.Transformer."
                               "generate_square_subsequent_mask(L))")
        batched = query.dim() == 3
        q, k, v = _batch_first(query, key, value, batched, self.batch_first)  # (n, L|S, E)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)
        n, L, S = q.shape[0], q.shape[1], k.shape[1]

        if q is k and k is v and self._qkv_same_embed_dim:  # self-attention: one product
            q, k, v = self.parts["in_proj"](q).chunk(3, dim=-1)
        else:
            q, k, v = self.parts["in_proj"](q, k, v).split([L, S, S], dim=1)
        if self.bias_k is not None:  # append β_k, β_v: one more key and value per sample
            k, v = self.parts["bias_k"](k), self.parts["bias_v"](v)
        q, k, v = (self._heads(t) for t in (q, k, v))  # (n, heads, L|S', d_h)
        if self.add_zero_attn:
            k, v = (torch.cat([t, t.new_zeros(*t.shape[:2], 1, t.shape[3])], dim=2)
                    for t in (k, v))
        mask = self._mask(attn_mask, key_padding_mask, n, L, S, k.shape[2], q.dtype)
        p = self.dropout if self.training else 0.0
        o, A = attend(q, k, v, mask, p, need_weights)  # (n, heads, L, d_h), (n, heads, L, S')
        o = self.out_proj(o.transpose(1, 2).reshape(n, L, self.embed_dim))  # (n, L, E)

        if not batched:
            o, A = o.squeeze(0), (None if A is None else A.squeeze(0))
        elif not self.batch_first:
            o = o.transpose(0, 1)  # (L, n, E)
        if A is not None and average_attn_weights:
            A = A.mean(dim=-3)
        return o, A

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        """(n, S, E) -> (n, heads, S, d_h)."""
        return t.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)

    def _mask(self, attn_mask, key_padding_mask, n, L, S, S_all, dtype):
        """One additive mask, broadcastable to (n, heads, L, S_all), or None.

        Boolean masks mark *forbidden* positions (True -> -inf), float masks are added, as in
        torch.nn. Columns appended by add_bias_kv / add_zero_attn are never masked.
        """
        def additive(m):
            if m.dtype == torch.bool:
                return torch.zeros_like(m, dtype=dtype).masked_fill(m, float("-inf"))
            return m.to(dtype)

        mask = None
        if attn_mask is not None:
            mask = additive(attn_mask)
            if mask.dim() == 3:  # (n heads, L, S): per sample and head, batch-major
                mask = mask.view(n, self.num_heads, L, S)
            elif mask.shape != (L, S):
                raise ValueError(f"DPMultiheadAttention: attn_mask has shape "
                                 f"{tuple(attn_mask.shape)}; expected ({L}, {S}) or "
                                 f"({n * self.num_heads}, {L}, {S})")
        if key_padding_mask is not None:
            if tuple(key_padding_mask.shape) != (n, S):
                raise ValueError(f"DPMultiheadAttention: key_padding_mask has shape "
                                 f"{tuple(key_padding_mask.shape)}; expected ({n}, {S})")
            kpm = additive(key_padding_mask)[:, None, None, :]  # (n, 1, 1, S)
            mask = kpm if mask is None else mask + kpm
        if mask is not None and S_all > S:
            mask = F.pad(mask, (0, S_all - S))
        return mask

    @staticmethod
    def config_of(module) -> dict:
        return dict(embed_dim=module.embed_dim, num_heads=module.num_heads,
                    dropout=module.dropout, bias=module.in_proj_bias is not None,
                    add_bias_kv=module.bias_k is not None, add_zero_attn=module.add_zero_attn,
                    kdim=module.kdim, vdim=module.vdim, batch_first=module.batch_first)


register_grad_sampler(DPMultiheadAttention)(owner_grad_sampler)


def attend(q, k, v, mask, p, need_weights):
    """softmax(q kᵀ / √d_h + M), dropped out with probability p, times v; per head.

    With ``need_weights`` the weights are formed explicitly (and returned), in torch.nn's
    order of operations, so dropout draws the same masks from the same seed; without, one
    ``scaled_dot_product_attention`` call, as torch.nn does. No parameters here: this part
    only carries the backprops between the projections.
    """
    if not need_weights:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p), None
    scores = torch.matmul(q * math.sqrt(1.0 / q.shape[-1]), k.transpose(-2, -1))  # (n,h,L,S')
    A = torch.softmax(scores if mask is None else scores + mask, dim=-1)
    A = F.dropout(A, p) if p > 0 else A
    return torch.matmul(A, v), A


def _batch_first(query, key, value, batched, batch_first):
    """q, k, v as (n, L|S, E), keeping ``query is key is value`` for self-attention."""
    def move(t):
        if not batched:
            return t.unsqueeze(0)
        return t if batch_first else t.transpose(0, 1)

    q = move(query)
    k = q if key is query else move(key)
    v = k if value is key else move(value)
    return q, k, v


__all__ = ["DPMultiheadAttention", "attend"]
