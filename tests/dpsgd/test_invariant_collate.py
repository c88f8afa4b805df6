"""The invariant "each row of the batch the model sees depends on its own record alone" where
the engine's loader builds the rows: its ``collate_fn`` (``dpsgd/collate_check.py``).

A collate_fn that mixes records (mixup in the collate: row i = .6 x_i + .4 x_{i+1}) is
refused at the batch's hand-out; a collate_fn padding each batch to its longest record
(``pad_sequence``) with a model or loss reading the pads (a mean over the padded length, a
bidirectional LSTM without packing, a loss on pad tokens without ``ignore_index``, GPT-2 left
padded without position ids) is refused at the first self-check of the batch's layout: each
passed silently until 2026-12-01 (one record's influence 1.33-2.19 C). The correct variants
stay exact: the released clipped sum (σ = 0, ``loss_reduction="sum"``) equals a float64
reference that clips each record's gradient computed from the record collated ALONE,
``collate_fn([dataset[j]])``: a masked mean, a packed LSTM, per-token losses with
``ignore_index``, a random augmentation in the collate (not checkable: skipped), batches of
one, the default collate, and tiny Hugging Face BERT and GPT-2 (random weights, attention
mask, right padding, labels -100)."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence
from torch.utils.data import DataLoader, Dataset, TensorDataset

import workbench as wb
from workbench.errors import SampleMixingError

V, N, K, C = 12, 40, 3, 0.5


def _records():
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(2, 5, (N,), generator=g)
    lens[::5] = 9  # every fifth record long: most batches padded far
    seqs = [torch.randint(1, V, (int(t),), generator=g) for t in lens]
    return seqs, torch.randint(0, K, (N,), generator=g)


SEQS, LABELS = _records()


class Tokens(Dataset):
    def __len__(self):
        return N

    def __getitem__(self, j):
        return SEQS[j], LABELS[j], torch.tensor(j)


def pad_collate(items):  # right padding with 0 to the batch's longest record (tokens >= 1)
    return (pad_sequence([a for a, _, _ in items], batch_first=True, padding_value=0),
            torch.stack([b for _, b, _ in items]), torch.stack([j for _, _, j in items]))


class Pooled(nn.Module):
    """Embedding, a mean over positions, a linear head; ``masked``: over the real tokens."""

    def __init__(self, masked):
        super().__init__()
        torch.manual_seed(0)
        self.masked = masked
        self.emb, self.fc = nn.Embedding(V, 5), nn.Linear(5, K)

    def forward(self, t):
        h = self.emb(t)
        if not self.masked:
            return self.fc(torch.tanh(h.mean(1)))
        m = (t != 0).unsqueeze(-1).to(h.dtype)
        return self.fc(torch.tanh((h * m).sum(1) / m.sum(1)))


class BiLSTM(nn.Module):
    def __init__(self, packed):
        super().__init__()
        torch.manual_seed(0)
        self.packed = packed
        self.emb = nn.Embedding(V, 5)
        self.rnn = nn.LSTM(5, 4, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(8, K)

    def forward(self, t):
        h = self.emb(t)
        if self.packed:
            h = pack_padded_sequence(h, (t != 0).sum(1).cpu(), batch_first=True,
                                     enforce_sorted=False)
        _, (hn, _) = self.rnn(h)
        return self.fc(torch.cat([hn[0], hn[1]], 1))


class Tagger(nn.Module):
    """Per-token logits (n, T, V): each position from its own token."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(V, 6), nn.Linear(6, V)

    def forward(self, t):
        return self.fc(torch.tanh(self.emb(t)))


def classify(model, x, y):
    return F.cross_entropy(model(x), y, reduction="sum")


def tokens_on_pads(model, x, y):  # a loss over every position, pads included
    return F.cross_entropy(model(x).transpose(1, 2), x, reduction="sum")


def tokens_ignored(model, x, y):  # pads labelled -100 and ignored
    return F.cross_entropy(model(x).transpose(1, 2), x.masked_fill(x == 0, -100),
                           ignore_index=-100, reduction="sum")


