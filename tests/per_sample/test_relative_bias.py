"""T5's relative position bias (``per_sample/broadcast.py``, ``per_sample/shape_ops.py``): an
Embedding looked up on a (T, T) bucket matrix, re-arranged by shape-only ops and added to
several layers' attention scores, takes the Embedding rule with per-sample backprops summed
over the meetings, not the whole-model fallback; anything else done with it (a product, a
non-shape op, an in-place op, two uses in one op) stays on the exact fallback. Every method
and every optimizer mode against micro-batching, float64, n ≠ T and n = T."""

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from tests.helpers import assert_optimizer_matches_microbatch, exact_routes, mse_per_sample
from workbench.dpsgd import MODES, DPOptimizer

T, D, H, K, BUCKETS = 4, 4, 2, 3, 5  # tokens, width, heads, head width, buckets


class RelativeBias(nn.Module):
    """Attention layers sharing one bias computed in the first, as T5's stack does
    (``T5Attention.compute_bias``: o (T, T, H) -> (1, H, T, T)). ``use`` says how the bias
    is made and used; ``sdpa``: it is SDPA's ``attn_mask`` (Hugging Face's SDPA path)."""

    def __init__(self, layers=2, use="add", sdpa=False, p=0.0, big=False):
        super().__init__()
        self.use, self.sdpa, self.p = use, sdpa, p
        # big: a second head on 1000 x the inputs, whose gradient dwarfs the bias's (MPNet's
        # bias is a small part of ||g_i|| too): an error in the bias then hides in the norm
        self.big = nn.Linear(D, 2) if big else None
        self.relative_attention_bias = nn.Embedding(BUCKETS, H)
        self.qkv = nn.ModuleList(nn.Linear(D, 3 * H * K) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(H * K, D) for _ in range(layers))
        self.head = nn.Linear(D, 2)

    def compute_bias(self, t, n):
        extra = 1 if self.use == "slice" else 0  # computed for t + 1 positions, then cut
        pos = torch.arange(t + extra)
        buckets = (pos[None, :] - pos[:, None]).clamp(-2, 2) + 2  # (t, t) bucket ids
        if self.use == "expand":  # one row of buckets (t, H), repeated over the queries
            row = self.relative_attention_bias(buckets[0])  # (t, H)
            return row.t().unsqueeze(1).expand(H, t, t).unsqueeze(0)  # (1, H, t, t)
        values = self.relative_attention_bias(buckets)  # (t, t, H)
        bias = values.permute([2, 0, 1]).unsqueeze(0)  # (1, H, t, t)
        if self.use == "slice":
            bias = bias[:, :, -t:, -t:]
        if self.use == "merged_mask":  # an older T5: the causal mask added to the bias once
            bias = bias + torch.full((t, t), -1.0, dtype=bias.dtype).triu(1)[None, None]
        if self.use == "nonshape":
            bias = bias * 2.0  # not a shape-only op: fallback
        if self.use == "in_place":
            bias.mul_(2.0)  # overwrites the followed tensor: fallback
        if self.use.startswith("batch_expand"):  # MPNet: expanded to the batch size, then
            bias = bias.expand(n, H, t, t)  # contiguous: (n, H, t, t) meets the scores row
            if self.use.startswith("batch_expand_t"):  # for row, as the broadcast would
                bias = bias.transpose(-1, -2)  # (a shape op after the expand: not followed)
            bias = bias.contiguous()
        return bias

    def scores(self, q, k, bias, mask, layer):
        s = q @ k.transpose(-1, -2)  # (n, H, t, t)
        if self.use == "times" and layer == 1:
            return s * bias  # used multiplicatively: fallback
        if self.use == "twice_in_one_op":
            return s + (bias + bias)  # two uses in one op: fallback
        s = s + bias  # the meeting
        s = s + torch.zeros(1, H, s.shape[-2], s.shape[-1], dtype=s.dtype)  # a bias-less
        return s + mask[:, None, None, :]  # layer's zeros, then the padding mask

    def forward(self, x):  # (n, t, D) -> (n, 2)
        n, t, _ = x.shape
        pad = torch.cat([torch.zeros(n, t - 1, dtype=x.dtype),  # a soft "padding" mask on
                         -torch.ones(n, 1, dtype=x.dtype)], 1)  # the last key, per sample
        bias, h = None, x
        for layer, (qkv, o) in enumerate(zip(self.qkv, self.o)):
            if bias is None:
                bias = self.compute_bias(t, n)
            q, k, v = qkv(h).view(n, t, 3, H, K).permute(2, 0, 3, 1, 4)  # (n, H, t, K) each
            if self.sdpa:
                mask = bias
                if self.use == "causal":  # Hugging Face: where(causal, bias, min).contiguous()
                    causal = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t)
                    mask = torch.where(causal, bias, torch.finfo(x.dtype).min)
                if self.use == "padding":  # a bool padding mask from each sample's data
                    keep = torch.cat([torch.ones(n, 1, dtype=torch.bool), x[:, 1:, 0] > -0.3], 1)
                    mask = torch.where(keep[:, None, None], bias, -2.0)  # finite: h's
                    # gradient where -2 is chosen is not 0 and must not reach the bias
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.contiguous(),
                                                   dropout_p=self.p if self.training else 0.0)
            else:
                w = self.scores(q, k, bias, pad, layer).softmax(-1)
                a = F.dropout(w, self.p, self.training) @ v
            h = h + o(a.transpose(1, 2).reshape(n, t, H * K))
        out = self.head(torch.tanh(h)).mean(1)
        return out if self.big is None else out + self.big(1e3 * x.mean(1))


