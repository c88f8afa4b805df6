"""Rows proved, not assumed (``flat_rows.unproved``): a layer called on a tensor computed from
the batch whose rows no op showed to be the records' in their order takes the exact fallback.

``test_reordered_rows.py`` covers the reorders the row tags follow (``x[perm]``,
``index_select``, ``gather``); a review (``/work/runs/probeR17/spell.py``) found every other
spelling of the same sort silent in every mode, 17% off in the clipped sum: a sort written as a
write (``out[inv] = h``, ``index_copy``, ``index_add``, ``scatter``), a 2-d index, rows
stacked one by one, an index after an op the tags do not follow (a custom
``autograd.Function``, an FFT), a layer without a rule sorting its rows inside. Until
2026-11-30 shapes alone stood for the proof. Each case is compared with a float64 loop over one
record at a time, the probed (last) record kept in place by the sort. The tags' own rules
must keep the real models' spellings on the fast path (no fallback): BLOOM's GELU, a custom
``autograd.Function`` of row-wise ops; its ``baddbmm``; RoBERTa's token-type buffer gathered by
the position ids.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench as wb
from workbench.dpsgd import MODES, DPOptimizer
from workbench.per_sample.recording import record

T, V = 5, 12


class Same(torch.autograd.Function):
    """A custom Function whose forward the tags cannot see through: a clone."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g


def spread(h, idx):
    return idx.view(-1, *([1] * (h.dim() - 1))).expand_as(h)


def written(h, perm, inv):
    out = torch.empty_like(h)
    out[inv] = h
    return out


def written_over_a_copy(h, perm, inv):
    out = h.clone()  # tagged: the write itself must lapse the tag
    out[inv] = h
    return out


def written_into_zeros(h, inv):
    out = torch.zeros(h.shape)  # carries no sample: its rows are proved by the write alone
    out[inv] = h
    return out


SORTS = {  # (h, perm, inv) -> the rows of h in the order perm, h[perm]
    "write": written,
    "write_over_copy": written_over_a_copy,
    "index_copy": lambda h, p, i: torch.zeros_like(h).index_copy(0, i, h),
    "index_add": lambda h, p, i: torch.zeros_like(h).index_add(0, i, h),
    "index_add_": lambda h, p, i: torch.zeros_like(h).index_add_(0, i, h),
    "index_add_into_zeros": lambda h, p, i: torch.zeros(h.shape).index_add_(0, i, h),
    "write_into_zeros": lambda h, p, i: written_into_zeros(h, i),
    "index_put_": lambda h, p, i: torch.zeros(h.shape).index_put_((i,), h),
    "index_copy_": lambda h, p, i: torch.zeros_like(h).index_copy_(0, i, h),
    "scatter": lambda h, p, i: torch.zeros_like(h).scatter(0, spread(h, i), h),
    "index_2d": lambda h, p, i: h[p[:, None], torch.arange(h.shape[1])],
    "stack": lambda h, p, i: torch.stack([h[k] for k in p]),
    "cat": lambda h, p, i: torch.cat([h[k:k + 1] for k in p]),
    "function_then_index": lambda h, p, i: Same.apply(h)[p],
    "fft_then_index": lambda h, p, i: torch.fft.ifft(torch.fft.fft(h, dim=-1), dim=-1).real[p],
}


class SortRun(nn.Module):
    """Sort by length, run a layer, put back with ``h[inv]``."""

    def __init__(self, spelling):
        super().__init__()
        self.e, self.l, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 6), \
            nn.Linear(6, 3)
        self.spelling = spelling

    def forward(self, x):
        perm = (x != 0).sum(1).argsort(descending=True, stable=True)
        inv = perm.argsort()
        h = torch.tanh(self.l(SORTS[self.spelling](self.e(x), perm, inv))).sum(1)
        return self.o(h[inv])


