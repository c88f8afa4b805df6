"""Time and peak memory of one DP step of tiny_gpt: full fine-tuning and LoRA, every method.

The ``tiny_gpt`` rows of ``python -m workbench.bench e2e`` and notebook 08. The question is
the one of the ghost-clipping seeds (Li et al. 2022, arXiv 2110.05679, §4; Bu et al. 2023,
arXiv 2210.00038, book-keeping): how close does DP clipping get to a non-private step on a
transformer? At batch b and length T, one row measures side by side (interleaved medians,
``bench.timing``; peak allocated bytes, ``bench.peak_memory.peak_bytes``):

- ``plain``: forward + backward of the mean loss, all parameters;
- each ``method`` of ``wb.clipped_grad_sum`` on all parameters;
- ``lora_plain`` and ``lora_<method>``: the same with LoRA adapters (rank 4) on the attention
  and MLP projections, only the adapters trainable. ``lora_<method>/lora_plain`` is the
  issue's LoRA ratio.

- ``opacus`` (where it is installed): Opacus' ``GradSampleModule`` forward + backward
  (``bench.opacus_twin``), per-sample gradients without clipping. It runs on tiny_gpt but its
  per-sample gradients are wrong for this model (opacus 1.6, checked against micro-batching in
  float64): its hooks never see the tied head ``F.linear(h, E)``, so E's misses the head's
  part (relative error 0.79 on a 1-layer model), and ``wpe(arange(T))``'s ``grad_sample`` has
  T rows, not n. Its time is a lower bound for what a correct hook engine could cost.

A method that raises on this model is left out of the row and named in its ``failed``
column, never timed silently.

Notation: b batch, T sequence length, C max_grad_norm.
"""

import copy

import torch

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.steps import plain_step
from workbench.bench.timing import time_interleaved
from workbench.layers import add_lora
from workbench.models import count_parameters, sequence_cross_entropy, tiny_gpt

VOCAB = 96  # workbench.corpus.ALPHABET
SIZES = {  # name -> tiny_gpt shape; parameters at V = 96, T = 128
    "tiny_gpt": dict(n_layer=2, n_head=4, n_embd=64),  # 114,432
    "tiny_gpt_10x": dict(n_layer=6, n_head=4, n_embd=128),  # 1,218,560 (10.6x)
}


def per_token_sum(logits, y):
    """(n,): sequence_cross_entropy summed over tokens, Opacus' loss_reduction="sum"."""
    return sequence_cross_entropy(logits, y, reduction="sum")


def check_size(size: str) -> dict:
    if size not in SIZES:
        raise KeyError(f"size={size!r} is not a tiny_gpt bench size; choose one of "
                       f"{sorted(SIZES)}")
    return SIZES[size]


def step_fns(model, x, y, methods, max_grad_norm, prefix=""):
    """{name: callable} for the plain step and each clipped-sum method on ``model``."""
    fns = {f"{prefix}plain": lambda: plain_step(model, x, y, sequence_cross_entropy, torch.mean)}
    for method in methods:
        fns[f"{prefix}{method}"] = (lambda m=method: wb.clipped_grad_sum(
            model, sequence_cross_entropy, x, y, max_grad_norm=max_grad_norm, method=m))
    return fns


def runnable(fns: dict) -> tuple[dict, list[str]]:
    """Split candidates into those that run once without error and the names that raise."""
    ok, failed = {}, []
    for name, fn in fns.items():
        try:
            fn()
            ok[name] = fn
        except Exception as err:  # recorded in the row, not hidden
            failed.append(f"{name}: {type(err).__name__}")
    return ok, failed


def bench_tiny_gpt(size: str = "tiny_gpt", b: int = 32, T: int = 128,
                   methods=("einsum", "ghost", "bookkeeping"), repeats: int = 3,
                   device: torch.device | str = "cpu", max_grad_norm: float = 1.0,
                   lora_rank: int = 4) -> dict:
    """One table row: ms, ratios to plain (or lora_plain) and peak MB of every candidate."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    model = tiny_gpt(VOCAB, block_size=T, generator=gen, **check_size(size)).to(device)
    lora = add_lora(copy.deepcopy(model), r=lora_rank, generator=gen)
    x = torch.randint(0, VOCAB, (b, T), generator=gen).to(device)  # (b, T)
    y = torch.randint(0, VOCAB, (b, T), generator=gen).to(device)  # (b, T)
    fns = {**step_fns(model, x, y, methods, max_grad_norm),
           **step_fns(lora, x, y, methods, max_grad_norm, prefix="lora_")}
    if opacus_twin.available():  # GradSampleModule forward + backward, where it runs
        fns["opacus"] = opacus_twin.gsm_step(copy.deepcopy(model), per_token_sum, x, y)
    fns, failed = runnable(fns)
    times = time_interleaved(fns, device, repeats=repeats)
    row = {"model": size, "batch_size": b, "seq_len": T, "params": count_parameters(model),
           "lora_params": count_parameters(lora)}
    resident = {"plain": tensor_bytes(model, x, y), "lora_plain": tensor_bytes(lora, x, y)}
    for name, t in times.items():
        base = "lora_plain" if name.startswith("lora_") else "plain"
        row[f"{name}_ms"] = t * 1e3
        row[f"{name}_peak_MB"] = peak_bytes(fns[name], device, resident[base]) / 2**20
        if name != base and base in times:
            row[f"{name}/{base}"] = t / times[base]
    for name in times:
        base = "lora_plain" if name.startswith("lora_") else "plain"
        if name != base and base in times:
            row[f"{name}_mem/{base}"] = row[f"{name}_peak_MB"] / row[f"{base}_peak_MB"]
    row["failed"] = "; ".join(failed)
    return row