RULE = {  # converted: the Embedding rule, per-sample backprops summed over the meetings
    "one_layer": dict(layers=1), "layers": dict(layers=3), "expand": dict(use="expand"),
    "slice": dict(use="slice"), "merged_mask": dict(use="merged_mask"),
    "sdpa": dict(sdpa=True), "sdpa_causal": dict(sdpa=True, use="causal"),
    "sdpa_padding": dict(sdpa=True, use="padding"),
    "batch_expand": dict(use="batch_expand"),  # MPNet's (broadcast.widened)
}
FALLBACK = {  # a use the per-sample rule cannot prove: the exact whole-model fallback
    "times": dict(use="times"), "nonshape": dict(use="nonshape"),
    "in_place": dict(use="in_place"), "twice_in_one_op": dict(use="twice_in_one_op"),
    # MPNet's bias, transposed after its expand to the batch size: at n = T its (T, T)
    # lookup looks batch-first, and at n = 1 (the probe) the expand is a broadcast that
    # meets the scores, so the probe's shapes looked right while the batch's call was never
    # converted: book-keeping's sum of the bias and every optimizer mode were silently
    # 0.7-1.5% off on MPNet itself before the probe compared treatments (selfcheck.treatment)
    "batch_expand_t": dict(use="batch_expand_t"),
    "batch_expand_t_big": dict(use="batch_expand_t", big=True),
}


def problem(name, n, seed=0):
    torch.manual_seed(seed)
    model = RelativeBias(**{**RULE, **FALLBACK}[name]).double()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, T, D, generator=g, dtype=torch.float64)
    return model, x, torch.randn(n, 2, generator=g, dtype=torch.float64)


def bias_routes(routes):
    return set(routes[routes["layer"] == "relative_attention_bias"]["route"])


@pytest.mark.parametrize("n", [3, T])  # n = T: a layout the shapes cannot tell apart
@pytest.mark.parametrize("name", RULE)
def test_relative_bias_takes_the_embedding_rule_exactly(name, n):
    model, x, y = problem(name, n)
    routes = exact_routes(model, x, y)  # every method and clipped sum vs micro-batching
    assert bias_routes(routes) == {"segment sum"}, routes
    assert not routes["route"].str.contains("fallback|vmap").any(), routes


@pytest.mark.parametrize("n", [3, T])
@pytest.mark.parametrize("name", FALLBACK)
def test_unproven_uses_of_the_bias_stay_exact_on_the_fallback(name, n):
    model, x, y = problem(name, n)
    routes = exact_routes(model, x, y)
    # an op after the lookup that is not shape-only (bias * 2, bias + bias) makes it a tensor
    # computed from parameters alone meeting the scores: the meetings' route, no whole-model
    # pass (per_sample/derived.py); an in-place write on it keeps the fallback
    want = "derived (meetings)" if name in ("nonshape", "twice_in_one_op") else "exact fallback"
    assert bias_routes(routes) == {want}, routes


@pytest.mark.parametrize("name", ["layers", "sdpa_causal", "times", "batch_expand",
                                  "batch_expand_t"])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_with_relative_bias_matches_microbatching(name, mode):
    model, _, _ = problem(name, 1)
    sizes = (3, T, 2, T)  # Poisson-like, n = T from the second step on
    batches = [problem(name, n, seed=s)[1:] for s, n in enumerate(sizes)]
    assert_optimizer_matches_microbatch(model, mse_per_sample, batches, method=mode)


@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_dropout_after_the_meeting_trains_in_every_mode(mode):
    """Dropout on the scores after the bias is added: the optimizer's self-check compares
    with micro-batching under the same masks and must accept the conversion. (SDPA's own
    ``dropout_p`` is refused by the self-check in five modes with or without the conversion:
    its twin does not reproduce SDPA's masks; not covered here.)"""
    torch.manual_seed(0)
    model = RelativeBias(p=0.3).double().train()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model, noise_multiplier=0.3,
                      max_grad_norm=0.7, expected_batch_size=3, method=mode,
                      generator=torch.Generator().manual_seed(2))
    before = model.relative_attention_bias.weight.detach().clone()
    try:
        for n in (3, T):
            _, x, y = problem("layers", n, seed=n)
            opt.zero_grad()
            mse_per_sample(model(x), y).mean().backward()  # loss_reduction="mean"
            opt.step()
    finally:
        opt.detach()
    assert not torch.equal(before, model.relative_attention_bias.weight)


