import pytest
import torch
from torch import nn

import workbench as wb
from tests.helpers import assert_agree


class EmbedSum(nn.Module):
    """Embedding, sum over every index position, linear head: samples stay separate."""

    def __init__(self, vocab=11, dim=4, padding_idx=None, **kw):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim, padding_idx=padding_idx, **kw)
        self.head = nn.Linear(dim, 2)

    def forward(self, x):
        e = self.emb(x)  # (n, ..., d)
        return self.head(e.reshape(e.shape[0], -1, e.shape[-1]).sum(1))


@pytest.mark.parametrize("index_shape", [(), (6,), (3, 4)], ids=["one-token", "seq", "2d"])
@pytest.mark.parametrize("padding_idx", [None, 0, 3])
def test_embedding_matches_microbatch(index_shape, padding_idx):
    torch.manual_seed(0)
    model = EmbedSum(padding_idx=padding_idx).double()
    x = torch.randint(0, 5, (7, *index_shape))  # small range: repeated indices in a sample
    y = torch.randint(0, 2, (7,))
    grads = assert_agree(model, nn.CrossEntropyLoss(reduction="none"), x, y)
    if padding_idx is not None:
        assert grads["emb.weight"][:, padding_idx].abs().max() == 0


@pytest.mark.parametrize("option", [{"sparse": True}, {"scale_grad_by_freq": True},
                                    {"max_norm": 1.0}])
def test_embedding_unsupported_options_raise(option):
    model = EmbedSum(**option)
    x, y = torch.randint(0, 11, (3, 4)), torch.randint(0, 2, (3,))
    name = next(iter(option))
    with pytest.raises(wb.UnsupportedLayerError, match=f"{name}=.*construct the Embedding"):
        wb.per_sample_gradients(model, nn.CrossEntropyLoss(reduction="none"), x, y)
