import pytest
import torch
from torch import nn

import workbench as wb


def test_validate_lists_every_problem_with_paths():
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8),
        nn.Sequential(nn.InstanceNorm2d(8, affine=True, track_running_stats=True)),
        nn.Flatten(), nn.Bilinear(2, 2, 2),
    )
    problems = wb.validate_model(model)
    assert [(p.path, p.layer, p.blocking) for p in problems] == [
        ("1", "BatchNorm2d", True), ("2.0", "InstanceNorm2d", True), ("4", "Bilinear", False)]
    assert "wb.fix_model" in str(problems[0])
    assert wb.validate_model(nn.Linear(2, 2)) == []


def test_fix_model_replaces_mixing_layers_and_keeps_original():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 48, 3), nn.BatchNorm2d(48),
                          nn.InstanceNorm2d(48, affine=True, track_running_stats=True))
    with torch.no_grad():
        model[1].weight.uniform_()
    fixed = wb.fix_model(model)
    assert isinstance(model[1], nn.BatchNorm2d)  # the original is untouched
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_groups == 16  # gcd(32, 48)
    assert torch.equal(fixed[1].weight, model[1].weight)
    assert not fixed[2].track_running_stats
    assert wb.validate_model(fixed) == []
    x = torch.randn(3, 1, 6, 6)
    grads = wb.per_sample_gradients(fixed, lambda o, t: o.flatten(1).sum(1), x, None)
    assert grads["1.weight"].shape == (3, 48)


def test_fix_model_on_a_bare_batchnorm():
    fixed = wb.fix_model(nn.BatchNorm1d(6))
    assert isinstance(fixed, nn.GroupNorm) and fixed.num_groups == 2


# --- fused RNN and attention layers (wb.layers) ----------------------------------------------

class Tagger(nn.Module):
    """Embedding -> bidirectional LSTM -> self-attention -> Linear, all torch.nn."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 6)
        self.rnn = nn.LSTM(6, 4, num_layers=2, bidirectional=True, batch_first=True)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
        self.out = nn.Linear(8, 3)

    def forward(self, tokens):
        h, _ = self.rnn(self.emb(tokens))
        return self.out(self.attn(h, h, h, need_weights=False)[0]).mean(1)


def test_validate_lists_fused_rnn_and_attention_layers_once():
    model = nn.Sequential(nn.RNN(3, 4), nn.GRU(4, 4), Tagger())
    problems = wb.validate_model(model)
    assert [(p.path, p.layer, p.blocking) for p in problems] == [
        ("0", "RNN", True), ("1", "GRU", True), ("2.rnn", "LSTM", True),
        ("2.attn", "MultiheadAttention", True)]  # not attn.out_proj: replaced with it
    assert "wb.fix_model" in str(problems[2]) and "wb.layers.DPLSTM" in str(problems[2])
    assert "proj_size=2" in str(wb.validate_model(nn.LSTM(3, 4, proj_size=2))[0])
    frozen = nn.LSTM(3, 4).requires_grad_(False)  # nothing to differentiate: no problem
    assert wb.validate_model(frozen) == []


def test_fix_model_swaps_in_the_dp_layers_with_the_same_outputs():
    torch.manual_seed(0)
    model = Tagger().double()
    fixed = wb.fix_model(model)
    assert type(model.rnn) is nn.LSTM  # the original is untouched
    assert type(fixed.rnn) is wb.layers.DPLSTM
    assert type(fixed.attn) is wb.layers.DPMultiheadAttention
    assert wb.validate_model(fixed) == []
    assert list(fixed.state_dict()) == list(model.state_dict())
    tokens = torch.randint(0, 20, (3, 5))
    assert torch.allclose(fixed(tokens), model(tokens), rtol=0, atol=1e-12)
    grads = wb.per_sample_gradients(fixed, lambda o, t: o.sum(1), tokens, None, strict=True)
    assert grads["rnn.weight_hh_l1_reverse"].shape == (3, 16, 4)


def test_fix_model_on_bare_fused_layers():
    assert type(wb.fix_model(nn.GRU(2, 3))) is wb.layers.DPGRU
    attn = wb.fix_model(nn.MultiheadAttention(4, 2, kdim=3, vdim=5))
    assert type(attn) is wb.layers.DPMultiheadAttention and attn.k_proj_weight.shape == (4, 3)
    with pytest.raises(wb.UnsupportedLayerError, match="proj_size"):
        wb.fix_model(nn.LSTM(3, 4, proj_size=2))


def test_validate_notes_eval_mode_and_inplace_activations():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).eval()
    notes = wb.validate_model(model)
    assert [(p.path, p.layer, p.blocking) for p in notes] == [
        ("", "Sequential", False), ("1", "ReLU", False)]
    assert "model.train()" in str(notes[0]) and "inplace=False" in str(notes[1])
    assert wb.validate_model(model.train().append(nn.ReLU())) == [notes[1]]


def test_fix_model_num_groups():
    fixed = wb.fix_model(nn.Sequential(nn.BatchNorm2d(48)), num_groups=4)
    assert fixed[0].num_groups == 4
    import pytest

    with pytest.raises(ValueError, match="num_groups=5 does not divide the 48 channels"):
        wb.fix_model(nn.Sequential(nn.BatchNorm2d(48)), num_groups=5)


def test_fix_model_keeps_dtype_device_mode_and_frozen_parameters():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, track_running_stats=False),
                          nn.LSTM(4, 3)).double()  # (no running statistics: batch ones in eval)
    model[1].requires_grad_(False)
    model[2].weight_hh_l0.requires_grad_(False)
    model.eval()
    fixed = wb.fix_model(model)
    assert isinstance(fixed[1], nn.GroupNorm) and not fixed[1].training
    assert all(p.dtype == torch.float64 for p in fixed.parameters())
    assert not any(p.requires_grad for p in fixed[1].parameters())  # frozen stays frozen
    frozen = {name for name, p in fixed[2].named_parameters() if not p.requires_grad}
    original = {name for name, p in model[2].named_parameters() if not p.requires_grad}
    assert frozen == original == {"weight_hh_l0"}  # the DP layer keeps torch.nn's names


def test_fix_model_replaces_a_layer_at_every_path_that_reaches_it():
    """An alias attribute and a BatchNorm shared by two blocks: only the first path was
    replaced until 2026-11-29, and the forward still ran the BatchNorm through the other."""
    class Aliased(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
            self.norm = self.body[1]
            shared = nn.BatchNorm1d(8)
            self.a = nn.Sequential(nn.Linear(8, 8), shared)
            self.b = nn.Sequential(nn.Linear(8, 8), shared)

        def forward(self, x):
            return self.b(self.a(self.norm(self.body[0](x))))

    fixed = wb.fix_model(Aliased())
    assert fixed.norm is fixed.body[1] and isinstance(fixed.norm, nn.GroupNorm)
    assert fixed.a[1] is fixed.b[1] and isinstance(fixed.a[1], nn.GroupNorm)
    assert wb.validate_model(fixed) == []
    assert not any(isinstance(m, nn.BatchNorm1d) for m in fixed.modules())


class ScaledBatchNorm(nn.BatchNorm1d):  # a forward of its own: more than a batch norm
    def forward(self, x):
        return 2.0 * super().forward(x)


class BatchNormThenAct(nn.BatchNorm1d):  # submodules of its own
    def __init__(self, c):
        super().__init__(c)
        self.act = nn.ReLU()


@pytest.mark.parametrize("cls", [ScaledBatchNorm, BatchNormThenAct])
def test_fix_model_refuses_a_batch_norm_that_computes_more(cls):
    """A GroupNorm in its place would drop what the subclass adds: timm's BatchNormAct2d lost
    its activation in 27 of RegNetX-002's 44 norms, silently, until 2026-11-30."""
    model = nn.Sequential(nn.Linear(4, 8), cls(8))
    with pytest.raises(wb.UnsupportedLayerError, match="^1: .*computes more than"):
        wb.fix_model(model)


