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
- ``<method>_audit`` and ``<method>_worst`` (``audit_columns``): whether each method's
  per-sample gradients (ghost and book-keeping: norms and clipped sums) are right for this
  model, by ``wb.audit.audit_gradients`` against micro-batching in float64 on a small batch,
  and the parameter with the largest relative error; ``opacus_audit`` the same for Opacus'
  hooks (failed: wte.weight off by O(1), wpe.weight with T rows).

A method that raises on this model is left out of the row and named in its ``failed``
column, never timed silently.

Notation: b batch, T sequence length, C max_grad_norm.
"""

import copy
import warnings

import torch

import workbench as wb
from workbench.bench import opacus_twin
from workbench.bench.peak_memory import peak_bytes, tensor_bytes
from workbench.bench.steps import plain_step
from workbench.bench.timing import time_interleaved
from workbench.layers import add_lora
from workbench.models import count_parameters, sequence_cross_entropy, tiny_gpt

VOCAB = 96  # workbench.lm.corpus.ALPHABET
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


AUDIT_BATCH, AUDIT_LEN = 4, 16  # n != T: a positional embedding's T rows cannot pass as n


def audit_columns(model, methods, T: int = AUDIT_LEN, seed: int = 1) -> dict:
    """``<method>_audit``: "passed" or "failed", and ``<method>_worst``: the parameter with
    the largest relative error and that error (or the error raised), for each workbench
    method and, where it is installed, Opacus' hooks (``opacus_audit``). One
    ``wb.audit.audit_gradients`` run against micro-batching, float64, on a copy of ``model``
    at n = AUDIT_BATCH and ``T`` tokens (at most the model's block size): a few seconds,
    once per model size."""
    from workbench.audit.providers import opacus_provider

    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(0, VOCAB, (AUDIT_BATCH, T), generator=gen) for _ in range(2))
    providers = {"opacus": opacus_provider("hooks")} if opacus_twin.available() else {}
    with warnings.catch_warnings():  # Opacus: "Full backward hook is firing ..." (no input grad)
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        table = wb.audit.audit_gradients(model, sequence_cross_entropy, x, y,
                                         methods=tuple(methods), providers=providers).table
    columns = {}
    for method, rows in table.groupby("method", sort=False):
        errors = rows[["max_rel_error", "norm_rel_error"]].max(axis=1, skipna=True)
        worst = rows.loc[errors.idxmax()] if errors.notna().any() else rows.iloc[0]
        if rows["passed"].all():
            columns[f"{method}_audit"] = "passed"
        else:
            columns[f"{method}_audit"] = "failed"
            failed = rows[~rows["passed"]]
            scored = errors[~rows["passed"]].dropna()
            worst = failed.loc[scored.idxmax()] if len(scored) else failed.iloc[0]
        what = f"{worst['max_rel_error']:.2g}" if worst["max_rel_error"] == worst[
            "max_rel_error"] else str(worst["error"])  # NaN: the row carries its error
        columns[f"{method}_worst"] = f"{worst['parameter'] or '-'}: {what}"
        if not rows["passed"].all():
            names = [p for p in failed["parameter"] if p]
            columns[f"{method}_worst"] += f" ({len(names)} failed: {', '.join(names)})" \
                if names else ""
    return columns


def bench_tiny_gpt(size: str = "tiny_gpt", b: int = 32, T: int = 128,
                   methods=("einsum", "ghost", "bookkeeping"), repeats: int = 3,
                   device: torch.device | str = "cpu", max_grad_norm: float = 1.0,
                   lora_rank: int = 4, audit: bool = True) -> dict:
    """One table row: ms, ratios to plain (or lora_plain) and peak MB of every candidate,
    and (``audit``) whether each method's per-sample gradients are right for the model."""
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
    if audit:
        row.update(audit_columns(model, methods, T=min(T, AUDIT_LEN)))
    return row


__all__ = [
    "SIZES", "VOCAB", "audit_columns", "bench_tiny_gpt", "check_size", "per_token_sum", "runnable",
    "step_fns",
]