class SortsInside(nn.Module):
    """A layer without a rule that returns its rows sorted by their norm (per-layer vmap would
    run each record alone, where no sort happens)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4) / 2)

    def forward(self, h):
        perm = h.detach().norm(dim=(1, 2)).argsort()
        return torch.tanh(h @ self.w)[perm], perm


class RulelessSort(nn.Module):
    def __init__(self):
        super().__init__()
        self.e, self.inner, self.o = nn.Embedding(V, 4, padding_idx=0), SortsInside(), \
            nn.Linear(4, 3)

    def forward(self, x):
        h, perm = self.inner(self.e(x))
        out = torch.empty_like(h)
        out[perm] = h  # back in the batch's order by a write
        return self.o(out.sum(1))


class GeluFunction(torch.autograd.Function):
    """BLOOM's training-mode GELU: row-wise ops inside a custom Function."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        d = 0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t)
        return g * d


class RealSpellings(nn.Module):
    """Spellings of real models the row tags follow: no fallback."""

    def __init__(self, heads=2):
        super().__init__()
        self.heads = heads
        self.e, self.t = nn.Embedding(V, 4, padding_idx=0), nn.Embedding(2, 4)
        self.q, self.k, self.v = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.l, self.o = nn.Linear(4, 4), nn.Linear(4, 3)
        self.register_buffer("types", torch.zeros(1, T, dtype=torch.long))

    def forward(self, x):
        n = x.shape[0]
        mask = (x != 0).long()
        pos = mask.cumsum(1) * mask  # RoBERTa's position ids
        types = torch.gather(self.types.expand(n, -1), dim=1, index=pos.clamp(max=T - 1))
        h = self.e(x) + self.t(types)
        slopes = torch.tensor([0.5, 0.25])
        alibi = (slopes[:, None] * ((mask.cumsum(-1) - 1) * mask)[:, None, :])  # (n, H, T)
        alibi = alibi.reshape(n * self.heads, 1, T).to(h.dtype)

        def split(t):
            return t.view(n, T, self.heads, 2).transpose(1, 2).reshape(n * self.heads, T, 2)

        q, k, v = split(self.q(h)), split(self.k(h)), split(self.v(h))
        scores = alibi.baddbmm(batch1=q, batch2=k.transpose(1, 2), beta=1.0, alpha=0.7)
        a = torch.bmm(scores.softmax(-1), v).view(n, self.heads, T, 2).transpose(1, 2)
        h = GeluFunction.apply(self.l(a.reshape(n, T, 4)))
        h[..., 0] = 0.0  # writes in place that keep each row (``flat_rows._kept``)
        h[:, 0].mul_(2.0)  # through another view of the storage
        h[x == 0] = 0.0  # a mask with the batch's rows
        h.masked_fill_((x == 1)[..., None], 0.5)
        return self.o(h.sum(1))