@pytest.mark.realmodels
@pytest.mark.parametrize("act", ["relu", "silu", None])
@pytest.mark.parametrize("cls", ["BatchNormAct2d", "SyncBatchNormAct"])
def test_fix_model_keeps_timms_norm_activation(act, cls):
    """timm's BatchNormAct2d is its batch norm, then drop, then act: a GroupNorm followed by
    them, the same function as timm's GroupNormAct built from the same numbers."""
    from workbench.realzoo.imports import import_timm

    try:
        norm_act = import_timm().layers.norm_act
    except ImportError as err:
        pytest.skip(f"timm is not installed: {err}")
    torch.manual_seed(0)
    bn = norm_act.BatchNormAct2d(16, act_layer=act, apply_act=act is not None)
    with torch.no_grad():
        bn.weight.normal_()
        bn.bias.normal_()
    model = nn.Sequential(nn.Conv2d(3, 16, 3), bn)
    if cls == "SyncBatchNormAct":  # as DDP training converts it
        model = norm_act.convert_sync_batchnorm(model)
    assert type(model[1]).__name__ == cls
    fixed = wb.fix_model(model)
    gn = norm_act.GroupNormAct(16, 16, act_layer=act, apply_act=act is not None)
    gn.load_state_dict({"weight": bn.weight.detach(), "bias": bn.bias.detach()})
    x = torch.randn(2, 3, 8, 8)
    h = fixed[0](x)
    assert torch.allclose(fixed[1](h), gn(h), atol=1e-6)
    assert not any(p.blocking for p in wb.validate_model(fixed))  # (timm's ReLU is in place)
    assert {name for name, _ in fixed.named_parameters()} == {
        "0.weight", "0.bias", "1.weight", "1.bias"}  # the names a state dict holds
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64)
    model = fixed.double()
    wb.clipped_grad_sum(model, lambda o, t: o.pow(2).flatten(1).sum(1), x, None, 1.0)  # a rule


def test_fix_model_keeps_a_batchnorm_whose_statistics_are_frozen():
    """Eval mode with running statistics: a per-channel affine map, mixing nothing; replaced
    by a GroupNorm until 2026-11-30, the pre-trained statistics lost (outputs 0.96 off)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    with torch.no_grad():
        model[1].running_mean.normal_()
    model.eval()
    fixed = wb.fix_model(model)
    assert isinstance(fixed[1], nn.BatchNorm1d)
    x = torch.randn(3, 4)
    assert torch.equal(fixed(x), model(x))
    assert not any(p.blocking for p in wb.validate_model(model))
    note = next(p for p in wb.validate_model(model) if "eval mode" in p.message)
    assert ".eval() on each BatchNorm" in note.message
    model.train()
    assert isinstance(wb.fix_model(model)[1], nn.GroupNorm)  # training mode: replaced
