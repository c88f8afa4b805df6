"""audit_gradients: correct methods pass, deliberately wrong providers fail on the right samples."""

import matplotlib
import pytest
import torch
from torch import nn

import workbench as wb
from workbench import audit
from workbench.audit.providers import OPACUS_MODES, opacus_provider
from workbench.models import MeanOver

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LOSS = nn.CrossEntropyLoss(reduction="none")
ALL = ("einsum", "vmap", "ghost", "bookkeeping")


def digits_cnn(n=6):
    torch.manual_seed(0)
    x, y = wb.models.example_batch("digits_cnn", n, torch.Generator().manual_seed(1))
    return wb.models.make_model("digits_cnn"), x, y


def embedding_layernorm(n=5):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(20, 8), nn.LayerNorm(8), MeanOver(1), nn.Linear(8, 3))
    g = torch.Generator().manual_seed(1)
    return model, torch.randint(0, 20, (n, 7), generator=g), torch.randint(0, 3, (n,), generator=g)


def scaled(grads_fn, factor):
    def provider(model, loss_fn, inputs, targets):
        return {k: factor * g for k, g in grads_fn(model, loss_fn, inputs, targets).items()}

    return provider


def swapped(i, j):
    def provider(model, loss_fn, inputs, targets):
        grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")
        order = torch.arange(len(targets))
        order[[i, j]] = order[[j, i]]
        return {k: g[order] for k, g in grads.items()}

    return provider


@pytest.mark.parametrize("make", [digits_cnn, embedding_layernorm])
def test_correct_model_passes_for_all_methods(make):
    model, x, y = make()
    before = {k: p.detach().clone() for k, p in model.state_dict().items()}
    result = audit.audit_gradients(model, LOSS, x, y, methods=ALL)
    assert result.passed, result.table
    assert set(result.table["method"]) == set(ALL)
    assert (result.table["max_rel_error"] <= 1e-9).all()
    assert set(result.table["layer"]) >= ({"Conv2d", "Linear"} if make is digits_cnn
                                          else {"Embedding", "LayerNorm", "Linear"})
    assert "summation order" in result.table["tolerance_reason"].iloc[0]
    after = model.state_dict()  # the user's model is neither cast nor changed
    assert all(after[k].dtype == torch.float32 and torch.equal(after[k], v)
               for k, v in before.items())


def test_float32_uses_the_float32_tolerance():
    model, x, y = digits_cnn()
    result = audit.audit_gradients(model, LOSS, x, y, methods=("einsum",), dtype=torch.float32)
    assert result.passed and (result.table["tolerance"] == 1e-4).all()


def test_scaled_provider_fails_on_every_sample():
    model, x, y = digits_cnn()
    wrong = scaled(lambda *a: wb.per_sample_gradients(*a, method="vmap"), 1.01)
    result = audit.audit_gradients(model, LOSS, x, y, methods=("einsum",),
                                   providers={"scaled": wrong})
    assert not result.passed
    assert result.failed_methods() == ["scaled"]
    rows = result.table[result.table["method"] == "scaled"]
    assert rows["max_rel_error"].between(0.009, 0.011).all()
    assert (result.per_sample_errors["scaled"] > 1e-9).all()
    assert (result.per_sample_errors["einsum"] <= 1e-9).all()


def test_swapped_samples_are_flagged():
    model, x, y = embedding_layernorm(n=6)
    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={"swap": swapped(1, 4)})
    assert not result.passed
    flagged = result.per_sample_errors.index[result.per_sample_errors["swap"] > 1e-9]
    assert list(flagged) == [1, 4]


def test_ghost_is_audited_on_norms_and_clipped_sums():
    model, x, y = digits_cnn()
    result = audit.audit_gradients(model, LOSS, x, y, methods=("ghost", "bookkeeping"))
    assert result.passed
    ref_norms = wb.per_sample_grad_norms(model.double(), LOSS, x.double(), y, "microbatch")
    assert result.max_grad_norm == pytest.approx(float(ref_norms.median()))
    ghost = result.table[result.table["method"] == "ghost"]
    assert ghost["quantity"].str.startswith("clipped sum").all()
    assert (ghost["norm_rel_error"] <= 1e-9).all()
    assert result.table.loc[result.table["method"] == "bookkeeping", "norm_rel_error"].isna().all()
    assert result.per_sample_errors["bookkeeping"].isna().all()