class MoreSpellings(nn.Module):
    """Row-wise ops of the models beyond the table (a review's census, /work/runs/probeR18):
    transformers' padding mask ``mask[arange(n)[:, None, None, None], kv]`` into SDPA,
    timm's eval-mode ``F.batch_norm``, ``repeat(1, ...)``, ``argmax`` along dim 1 and the
    pick it proves, ``glu``, ``F.unfold``, ``interpolate``, ``flip`` and ``index_select``
    along other dims, a table's rows picked by tagged ids, learned queries (no sample)
    attending to the batch (DETR), ``x[::1]``, ``x[:, [-1, 0]]``."""

    def __init__(self):
        super().__init__()
        self.e, self.q, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 4), \
            nn.Linear(4, 3)
        self.queries = nn.Parameter(torch.randn(1, 2, 4))
        self.register_buffer("table", torch.randn(V, 4))
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))

    def forward(self, x):
        n = x.shape[0]
        keep = x != 0
        mask = keep[torch.arange(n)[:, None, None, None], torch.arange(T)[None, None, None, :]]
        h = self.e(x) + torch.index_select(self.table, 0, x.reshape(-1)).view(n, T, 4)
        h = F.scaled_dot_product_attention(self.q(h)[:, None], h[:, None], h[:, None],
                                           attn_mask=mask)[:, 0]  # (n, T, 4)
        h = F.batch_norm(h.transpose(1, 2), self.mean, self.var, training=False)
        h = h.transpose(1, 2).repeat(1, 1, 2)  # (n, T, 8)
        h = F.glu(h, dim=-1)  # (n, T, 4)
        h = F.interpolate(h.transpose(1, 2), size=T, mode="linear").transpose(1, 2)
        h = h.flip(1).index_select(1, torch.arange(T - 1, -1, -1))[::1]
        h = h + F.unfold(h[:, None], (1, 1)).transpose(1, 2).reshape(n, T, 4)
        top = h.sum(-1).argmax(dim=1)
        picked = h[torch.arange(n), top]  # (n, 4)
        ends = h[:, [-1, 0]].sum(1)
        queries = self.queries.expand(n, -1, -1)
        learned = F.scaled_dot_product_attention(queries, h, h).sum(1)
        return self.o(torch.tanh(picked + ends + learned))


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def batch(n, seed, last_shortest=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(1, V, (n, T), generator=g)
    lengths = torch.randint(2, T + 1, (n,), generator=g)
    if last_shortest:
        lengths[-1] = 1  # the probed record keeps its place after the sort
    x[torch.arange(T)[None] >= lengths[:, None]] = 0
    return x, torch.randint(0, 3, (n,), generator=g)


def reference(model, x, y, C):
    """Σ_i min(1, C / ||g_i||) g_i, one record at a time."""
    params = dict(model.named_parameters())
    rows = [torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                list(params.values())) for i in range(len(x))]
    norms = torch.stack([torch.sqrt(sum(g.pow(2).sum() for g in r)) for r in rows])
    c = (C / norms).clamp(max=1.0)
    return {k: sum(c[i] * rows[i][j] for i in range(len(x)))
            for j, k in enumerate(params)}, norms


def rel(got, want):
    num = sum((got[k] - want[k]).pow(2).sum() for k in want)
    return float(num.sqrt() / sum(w.pow(2).sum() for w in want.values()).sqrt())


@pytest.fixture(autouse=True)
def _float64(float64_default):  # (tests/conftest.py)
    yield


def model_of(spelling):
    torch.manual_seed(0)
    return RulelessSort() if spelling == "ruleless_layer" else SortRun(spelling)


SPELLINGS = [*SORTS, "ruleless_layer"]


@pytest.mark.parametrize("spelling", SPELLINGS)
@pytest.mark.parametrize("method", ["einsum", "ghost", "bookkeeping"])
def test_functional_clipped_sum_exact(spelling, method):
    model = model_of(spelling)
    x, y = batch(5, 3)
    _, norms = reference(model, x, y, 1.0)
    C = float(norms.median())
    want, _ = reference(model, x, y, C)
    got = wb.clipped_grad_sum(model, loss_fn, x, y, C, method=method)
    assert rel(got, want) < 1e-10


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_functional_per_sample_gradients_exact_without_the_check(spelling):
    """check=False: no probe to stand in for the proof."""
    model = model_of(spelling)
    x, y = batch(5, 3)
    got = wb.per_sample_gradients(model, loss_fn, x, y, method="einsum", check=False)
    for i in range(len(x)):
        want = torch.autograd.grad(loss_fn(model(x[i:i + 1]), y[i:i + 1]).sum(),
                                   list(model.parameters()))
        for (k, g), w in zip(got.items(), want):
            torch.testing.assert_close(g[i], w, rtol=1e-9, atol=1e-12, msg=k)


