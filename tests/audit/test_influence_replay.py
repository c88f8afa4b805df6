"""The record-influence audit under randomness that removing a record does not replay
(``audit/influence_replay.py``): two Dropout layers (the second one's masks start at another
generator offset when n changes) or attention dropout. The correct engine is never called
coupled; a coupled step never passes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.audit import bug_zoo_coupling as coupling
from workbench.audit.influence import audit_record_influence
from workbench.audit.influence_replay import replays
from workbench.audit.influence_steps import engine_released_sum, naive_released_sum


class TwoDropouts(nn.Module):
    def __init__(self, mix=False):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.mix = mix

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        h = h - h.mean(0) if self.mix else h
        h = F.dropout(h, 0.2, self.training)
        return self.fc3(F.dropout(torch.tanh(self.fc2(h)), 0.2, self.training))


class AttentionDropout(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv, self.out = nn.Linear(5, 12), nn.Linear(4, 3)

    def forward(self, x):  # (n, 5) -> 2 tokens of width 4 per record
        q, k, v = self.qkv(x).view(x.shape[0], 1, 3, 4).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2 if self.training else 0.0)
        return self.out(a[:, 0])


def data():
    _, _, x, y, _ = coupling.COUPLING["class_weighted_mean"]()
    return x, y


def test_replay_is_detected_per_model():
    x, y = data()

    def step(model):
        return naive_released_sum(model, coupling.plain_cross_entropy, x, y, 0.3)

    first = list(range(coupling.N))
    assert replays(step(coupling.MixingDropout()), first, 0)  # one Dropout: a prefix
    assert not replays(step(TwoDropouts()), first, 0)  # the second starts elsewhere
    assert not replays(step(AttentionDropout()), first, 0)  # a fused kernel
    assert replays(step(coupling.COUPLING["class_weighted_mean"]()[0]), first, 0)  # no draws


@pytest.mark.parametrize("make", [TwoDropouts, AttentionDropout])
def test_the_correct_engine_is_never_called_coupled(make):
    x, y = data()
    for released in (engine_released_sum(make(), coupling.plain_cross_entropy, x, y, 0.3,
                                         "einsum"),
                     naive_released_sum(make(), coupling.plain_cross_entropy, x, y, 0.3)):
        result = audit_record_influence(released, coupling.N, max_grad_norm=0.3)
        assert not result.broken, result.summary
        assert result.table[result.table["relation"] == "substitution"]["passed"].all()


@pytest.mark.parametrize("case", ["mixing", "class_weighted_mean"])
def test_a_coupled_step_with_unreplayed_dropout_never_passes(case):
    x, y = data()
    if case == "mixing":
        model, loss = TwoDropouts(mix=True), coupling.plain_cross_entropy
    else:
        model, loss = TwoDropouts(), coupling.class_weighted_mean
    result = audit_record_influence(naive_released_sum(model, loss, x, y, 0.3), coupling.N,
                                    max_grad_norm=0.3)
    assert not result.passed and result.broken, result.summary  # the dropout-free twin
    assert "BROKEN" in result.summary


class MixingAttention(AttentionDropout):  # attention dropout, and logits centred over the batch
    def forward(self, x):
        out = super().forward(x)
        return out - out.mean(0)


@pytest.mark.parametrize("case", ["attention, centred", "two dropouts, weighted mean"])
def test_the_dropout_free_twin_finds_the_coupling_in_every_mode(case):
    x, y = data()
    model = MixingAttention() if case.startswith("attention") else TwoDropouts()
    loss = coupling.plain_cross_entropy if case.startswith("attention") \
        else coupling.class_weighted_mean
    result = audit_record_influence(naive_released_sum(model, loss, x, y, 0.3), coupling.N,
                                    max_grad_norm=0.3)
    assert result.broken, result.summary


def test_the_twin_makes_every_dropout_the_identity():
    from workbench.audit.influence_twin import NoDropout

    x = torch.randn(4, 1, 2, 4, dtype=torch.float64)
    with NoDropout():
        assert torch.equal(F.dropout(x, 0.5, True), x)
        assert torch.equal(nn.Dropout2d(0.5)(x), x)
        a = F.scaled_dot_product_attention(x, x, x, dropout_p=0.9)
    assert torch.equal(a, F.scaled_dot_product_attention(x, x, x))


def test_an_inconclusive_audit_is_reported_as_neither_passed_nor_failed():
    from workbench.audit.report import NOT_APPLICABLE, section

    x, y = data()
    result = audit_record_influence(naive_released_sum(TwoDropouts(), coupling.plain_cross_entropy,
                                                       x, y, 0.3), coupling.N, max_grad_norm=0.3)
    assert not result.passed and not result.broken
    made = section("influence", result)
    assert made.verdict == NOT_APPLICABLE and "dropout off" in made.reason