def reference(model, loss, collate, dataset, ids):
    """Σ_j clip_C(∇ℓ_j), ℓ_j from record j collated ALONE, in float64."""
    params = list(model.parameters())
    total = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
    for j in ids.tolist():
        x, y = collate([dataset[j]])[:2]
        g = torch.cat([t.flatten() for t in torch.autograd.grad(loss(model, x, y), params)])
        total += g * min(1.0, C / float(g.norm()))
    return total


def loop(make, loss, collate=pad_collate, dataset=None, steps=4, batch_size=8, workers=0,
         **options):
    """``steps`` steps of the engine's loop; per step the released clipped sum (σ = 0,
    lr = 0, loss_reduction="sum": ``.grad`` times B) and the reference."""
    dataset = Tokens() if dataset is None else dataset
    model = make().double()
    engine = wb.PrivacyEngine()
    model, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
        data_loader=DataLoader(dataset, batch_size=batch_size, collate_fn=collate,
                               num_workers=workers),
        noise_multiplier=0.0, max_grad_norm=C, loss_reduction="sum",
        sampling_generator=torch.Generator().manual_seed(1), **options)
    out = []
    for step, (x, y, ids) in enumerate(loader):
        if step == steps:
            break
        opt.zero_grad()
        loss(model, x, y).backward()
        opt.step()
        got = torch.cat([p.grad.flatten() for p in model.parameters()]) * batch_size
        shape = (x["input_ids"] if isinstance(x, dict) else x).shape
        out.append((got, reference(make().double(), loss, collate, dataset, ids), shape))
    return out


def assert_exact(out):
    assert any(len(shape) > 1 and shape[0] > 1 for _, _, shape in out)
    for got, want, _ in out:
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12), float((got - want).norm())


# refused ------------------------------------------------------------------------------------

@pytest.mark.parametrize("options", [{}, {"workers": 2},
                                     {"privacy_unit": "user", "user_ids": torch.arange(N) // 2}],
                         ids=["in-process", "two-workers", "user-level"])
def test_mixing_collate_refused_at_hand_out(options):
    def mix_collate(items):  # mixup inside the collate_fn: row i = .6 x_i + .4 x_{i+1}
        x = torch.stack([a for a, _, _ in items])
        return (0.6 * x + 0.4 * x.roll(1, 0), torch.stack([b for _, b, _ in items]),
                torch.stack([j for _, _, j in items]))

    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(N, 6, dtype=torch.float64, generator=g), LABELS
    data = TensorDataset(xs, ys, torch.arange(N))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, K))

    with pytest.raises(SampleMixingError, match=r"collate_fn 'test_mixing_collate_refused_at_"
                                                r"hand_out.<locals>.mix_collate' combines "
                                                r"records: leaf batch\[0\] of row \d+ "
                                                r"\(dataset record \d+\)(.|\n)*__getitem__"):
        loop(make, classify, collate=mix_collate, dataset=data, **options)


@pytest.mark.parametrize("make, loss", [
    (lambda: Pooled(masked=False), classify),
    (lambda: wb.fix_model(BiLSTM(packed=False)), classify),
    (Tagger, tokens_on_pads),
], ids=["mean-over-pads", "bilstm-unpacked", "loss-on-pad-tokens"])
def test_reading_the_pads_refused(make, loss):
    with pytest.raises(SampleMixingError, match=r"depends on how far its batch was padded"
                                                r"(.|\n)*right padding(.|\n)*ignore_index"):
        loop(make, loss)


# exact ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("make, loss", [
    (lambda: Pooled(masked=True), classify),
    (lambda: wb.fix_model(BiLSTM(packed=True)), classify),
    (Tagger, tokens_ignored),
], ids=["masked-mean", "bilstm-packed", "ignore-index"])
def test_masked_padding_exact(make, loss):
    assert_exact(loop(make, loss))


def test_padded_batches_from_two_workers_checked():  # the indices matched in order
    assert_exact(loop(lambda: Pooled(masked=True), classify, workers=2, steps=3))
    with pytest.raises(SampleMixingError, match=r"depends on how far its batch was padded"):
        loop(lambda: Pooled(masked=False), classify, workers=2, steps=3)