@pytest.mark.parametrize("spelling", ["write", "scatter", "index_2d", "function_then_index",
                                      "ruleless_layer"])
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_optimizer_exact_over_steps(spelling, mode):
    """Later batches of a size already checked get no probe: the proof must hold alone."""
    model, twin = model_of(spelling), model_of(spelling)
    batches = [batch(n, seed) for n, seed in [(5, 1), (5, 2), (3, 3), (5, 4), (5, 5)]]
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=5, loss_reduction="sum",
                      method=mode)
    for step, (x, y) in enumerate(batches):
        want, _ = reference(twin, x, y, 0.5)
        opt.zero_grad()
        loss_fn(model(x), y).sum().backward()
        opt.step()
        got = {k: -(p.detach() - q.detach()) / 0.1 * 5 for (k, p), q in
               zip(model.named_parameters(), twin.parameters())}
        assert rel(got, want) < 1e-9, (step, rel(got, want))
        twin.load_state_dict(model.state_dict())


@pytest.mark.parametrize("spelling", ["write", "stack"])
def test_the_layers_on_unproved_rows_take_the_fallback_and_say_why(spelling):
    """The layers after the op the tags cannot follow take the fallback (``h[inv]`` of rows in
    an unknown order proves nothing either); the embedding before it keeps its rule."""
    model = model_of(spelling)
    x, y = batch(5, 3)
    rec = record(model, loss_fn, x, y)
    why = {name: rec.fallback.get(id(p)) for name, p in model.named_parameters()}
    for name in ("l.weight", "o.weight"):
        assert why[name] and "does not show which record each row is" in why[name], name
    assert why["e.weight"] is None


def test_a_2d_index_with_one_index_per_row_is_followed_as_a_reorder():
    """``h[p[:, None], arange(T)]`` is ``h[p]``: the layer between takes the fallback as on
    reordered rows, and ``h[inv]`` makes the rows the batch's again (the fast path after)."""
    model = model_of("index_2d")
    x, y = batch(5, 3)
    rec = record(model, loss_fn, x, y)
    why = {name: rec.fallback.get(id(p)) for name, p in model.named_parameters()}
    assert why["l.weight"] and "in another order" in why["l.weight"]
    assert why["o.weight"] is None and why["e.weight"] is None


@pytest.mark.parametrize("spellings", [RealSpellings, MoreSpellings],
                         ids=["real", "beyond_the_table"])
def test_followed_spellings_keep_the_fast_path_and_are_exact(spellings):
    """RealSpellings: a custom Function of row-wise ops (BLOOM's GELU), ``baddbmm`` (its
    alibi), a buffer gathered by tagged position ids (RoBERTa's token types), writes in place
    that keep each row. MoreSpellings: the ops of the models beyond the table (its docstring).
    Tags followed, no fallback, exact."""
    torch.manual_seed(0)
    model = spellings()
    x, y = batch(4, 3, last_shortest=False)
    rec = record(model, loss_fn, x, y)
    assert not rec.fallback, rec.fallback
    want, _ = reference(model, x, y, 0.5)
    for method in ("einsum", "ghost", "bookkeeping"):
        got = wb.clipped_grad_sum(model, loss_fn, x, y, 0.5, method=method)
        assert rel(got, want) < 1e-10, method


# Rows addressed by an index (``flat_rows._row_writes``): until 2026-12-01 every write of rows
# by an integer index lost the tag, so two real spellings kept the exact fallback (exact,
# slower): the attention mask the wav2vec2 family (HuBERT, WavLM, Data2VecAudio, SEW,
# Speech2Text) writes into zeros at each record's length, and a Mixture-of-Experts block's
# expert outputs added back at their tokens by ``index_add_`` (Qwen2-MoE, OLMoE, Mixtral
# eager). Such a write keeps (or, into a tensor carrying no sample, makes) the rows when
# entry k's row idx[k] is the record of every operand's row k; ``~mask`` no longer reads as a
# write in place (``flat_rows.AUGMENTED``). The sorts above written by index stay unproved.
E = 3  # experts


def lengths_of(x):
    return (x != 0).long().cumsum(-1)[:, -1]  # (n,), right-padded ids