def off_rows_test(monkeypatch):
    """The recording's own test of a lookup on a (T, T) table computed without the batch at
    n = T (``recording.rows_not_samples``) switched off too: the bias then takes the wrong
    route the checks below must refuse."""
    from workbench.per_sample import recording

    monkeypatch.setattr(recording, "rows_not_samples", lambda layer, call, n: None)


def test_a_table_computed_without_the_batch_is_not_read_as_samples(monkeypatch):
    """The same bias at n = T with the probe's treatment test off: the lookup's input is
    tainted by no input, its rows differ, so its rows are not samples: exact, every mode."""
    from workbench.per_sample import selfcheck

    monkeypatch.setattr(selfcheck, "treatment", lambda call: (False, False))
    model, x, y = problem("batch_expand_t_big", T)
    for mode in ("bookkeeping", "einsum", "auto"):
        assert_optimizer_matches_microbatch(model, mse_per_sample, [(x, y)], method=mode,
                                            verify=False)


@pytest.mark.parametrize("mode", ["bookkeeping", "auto", "einsum"])
def test_the_sums_own_row_is_checked_not_only_its_norm(mode, monkeypatch):
    """The MPNet-like bias (transposed after its expand) at n = T with the probe's treatment
    test switched off: the bias's wrong per-sample gradient barely moves ||g_i|| (its part
    of the norm is small), so a norm check passed it. The check compares the record's own
    contribution, parameter by parameter, as the clipped sum adds it
    (``per_sample/sketch.py``): refused, naming it."""
    from workbench.errors import PerSampleCheckError
    from workbench.per_sample import selfcheck

    monkeypatch.setattr(selfcheck, "treatment", lambda call: (False, False))
    off_rows_test(monkeypatch)
    model, x, y = problem("batch_expand_t_big", T)
    with pytest.raises(PerSampleCheckError, match="relative_attention_bias.weight"):
        assert_optimizer_matches_microbatch(model, mse_per_sample, [(x, y)], method=mode)


def test_a_norm_verdict_never_stands_in_for_a_vector_check(monkeypatch):
    """Ghost clipping checks ||g_i|| alone (its sum is autograd's: only the norms enter it)
    and passes the MPNet-like bias at n = T (treatment test off); book-keeping's sum reads
    every per-sample vector, so ghost's verdict must not spare it its own check
    (``selfcheck.known(stronger=...)``)."""
    import workbench as wb
    from workbench.errors import PerSampleCheckError
    from workbench.per_sample import selfcheck

    monkeypatch.setattr(selfcheck, "treatment", lambda call: (False, False))
    off_rows_test(monkeypatch)
    model, x, y = problem("batch_expand_t_big", T)
    C = float(wb.per_sample_grad_norms(model, mse_per_sample, x, y, "microbatch").median())
    want = wb.clipped_grad_sum(model, mse_per_sample, x, y, C, method="microbatch")
    ghost = wb.clipped_grad_sum(model, mse_per_sample, x, y, C, method="ghost")
    for k in want:  # the bias's wrong norm moves c_i within the norm check's 1e-7
        torch.testing.assert_close(ghost[k], want[k], rtol=1e-6, atol=1e-9)
    with pytest.raises(PerSampleCheckError, match="relative_attention_bias.weight"):
        wb.clipped_grad_sum(model, mse_per_sample, x, y, C, method="bookkeeping")


class PermutedResidual(nn.Module):
    """ConvNeXt's block: a Linear on channels-last positions, permuted back and added to the
    residual. For one sample (the probe) the permuted output's dim 0 of 1 broadcasts against
    the residual's, so that pass records the Linear as broadcast into the batch; the batch's
    pass records it as called for n samples (``selfcheck.one_broadcasts``)."""

    def __init__(self, c=4):
        super().__init__()
        self.stem = nn.Conv2d(c, c, 1)
        self.norm, self.mix, self.head = nn.LayerNorm(c), nn.Linear(c, c), nn.Linear(c, 2)

    def forward(self, x):  # (n, C, H, W)
        residual = self.stem(x)
        h = self.mix(self.norm(residual.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)
        return self.head(torch.tanh(residual + h).mean((2, 3)))


@pytest.mark.parametrize("n", [3, 4])  # 4 = C = W: a layout the shapes cannot tell apart
def test_a_batch_call_permuted_into_a_residual_keeps_its_rule(n):
    torch.manual_seed(0)
    model = PermutedResidual().double()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    routes = exact_routes(model, x, y)  # every method and clipped sum vs micro-batching
    assert not routes["route"].str.contains("fallback|vmap").any(), routes
    assert_optimizer_matches_microbatch(model, mse_per_sample, [(x, y), (x[:2], y[:2])])