def test_a_collate_sorting_by_length_exact():  # rows reordered, none mixed
    def sorted_collate(items):
        return pad_collate(sorted(items, key=lambda item: -len(item[0])))

    assert_exact(loop(lambda: Pooled(masked=True), classify, collate=sorted_collate))


def test_default_collate_and_batches_of_one_exact():
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 6, dtype=torch.float64, generator=g), LABELS,
                         torch.arange(N))

    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, K))

    assert_exact(loop(make, classify, collate=torch.utils.data.default_collate, dataset=data))
    sizes = []
    for got, want, shape in loop(lambda: Pooled(masked=True), classify, batch_size=1, steps=8):
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
        sizes.append(shape[0])
    assert 1 in sizes


def test_a_batch_of_one_is_its_record_alone():  # nothing to compare, nothing planned
    from workbench.dpsgd.collate_check import CollateCheck
    check = CollateCheck(Tokens(), pad_collate)
    check.handed(pad_collate([Tokens()[0]]), [0])
    assert not check.plans and not check.seen


def test_random_augmentation_in_collate_not_refused():
    def noisy_collate(items):  # a random token dropped per record: not checkable, skipped
        x, y, j = pad_collate(items)
        keep = torch.rand(x.shape) > 0.1
        return x * keep, y, j

    loop(lambda: Pooled(masked=False), classify, collate=noisy_collate)


# Hugging Face ------------------------------------------------------------------------------

def _transformers():
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed: pip install '.[realmodels]'")
    from workbench.realzoo.imports import import_transformers
    return import_transformers()


def hf_collate(side="right"):
    def collate(items):
        T = max(len(a) for a, _, _ in items)
        ids, mask = [], []
        for a, _, _ in items:
            pad = torch.zeros(T - len(a), dtype=a.dtype)
            one, zero = torch.ones(len(a), dtype=torch.long), torch.zeros(T - len(a),
                                                                         dtype=torch.long)
            ids.append(torch.cat([a, pad] if side == "right" else [pad, a]))
            mask.append(torch.cat([one, zero] if side == "right" else [zero, one]))
        ids, mask = torch.stack(ids), torch.stack(mask)
        return ({"input_ids": ids, "attention_mask": mask},
                torch.stack([b for _, b, _ in items]), torch.stack([j for _, _, j in items]))
    return collate


def bert():
    t = _transformers()
    torch.manual_seed(0)
    return t.BertForSequenceClassification(t.BertConfig(
        vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=16, num_labels=K,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def gpt2():
    t = _transformers()
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2,
                                          n_positions=16, bos_token_id=1, eos_token_id=1,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert_loss(model, x, y):
    return F.cross_entropy(model(**x).logits, y, reduction="sum")


def gpt2_loss(model, x, y):
    logits = model(**x).logits[:, :-1]
    labels = x["input_ids"].masked_fill(x["attention_mask"] == 0, -100)[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")


@pytest.mark.realmodels
@pytest.mark.parametrize("make, loss", [(bert, bert_loss), (gpt2, gpt2_loss)],
                         ids=["bert", "gpt2"])
def test_hugging_face_right_padding_with_mask_exact(make, loss):
    torch.manual_seed(0)
    assert_exact(loop(make, loss, collate=hf_collate(), steps=3))


@pytest.mark.realmodels
def test_hugging_face_with_dropout_not_refused():  # the probe runs both passes without it
    t = _transformers()

    def make():
        torch.manual_seed(0)
        return t.BertForSequenceClassification(t.BertConfig(
            vocab_size=V, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=16, num_labels=K))

    loop(make, bert_loss, collate=hf_collate(), steps=3)


@pytest.mark.realmodels
def test_gpt2_left_padding_without_position_ids_refused():
    torch.manual_seed(0)
    with pytest.raises(SampleMixingError, match=r"left padding"):
        loop(gpt2, gpt2_loss, collate=hf_collate("left"), steps=3)