def mask_at(rows, lengths, n):
    """wav2vec2's ``_get_feature_vector_attention_mask``: 1 at each record's last position,
    flipped, summed, flipped: True up to the length."""
    z = torch.zeros(n, T, dtype=torch.long)
    z[(rows, lengths - 1)] = 1
    return z.flip([-1]).cumsum(-1).flip([-1]).bool()


class LengthMask(nn.Module):
    """The mask written at each record's length, ``h[~mask] = 0`` (the encoder's padding), a
    masked mean; ``permuted``: the same mask written in another row order whose lengths follow
    it, ``z[(perm, lengths[perm] - 1)] = 1`` (proved too: entry k is record perm[k]'s)."""

    def __init__(self, permuted=False):
        super().__init__()
        self.e, self.l, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(4, 4), \
            nn.Linear(4, 3)
        self.permuted = permuted

    def forward(self, x):
        n, lengths = x.shape[0], lengths_of(x)
        rows = torch.arange(n)
        if self.permuted:
            rows = lengths.argsort(descending=True, stable=True)
            lengths = lengths[rows]
        mask = mask_at(rows, lengths, n)
        h = self.e(x)
        h[~mask] = 0.0
        h = torch.tanh(self.l(h))
        return self.o(h.sum(1) / mask.sum(1, keepdim=True))


class Experts(nn.Module):
    """Qwen2-MoE's eager experts on (n·T, d) tokens: for each expert hit, its tokens gathered,
    its weights picked by the loop's index, the outputs added back at the tokens.
    ``shift``: added back at the next record's tokens instead (undone by the caller)."""

    def __init__(self, shift=0):
        super().__init__()
        self.up = nn.Parameter(torch.randn(E, 6, 4) / 2)
        self.down = nn.Parameter(torch.randn(E, 4, 6) / 2)
        self.shift = shift

    def forward(self, h, weights, index):
        out = torch.zeros_like(h)
        with torch.no_grad():
            hit = F.one_hot(index, E).permute(2, 1, 0)  # (E, k, tokens)
            experts = (hit.sum((-1, -2)) > 0).nonzero()
        for e in experts:
            e = e[0]
            pos, tokens = torch.where(hit[e])
            step = torch.tanh(F.linear(h[tokens], self.up[e]))
            step = F.linear(step, self.down[e]) * weights[tokens, pos, None]
            out.index_add_(0, (tokens + self.shift) % h.shape[0], step)
        return out


class Moe(nn.Module):
    """A router on the flattened tokens, the experts, a residual; ``shift`` = T: each record's
    expert outputs land in the next record's rows, a Linear runs on them, and ``roll`` puts
    them back (so the model treats each record alone, but the Linear's rows are not proved)."""

    def __init__(self, shift=0):
        super().__init__()
        self.e, self.router, self.experts = nn.Embedding(V, 4, padding_idx=0), \
            nn.Linear(4, E, bias=False), Experts(shift)
        self.post, self.o = nn.Linear(4, 4), nn.Linear(4, 3)
        self.shift = shift

    def forward(self, x):
        n = x.shape[0]
        h = self.e(x).view(n * T, 4)
        weights, index = torch.topk(self.router(h).softmax(-1), 2, dim=-1)
        moved = self.post(self.experts(h, weights, index))
        back = moved.view(n, T, 4).roll(-1, 0).reshape(n * T, 4) if self.shift else moved
        return self.o(torch.tanh(h + back).view(n, T, 4).sum(1))


class NextRowMask(nn.Module):
    """Each record's mask written into row (r + 1) mod n, a Linear on those rows, rolled back:
    the model treats each record alone, but the Linear's rows are another record's."""

    def __init__(self):
        super().__init__()
        self.e, self.l, self.o = nn.Embedding(V, 4, padding_idx=0), nn.Linear(1, 4), \
            nn.Linear(4, 3)

    def forward(self, x):
        n = x.shape[0]
        mask = mask_at((torch.arange(n) + 1) % n, lengths_of(x), n)  # row r: record r - 1's
        g = torch.tanh(self.l(mask[..., None].to(torch.float64))).roll(-1, 0)  # back
        return self.o((self.e(x) * g).sum(1))


