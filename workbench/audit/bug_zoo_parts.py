"""Wrong DP-SGD steps that are wrong in one part only: a layer, a parameter, a record, a call.

``bug_zoo`` holds steps wrong everywhere (the clip factor, the noise scale); these are right on
most coordinates, records and calls, which is why a first design of ``audit_dp_step`` let
several of them pass: one huge record spread over every coordinate was the only one per-layer
clipping moved (too little to see at a few trials: 60 trials on 32 coordinates passed it), no
designed record had its mass on the parameter a norm leaves out, none held a NaN, and the noise
checks pooled every coordinate and looked one call back; later, none of the checks looked at
the noise across coordinates (two sharing one draw) and no designed batch was empty. Each
step differs from the claim of Abadi et al. 2016 (arXiv 1607.00133), Algorithm 1,

    step(G) = (Σ_i min(1, C / ||g_i||) g_i + N(0, σ² C² I)) / B,

in the place its docstring names; the d coordinates stand for the model's parameters.

Notation: n realised batch size, d coordinates, g_i row i of G, C max_grad_norm,
σ noise multiplier, B expected batch size.
"""

import torch

from workbench.audit.bug_zoo import _clip_rows, _noise


def per_layer_clipping(C, sigma, B, generator=None, layers=2):
    """Bug: each layer (here: each half of the coordinates) clipped to C on its own, and the
    noise calibrated to C: a record's clipped gradient can have norm C·sqrt(layers).
    ``layers``: how many equal parts, or the indices that split the coordinates (as
    ``torch.tensor_split``: [1] makes coordinate 0 a layer of its own)."""
    def step(G):
        parts = torch.tensor_split(G, layers, dim=1)  # (n, d_l) each, Σ d_l = d
        clipped = torch.cat([_clip_rows(p, C) for p in parts], dim=1)  # (n, d)
        return (clipped.sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def norm_leaves_out_a_parameter(C, sigma, B, generator=None):
    """Bug: the clip norm is computed over every parameter but one (coordinate d/2: a bias
    kept out of the norm, a parameter the hooks missed), then every parameter is scaled: a
    record whose gradient lies on that parameter is not clipped at all."""
    def step(G):
        j = G.shape[1] // 2
        norms = ((G ** 2).sum(1, keepdim=True) - G[:, j:j + 1] ** 2).clamp(min=0).sqrt()
        c = (C / norms).clamp(max=1.0)  # (n, 1): the norm without parameter j
        return ((c * G).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def unclipped_bias(C, sigma, B, generator=None):
    """Bug: one parameter (coordinate d/2, a bias or a layer unfrozen after the optimizer was
    built) gets the sum of the unclipped gradients; the others are clipped."""
    def step(G):
        j = G.shape[1] // 2
        out = _clip_rows(G, C).sum(0)
        out[j] = G[:, j].sum()
        return (out + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def noise_missing_on_a_parameter(C, sigma, B, generator=None):
    """Bug: one parameter (coordinate d/2, a parameter group the noise loop skips) gets no
    noise; the pooled noise variance is off by only 1/d."""
    def step(G):
        noise = _noise(G.shape[1], sigma * C, generator, G)
        noise[G.shape[1] // 2] = 0.0
        return (_clip_rows(G, C).sum(0) + noise) / B
    return step


def nan_record_full_weight(C, sigma, B, generator=None):
    """Bug: a record whose norm is NaN gets clip factor 1 (``where(isnan(norm), 1, ...)``) and
    its NaN entries are zeroed: the rest of it enters the sum unclipped."""
    def step(G):
        norms = G.norm(dim=1, keepdim=True)  # (n, 1), NaN for a record holding a NaN
        c = torch.where(torch.isnan(norms), torch.ones_like(norms), (C / norms).clamp(max=1.0))
        return ((c * torch.nan_to_num(G)).sum(0)
                + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def noise_seed_with_a_period(C, sigma, B, generator=None, period=7):
    """Bug: the noise generator is re-seeded from the step counter modulo 7 (a seed derived
    from the epoch's batch index, say): every 7th call repeats a noise vector, and the
    difference of two such updates reveals the difference of their clipped sums."""
    calls = [0]

    def step(G):
        calls[0] += 1
        g = torch.Generator().manual_seed(1000 + calls[0] % period)
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, g, G)) / B
    return step


def noise_scaled_by_realised_batch(C, sigma, B, generator=None):
    """Bug: the noise std is σC·n/B (the noise of the mean, scaled by the realised n) while
    the sum is divided by B: the noise, and so ε, depends on how many records were sampled."""
    def step(G):
        n = G.shape[0]
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C * n / B, generator, G)) / B
    return step


def noise_shared_by_two_coordinates(C, sigma, B, generator=None):
    """Bug: coordinate 1 reuses coordinate 0's noise draw (an index slip in a noise buffer,
    two parameters aliasing one noise tensor): every coordinate's noise has the claimed law,
    but y_0 - y_1 carries none, so the difference of their clipped sums is released exactly
    (ε = ∞ in that direction)."""
    def step(G):
        noise = _noise(G.shape[1], sigma * C, generator, G)
        noise[1] = noise[0]
        return (_clip_rows(G, C).sum(0) + noise) / B
    return step


def no_noise_on_an_empty_batch(C, sigma, B, generator=None):
    """Bug: an empty batch returns zeros (``if not batch: return`` before the noise): under
    Poisson sampling whether a batch is empty depends on the records, and an update of
    exactly zero says that none of them was drawn."""
    def step(G):
        if G.shape[0] == 0:
            return torch.zeros(G.shape[1], dtype=G.dtype)
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def clip_factor_floored(C, sigma, B, generator=None, floor=0.01):
    """Bug: the clip factor clamped to [0.01, 1] (a floor "against vanishing updates"): a record
    of norm 1000C still adds 10C. Exact on every record below 100C, the largest of the
    designed batches until 2026-11-30."""
    def step(G):
        c = (C / G.norm(dim=1, keepdim=True)).clamp(min=floor, max=1.0)
        return ((c * G).sum(0) + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def clip_on_first_physical_batch_only(C, sigma, B, generator=None, physical=64):
    """Bug: a batch cut into physical batches of 64 is clipped only in the first one (the
    clip inside an ``if first:``), the rest summed as they are: exact on every batch of up to
    64 records, the largest designed batch having 32 until 2026-11-30."""
    def step(G):
        head, tail = G[:physical], G[physical:]
        return (_clip_rows(head, C).sum(0) + tail.sum(0)
                + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def small_batches_unclipped(C, sigma, B, generator=None):
    """Bug: a fast path for batches of 2 to 5 records sums them unclipped (the neighbour of
    ``lone_record_unclipped``): no designed batch of that size held a record above C."""
    def step(G):
        total = G.sum(0) if 2 <= G.shape[0] <= 5 else _clip_rows(G, C).sum(0)
        return (total + _noise(G.shape[1], sigma * C, generator, G)) / B
    return step


def noise_per_accumulated_chunk(C, sigma, B, generator=None, physical=64):
    """Bug: gradient accumulation over k physical batches of 64 adds noise σC/k to each, so the
    total std is σC/√k: right on batches of up to 64 records, √k too small beyond."""
    def step(G):
        k = max(1, -(-G.shape[0] // physical))
        noise = sum(_noise(G.shape[1], sigma * C / k, generator, G) for _ in range(k))
        return (_clip_rows(G, C).sum(0) + noise) / B
    return step


def noise_std_sigma_squared(C, sigma, B, generator=None):
    """Bug: noise std σ²C (a variance taken for a standard deviation): right at σ = 1 only,
    the noise multiplier the mechanism audit of the command line ran at until 2026-11-30;
    half the noise at σ = 0.5."""
    def step(G):
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma ** 2 * C, generator, G)) / B
    return step


def noise_seeded_when_built(C, sigma, B, generator=None):
    """Bug: the step ignores the generator it is given and seeds one of its own with 0 when it
    is built: fresh noise at every call, but the same sequence in every run, so anyone who has
    the code knows each release's noise. Only a second step built apart shows it."""
    own = torch.Generator().manual_seed(0)

    def step(G):
        return (_clip_rows(G, C).sum(0) + _noise(G.shape[1], sigma * C, own, G)) / B
    return step


PARTS = {
    "per_layer_clipping": per_layer_clipping,
    "norm_leaves_out_a_parameter": norm_leaves_out_a_parameter,
    "unclipped_bias": unclipped_bias,
    "noise_missing_on_a_parameter": noise_missing_on_a_parameter,
    "nan_record_full_weight": nan_record_full_weight,
    "noise_seed_with_a_period": noise_seed_with_a_period,
    "noise_scaled_by_realised_batch": noise_scaled_by_realised_batch,
    "noise_shared_by_two_coordinates": noise_shared_by_two_coordinates,
    "no_noise_on_an_empty_batch": no_noise_on_an_empty_batch,
    "clip_factor_floored": clip_factor_floored,
    "clip_on_first_physical_batch_only": clip_on_first_physical_batch_only,
    "small_batches_unclipped": small_batches_unclipped,
    "noise_per_accumulated_chunk": noise_per_accumulated_chunk,
    "noise_std_sigma_squared": noise_std_sigma_squared,
    "noise_seeded_when_built": noise_seeded_when_built,
}
"""name -> factory (C, σ, B, generator) -> step_fn; each must fail ``audit_dp_step``."""


__all__ = [
    "PARTS", "clip_factor_floored", "clip_on_first_physical_batch_only", "nan_record_full_weight",
    "noise_missing_on_a_parameter", "noise_per_accumulated_chunk",
    "noise_scaled_by_realised_batch", "noise_seed_with_a_period", "noise_seeded_when_built",
    "noise_std_sigma_squared", "norm_leaves_out_a_parameter", "per_layer_clipping",
    "small_batches_unclipped", "unclipped_bias",
]
