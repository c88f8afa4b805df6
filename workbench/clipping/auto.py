"""``method="auto"``: einsum or book-keeping, chosen per batch from the recording.

Both modes give the same clipped sum Σ_i c_i g_i (exact, see ``engine.py``); they differ in
what they pay beyond the ordinary backward pass, per layer call of n samples:

- einsum materialises every per-sample gradient, n·P numbers for a layer with P trainable
  parameters, then reads them twice (norm, then the weighted sum);
- book-keeping (Bu et al. 2023, arXiv 2210.00038, §3) gets the norm of a layer with a cheap
  ghost norm (``rules/``: Linear's norm product or Gram route, Embedding's segment sums)
  from its activations and backprops, then one more ordinary weight gradient with c_i b_i.
  Layers without a cheap ghost norm (shared parameters, the exact fallback, a route whose
  ``Route.materialises`` is set, e.g. the conv and Linear "materialise", no norm rule) are
  materialised in both modes.

So book-keeping saves the materialisation of the cheaply normed layers and spends a second
weight gradient (and, in the optimizer, a re-run of the layer's forward) on them. Which costs
more is a matter of memory against arithmetic; the rule, per recorded batch, is

    avoided = Σ_{cheaply normed calls} n·P        materialised = Σ_{all calls} n·P
    "bookkeeping" if avoided >= SHARE · materialised and avoided · bytes >= BYTES,
    else "einsum"

SHARE = 1/2: book-keeping must avoid most of what einsum writes; BYTES = 32 MiB, about a
last-level CPU cache: per-sample gradients smaller than that are written and read back from
cache, faster than book-keeping's extra weight gradients (in the optimizer also a re-run of
each layer's forward, since the user's backward has freed the graph). Calibrated on the zoo's
optimizer step (``python -m workbench.bench training --models mnist_cnn cifar10_cnn
imdb_embedding imdb_lstm --modes einsum bookkeeping auto``; 2-core AMD EPYC, 32 MiB L3, a
noisy shared machine, b = 64 and 256): the MNIST CNN (6-25 MB avoided) is faster in einsum
(1.8-2.0x plain against 2.0-2.3x); the IMDb embedding model (41-164 MB; an Embedding(V, d)
has n·V·d per-sample numbers against n·T·d inputs) in book-keeping (3.7-4.4x against
6.2-8.9x); the CIFAR-10 CNN (138-553 MB) was a tie within the noise. Known miss: the IMDb
LSTM (256 MB-1 GB avoided, all in its Embedding) gets book-keeping, but einsum was 15-20%
faster in 4 of 5 measurements: its LSTM parts are materialised in both modes and book-keeping
re-runs them over T = 256 steps. Both modes are exact, so the rule only ever costs time.
``choose_mode`` returns the choice and the numbers behind it, and ``DPOptimizer.last["mode"]``
keeps it for every step.

Notation: n batch, P trainable parameters of a layer call, c clip factors, b backprops.
"""

from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping.registry import find_norm_sampler
from workbench.per_sample.recording import own_parameters
from workbench.rules._rule import norm_route

SHARE = 0.5
BYTES = 32 * 2**20


def cheaply_normed(rec, layer, call, shared: set[int]) -> bool:
    """Whether book-keeping norms this call from (a, b) without materialising it."""
    own = rec.own(layer)
    if (is_parametrized(layer) or find_norm_sampler(layer) is None
            or len(own) != len(own_parameters(layer))
            or any(id(p) in shared or id(p) in rec.fallback for _, p in own)):
        return False
    route = norm_route(layer, call.args)  # (Route, reason): the route says if it materialises
    return route is None or not route[0].materialises


def choose_mode(rec) -> tuple[str, dict]:
    """("einsum" or "bookkeeping", {"avoided": n·P, "materialised": n·P, "avoided_bytes"})
    for a recording."""
    shared = rec.shared_ids()
    avoided = materialised = 0
    for _, layer, call in rec.calls():
        size = rec.n * sum(p.numel() for _, p in rec.own(layer))  # n·P
        materialised += size
        if size and cheaply_normed(rec, layer, call, shared):
            avoided += size
    nbytes = avoided * rec.dtype.itemsize
    big = materialised and avoided >= SHARE * materialised and nbytes >= BYTES
    return ("bookkeeping" if big else "einsum"), {
        "avoided": avoided, "materialised": materialised, "avoided_bytes": nbytes}


__all__ = ["BYTES", "SHARE", "cheaply_normed", "choose_mode"]