def unproved_of(model, x, y):
    """The census: the layers called on rows no op proved the records' in their order (the
    call's ``unproved``: an untagged tensor; ``reordered``: another order), each such call
    sent to the exact fallback (``recording.batch_problem``)."""
    rec = record(model, loss_fn, x, y)
    return {path for path, calls in rec.recorder.calls.items()
            if any(c.unproved or c.reordered for c in calls)}


WRITES = {"length_mask": LengthMask, "length_mask_permuted": lambda: LengthMask(True),
          "moe_index_add": Moe}


@pytest.mark.parametrize("n", [4, 6])
@pytest.mark.parametrize("spelling", list(WRITES))
def test_rows_written_by_index_keep_the_fast_path_and_are_exact(spelling, n):
    torch.manual_seed(0)
    model = WRITES[spelling]()
    x, y = batch(n, n, last_shortest=False)
    assert not unproved_of(model, x, y)
    want, _ = reference(model, x, y, 0.5)
    for method in ("einsum", "ghost", "bookkeeping"):
        got = wb.clipped_grad_sum(model, loss_fn, x, y, 0.5, method=method)
        assert rel(got, want) < 1e-10, method


@pytest.mark.parametrize("spelling", list(WRITES))
@pytest.mark.parametrize("mode", [*MODES, "auto"])
def test_rows_written_by_index_optimizer_exact_over_steps(spelling, mode):
    torch.manual_seed(0)
    model = WRITES[spelling]()
    torch.manual_seed(0)
    twin = WRITES[spelling]()
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, noise_multiplier=0.0,
                      max_grad_norm=0.5, expected_batch_size=5, loss_reduction="sum",
                      method=mode)
    for step, (n, seed) in enumerate([(5, 1), (4, 2), (5, 3)]):
        x, y = batch(n, seed, last_shortest=False)
        want, _ = reference(twin, x, y, 0.5)
        opt.zero_grad()
        loss_fn(model(x), y).sum().backward()
        opt.step()
        got = {k: -(p.detach() - q.detach()) / 0.1 * 5 for (k, p), q in
               zip(model.named_parameters(), twin.parameters())}
        assert rel(got, want) < 1e-9, (step, rel(got, want))
        twin.load_state_dict(model.state_dict())


ADVERSARIAL = {"moe_index_add_next_record": (lambda: Moe(shift=T), "post"),
               "mask_written_at_the_next_row": (NextRowMask, "l")}


@pytest.mark.parametrize("check", [True, False])
@pytest.mark.parametrize("spelling", list(ADVERSARIAL))
def test_rows_written_at_another_records_rows_stay_unproved(spelling, check):
    """``index_add_`` at the next record's tokens, a mask written into row (r + 1) mod n: the
    layer reading those rows takes the exact fallback, exact (read as the records' rows its
    rule would give each record the next one's gradient)."""
    torch.manual_seed(0)
    build, layer = ADVERSARIAL[spelling]
    model = build()
    x, y = batch(5, 3, last_shortest=False)
    assert layer in unproved_of(model, x, y)
    want, _ = reference(model, x, y, 0.5)
    for method in ("einsum", "ghost", "bookkeeping"):
        got = wb.clipped_grad_sum(model, loss_fn, x, y, 0.5, method=method, check=check)
        assert rel(got, want) < 1e-10, method


def test_an_inverted_mask_is_no_write():
    """``~mask`` kept the mask's rows in no tag: ``__invert__`` (like ``__iter__``,
    ``__index__``, ``__int__``) was read as a write in place, its name starting "__i"."""
    from workbench.per_sample import derived, flat_rows
    for name in ("__invert__", "__iter__", "__index__", "__int__"):
        assert not flat_rows.in_place(name) and not derived.writes_first(name), name
    for name in ("__iadd__", "__imul__", "__ior__", "__setitem__", "add_"):
        assert flat_rows.in_place(name) and derived.writes_first(name), name