def test_raising_provider_gives_a_failed_row_and_the_audit_continues():
    def broken(*args):
        raise RuntimeError("no sampler for Conv2d")

    model, x, y = digits_cnn()
    result = audit.audit_gradients(model, LOSS, x, y, methods=("einsum",),
                                   providers={"broken": broken})
    row = result.table[result.table["method"] == "broken"].iloc[0]
    assert not row["passed"] and "RuntimeError: no sampler for Conv2d" in row["error"]
    assert result.table.loc[result.table["method"] == "einsum", "passed"].all()


def test_wrong_keys_and_shapes_fail():
    model, x, y = digits_cnn()

    def partial(*args):
        return {"fc1.bias": torch.zeros(6, 10, dtype=torch.float64)}

    def flat(model, loss_fn, inputs, targets):
        grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="vmap")
        return {k: g.flatten(1) for k, g in grads.items()}

    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={"partial": partial, "flat": flat})
    errors = result.table.groupby("method")["error"].first()
    assert "missing parameters" in errors["partial"]
    assert "shape (6, 144), expected (6, 16, 1, 3, 3)" in errors["flat"]


def test_a_parameter_with_the_wrong_number_of_rows_fails_alone():
    """Opacus' grad_sample of wpe(arange(T)) has T rows, not n: that parameter's row says so,
    and the others are still judged (the norms over all parameters cannot be formed)."""
    model, x, y = digits_cnn()

    def rows(model, loss_fn, inputs, targets):
        grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="vmap")
        return {**grads, "fc1.bias": grads["fc1.bias"][:4]}

    table = audit.audit_gradients(model, LOSS, x, y, methods=(), providers={"rows": rows}).table
    bad = table[~table["passed"]]
    assert list(bad["parameter"]) == ["fc1.bias"] and "shape (4, 10), expected (6, 10)" in \
        bad["error"].iloc[0]
    assert table["passed"].sum() == len(table) - 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(methods=("einsum", "magic")), "magic.*valid choices"),
    (dict(reference="ghost"), "reference must be one of"),
    (dict(dtype=torch.float16), "dtype must be one of"),
])
def test_bad_choices_raise(kwargs, match):
    model, x, y = digits_cnn()
    with pytest.raises(ValueError, match=match):
        audit.audit_gradients(model, LOSS, x, y, **kwargs)


def test_torch_func_provider_passes():
    model, x, y = embedding_layernorm()
    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={"torch_func": audit.torch_func_provider})
    assert result.passed and set(result.table["method"]) == {"torch_func"}


def test_available_providers_name_missing_libraries_with_a_reason(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("opacus", "backpack") else real(name))
    found, missing = audit.available_providers()
    assert set(found) == {"torch_func"}
    assert "pip install opacus" in missing["opacus_hooks"]
    assert "backpack-for-pytorch" in missing["backpack"]
    model, x, y = digits_cnn()
    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={"opacus": opacus_provider("hooks")})
    assert "opacus is not installed" in result.table["error"].iloc[0]


def test_unknown_opacus_mode_is_rejected():
    with pytest.raises(ValueError, match="mode must be one of"):
        opacus_provider("turbo")


def test_norm_providers_are_audited_on_norms():
    model, x, y = digits_cnn()

    def norms(scale):
        def provider(m, loss_fn, inputs, targets):
            return scale * wb.per_sample_grad_norms(m, loss_fn, inputs, targets, method="ghost")
        return provider

    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={"right": norms(1.0), "wrong": norms(1.01)})
    assert list(result.table["quantity"]) == ["per-sample norms"] * 2
    assert result.failed_methods() == ["wrong"]


@pytest.mark.crosscheck
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize("mode", OPACUS_MODES)
def test_opacus_provider_passes(mode):
    pytest.importorskip("opacus", reason="Opacus not installed (pip install opacus)")
    model, x, y = embedding_layernorm()
    result = audit.audit_gradients(model, LOSS, x, y, methods=(),
                                   providers={mode: opacus_provider(mode)})
    assert result.passed, result.table


