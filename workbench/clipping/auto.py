"""``grad_sample_mode="auto"``: einsum or book-keeping, chosen per batch from the recording.

Both modes give the same clipped sum Σ_i c_i g_i (exact, see ``engine.py``); they differ in
what they pay beyond the ordinary backward pass, per layer call of n samples:

- einsum materialises every per-sample gradient, n·P numbers for a layer with P trainable
  parameters, then reads them twice (norm, then the weighted sum);
- book-keeping (Bu et al. 2023, arXiv 2210.00038, §3) gets the norm of a layer with a cheap
  ghost norm (``norms/``: Linear's norm product or Gram route, Embedding's segment sums)
  from its activations and backprops, then one more ordinary weight gradient with c_i b_i.
  Layers without a cheap ghost norm (shared parameters, the exact fallback, the conv and
  Linear "materialise" routes, layers with no norm sampler) are materialised in both modes.

So book-keeping saves the materialisation of the cheaply normed layers and spends a second
weight gradient on them. The rule, per recorded batch:

    avoided = Σ_{cheaply normed calls} n·P        materialised = Σ_{all calls} n·P
    "bookkeeping" if avoided >= SHARE · materialised, else "einsum"

i.e. book-keeping when it avoids most of what einsum would write (SHARE = 1/2). Measured on
the zoo (``python -m workbench.bench training --models ...``, CPU): the embedding models
(whose Embedding(V, d) per-sample gradient is n·V·d numbers against n·T·d inputs) and the
large-Linear CIFAR-10 CNN go to book-keeping; the MNIST CNN (conv layers, which
materialise in both modes) and the LSTM (parameters shared over T steps) go to einsum.
``choose_mode`` returns the choice and the numbers behind it, and ``DPOptimizer.last["mode"]``
keeps it for every step.

Notation: n batch, P trainable parameters of a layer call, c clip factors, b backprops.
"""

from torch.nn.utils.parametrize import is_parametrized

from workbench.clipping.registry import NORM_ROUTES, find_norm_sampler
from workbench.per_sample.recording import own_parameters

SHARE = 0.5
MATERIALISING_ROUTES = ("materialise", "materialise (shared)", "exact fallback")


def cheaply_normed(rec, layer, call, shared: set[int]) -> bool:
    """Whether book-keeping norms this call from (a, b) without materialising it."""
    own = rec.own(layer)
    if (is_parametrized(layer) or find_norm_sampler(layer) is None
            or len(own) != len(own_parameters(layer))
            or any(id(p) in shared or id(p) in rec.fallback for _, p in own)):
        return False
    route = NORM_ROUTES.get(type(layer))
    return route is None or route(layer, call.args)[0] not in MATERIALISING_ROUTES


def choose_mode(rec) -> tuple[str, dict]:
    """("einsum" or "bookkeeping", {"avoided": ..., "materialised": ...}) for a recording."""
    shared = rec.shared_ids()
    avoided = materialised = 0
    for _, layer, call in rec.calls():
        size = rec.n * sum(p.numel() for _, p in rec.own(layer))  # n·P
        materialised += size
        if size and cheaply_normed(rec, layer, call, shared):
            avoided += size
    mode = "bookkeeping" if materialised and avoided >= SHARE * materialised else "einsum"
    return mode, {"avoided": avoided, "materialised": materialised}