def test_plot_and_html():
    model, x, y = digits_cnn()
    result = audit.audit_gradients(model, LOSS, x, y, methods=("einsum", "ghost"),
                                   providers={"scaled": scaled(audit.torch_func_provider, 2.0)})
    fig, ax = plt.subplots()
    artists = result.plot(ax)
    assert len(artists) == 4  # three bars and the tolerance line
    assert ax.get_yscale() == "log"
    assert artists[-1].get_ydata()[0] == pytest.approx(1e-9)
    plt.close(fig)
    html = result._repr_html_()
    assert html.startswith('<p style="color:red"><b>FAILED: scaled disagree')
    assert "<table" in html and "conv1.weight" in html


def test_zero_dim_parameter_is_audited_not_failed():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.temperature = nn.Linear(4, 3), nn.Parameter(torch.tensor(1.5))

        def forward(self, x):
            return self.fc(x) / self.temperature

    torch.manual_seed(0)
    model = Scaled().double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    result = audit.audit_gradients(model, nn.CrossEntropyLoss(reduction="none"), x, y,
                             methods=("vmap", "einsum"))
    assert result.passed, result.table
    assert "temperature" in set(result.table["parameter"])


def attention_lm(n=4, T=6):
    """tiny_gpt: its attention key biases have a true gradient of exactly zero (softmax ignores a
    shift shared by all keys), so their computed gradients are rounding noise (~1e-21)."""
    torch.manual_seed(0)
    model = wb.models.tiny_gpt(vocab_size=11, block_size=T, n_layer=1, n_head=2, n_embd=8)
    g = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, 11, (n, T), generator=g) for _ in range(2))
    return model, x, y


def test_a_zero_gradient_is_judged_against_the_model_scale_not_its_rounding_noise():
    model, x, y = attention_lm()
    loss = wb.models.sequence_cross_entropy
    result = audit.audit_gradients(model, loss, x, y, methods=("einsum", "bookkeeping"))
    key_bias = result.table[result.table["parameter"].str.endswith("key.bias")]
    assert len(key_bias) and (key_bias["max_abs_error"] < 1e-15).all()
    assert result.passed, result.table[~result.table["passed"]]


def test_an_error_on_a_small_parameter_is_still_caught():
    model, x, y = attention_lm()
    loss = wb.models.sequence_cross_entropy

    def off_key_bias(model, loss_fn, inputs, targets):  # a wrong gradient where the truth is 0
        grads = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")
        scale = max(g.abs().max() for g in grads.values())
        return {k: g + (1e-6 * scale if k.endswith("key.bias") else 0) for k, g in grads.items()}

    result = audit.audit_gradients(model, loss, x, y, methods=(), providers={"off": off_key_bias})
    assert result.failed_methods() == ["off"]
    failed = result.table[~result.table["passed"]]["parameter"]
    assert failed.str.endswith("key.bias").all() and len(failed)


def test_the_suites_token_batches_repeat_and_share_tokens():
    """The CLI suite's token batches never repeated a token (10,004 words, 16 drawn), so a
    provider that writes a repeated token's row once, or gives rows several records touch the
    batch's sum (a privacy bug), passed with error 0 (probe AB, 2026-12-01)."""
    from workbench.audit.cli_suite import zoo_cases

    def shared_rows_batch_sum(model, loss_fn, x, y):
        g = wb.per_sample_gradients(model, loss_fn, x, y, method="microbatch")
        for name in g:
            if name.endswith("weight") and g[name].shape[1] > 1000:  # the embedding table
                touched = torch.stack([torch.zeros(g[name].shape[1], dtype=torch.bool)
                                       .index_fill_(0, row, True) for row in x])
                shared = touched.sum(0) > 1
                g[name][:, shared] = g[name][:, shared].sum(0)
        return g

    (name, model, x, y), = [c for c in zoo_cases(quick=True) if c[0] == "imdb_embedding"]
    assert any(len(row.unique()) < len(row) for row in x)  # a token repeated in a record
    assert len(set(x[0].tolist()) & set(x[1].tolist())) > 0  # a token two records share
    result = audit.audit_gradients(model, LOSS, x, y, methods=("einsum",),
                                   providers={"shared": shared_rows_batch_sum})
    assert result.failed_methods() == ["shared"]
