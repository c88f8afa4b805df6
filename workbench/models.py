"""The benchmark model zoo: the Fast-DPSGD models of Opacus' Table 1, and two digits models.

Sources: A. Yousefpour et al. (2021), "Opacus: User-Friendly Differential Privacy Library in
PyTorch", arXiv 2109.12298, Section 3.1 and Table 1 (end-to-end runtimes on MNIST, CIFAR-10
and IMDb); they run the models of P. Subramani, N. Vadivelu and G. Kamath (2021), "Enabling
Fast Differentially Private SGD via Just-in-Time Compilation and Vectorization",
arXiv 2010.09063 (the Fast-DPSGD benchmarks), whose PyTorch definitions these rebuild layer
for layer, with the same parameter counts:

    model            input                  classes  parameters
    mnist_cnn        float (n, 1, 28, 28)   10           26,010
    cifar10_cnn      float (n, 3, 32, 32)   10          605,226
    imdb_embedding   int64 (n, T), T = 256   2          160,098
    imdb_lstm        int64 (n, T), T = 256   2        1,081,402   (paper: 1,081,002; see below)
    digits_cnn       float (n, 1, 8, 8)     10            9,930
    digits_mlp       float (n, 1, 8, 8)     10            9,610

Only ordinary torch.nn layers, plus ``MeanOver`` for "average over tokens / pixels",
``RNNOutput`` (keep an RNN's output sequence) and ``wb.layers.DPLSTM`` (an LSTM whose
per-sample gradients hooks can see); no BatchNorm (it mixes samples) and no in-place
activations (they break backward hooks).
Layers are named (``conv1``, ``fc1``, ...) so per-sample gradient keys read like the table.

``ZOO`` maps each name to its factory, example input and parameter count; ``example_batch``
draws a random (inputs, targets) batch for tests and benchmarks.

Language models live in ``lm/gpt.py`` and are re-exported here: ``tiny_gpt`` (a
nanoGPT-style transformer with a tied head), ``sequence_cross_entropy`` (its per-sequence
loss) and ``generate``.
"""

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from workbench.layers import DPLSTM
from workbench.lm.gpt import TinyGPT, generate, sequence_cross_entropy, tiny_gpt  # noqa: F401

IMDB_VOCAB = 10_000 + 4  # 10,000 most frequent words + <unk>, <pad>, <eos>, <sos> (Fast-DPSGD)
IMDB_SEQ_LEN = 256  # Fast-DPSGD's max_len


class MeanOver(nn.Module):
    """Average over the given dims: tokens (dim 1) or pixels (dims (2, 3)). No parameters."""

    def __init__(self, dim: int | tuple[int, ...]):
        super().__init__()
        self.dim = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=self.dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class RNNOutput(nn.Module):
    """Keep the output sequence of a recurrent layer's ``(output, state)`` pair."""

    def forward(self, pair: tuple) -> torch.Tensor:
        return pair[0]


class SelfAttention(nn.Module):
    """x -> ``attention(x, x, x)``'s output: an attention layer as a one-input module.

    ``key_padding_mask`` (n, S), when given, is passed on, so a model can take it as a
    second input and per-sample methods slice it with the batch.
    """

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor, key_padding_mask: torch.Tensor | None = None):
        return self.attention(x, x, x, key_padding_mask=key_padding_mask,
                              need_weights=False)[0]


def count_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    """Number of scalar parameters (only those with requires_grad unless trainable_only=False).

    >>> count_parameters(mnist_cnn())
    26010
    """
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def mnist_cnn(activation: type[nn.Module] = nn.ReLU) -> nn.Sequential:
    """Fast-DPSGD's MNIST CNN: input float (n, 1, 28, 28), output (n, 10); 26,010 parameters.

    Fast-DPSGD (and so Opacus' Table 1) uses ReLU; ``activation=nn.Tanh`` gives the tempered
    sigmoid variant of Papernot et al. (2021, arXiv 2007.14191), which trains better under DP
    with the same parameters.
    """
    layers = OrderedDict(
        conv1=nn.Conv2d(1, 16, 8, stride=2, padding=3),  # (n, 16, 14, 14)
        act1=activation(),
        pool1=nn.MaxPool2d(2, stride=1),  # (n, 16, 13, 13)
        conv2=nn.Conv2d(16, 32, 4, stride=2),  # (n, 32, 5, 5)
        act2=activation(),
        pool2=nn.MaxPool2d(2, stride=1),  # (n, 32, 4, 4)
        flatten=nn.Flatten(),  # (n, 512)
        fc1=nn.Linear(32 * 4 * 4, 32),  # (n, 32)
        act3=activation(),
        fc2=nn.Linear(32, 10),  # (n, 10)
    )
    return nn.Sequential(layers)


def cifar10_cnn() -> nn.Sequential:
    """Fast-DPSGD's CIFAR-10 CNN: input float (n, 3, 32, 32), output (n, 10); 605,226 parameters.

    Eight 3x3 convolutions that keep height and width (32, 32 | 64, 64 | 128, 128 | 256, 10
    channels), ReLU after all but the last, 2x2 average pooling between the groups; the last
    convolution's 10 maps are averaged over pixels.
    """
    layers = OrderedDict(
        conv1=nn.Conv2d(3, 32, 3, padding=1),  # (n, 32, 32, 32)
        act1=nn.ReLU(),
        conv2=nn.Conv2d(32, 32, 3, padding=1),  # (n, 32, 32, 32)
        act2=nn.ReLU(),
        pool1=nn.AvgPool2d(2, stride=2),  # (n, 32, 16, 16)
        conv3=nn.Conv2d(32, 64, 3, padding=1),  # (n, 64, 16, 16)
        act3=nn.ReLU(),
        conv4=nn.Conv2d(64, 64, 3, padding=1),  # (n, 64, 16, 16)
        act4=nn.ReLU(),
        pool2=nn.AvgPool2d(2, stride=2),  # (n, 64, 8, 8)
        conv5=nn.Conv2d(64, 128, 3, padding=1),  # (n, 128, 8, 8)
        act5=nn.ReLU(),
        conv6=nn.Conv2d(128, 128, 3, padding=1),  # (n, 128, 8, 8)
        act6=nn.ReLU(),
        pool3=nn.AvgPool2d(2, stride=2),  # (n, 128, 4, 4)
        conv7=nn.Conv2d(128, 256, 3, padding=1),  # (n, 256, 4, 4)
        act7=nn.ReLU(),
        conv8=nn.Conv2d(256, 10, 3, padding=1),  # (n, 10, 4, 4)
        mean=MeanOver((2, 3)),  # (n, 10)
    )
    return nn.Sequential(layers)


def imdb_embedding() -> nn.Sequential:
    """Fast-DPSGD's IMDb embedding model: input int64 (n, T), output (n, 2); 160,098 parameters.

    Token ids in [0, 10004) are embedded in 16 dimensions, averaged over the T tokens and
    classified by one linear layer (positive / negative review).
    """
    layers = OrderedDict(
        emb=nn.Embedding(IMDB_VOCAB, 16),  # (n, T, 16)
        mean=MeanOver(1),  # (n, 16)
        fc1=nn.Linear(16, 2),  # (n, 2)
    )
    return nn.Sequential(layers)


def imdb_lstm() -> nn.Sequential:
    """Fast-DPSGD's IMDb LSTM: input int64 (n, T), output (n, 2); 1,081,402 parameters.

    Tokens are embedded in 100 dimensions, run through one LSTM layer with 100 hidden units,
    whose outputs are averaged over the T steps and classified by one linear layer.

    The count is 400 more than the 1,081,002 of Opacus' Table 1 (Yousefpour et al. 2021,
    arXiv 2109.12298): PyTorch's LSTM keeps two bias vectors per layer, b_ih and b_hh
    (4 x 100 each; the second exists for cuDNN compatibility), where Keras and Haiku keep
    one. Both biases are added to the same pre-activations, so the models compute the same
    functions. The LSTM is ``wb.layers.DPLSTM`` (same parameters as ``nn.LSTM``) so that
    the einsum method sees its matrix products.
    """
    layers = OrderedDict(
        emb=nn.Embedding(IMDB_VOCAB, 100),  # (n, T, 100)
        lstm=DPLSTM(100, 100, batch_first=True),  # ((n, T, 100), state)
        output=RNNOutput(),  # (n, T, 100)
        mean=MeanOver(1),  # (n, 100)
        fc1=nn.Linear(100, 2),  # (n, 2)
    )
    return nn.Sequential(layers)


def digits_cnn() -> nn.Sequential:
    """Small CNN for the 8x8 digits: input float (n, 1, 8, 8), output (n, 10); 9,930 parameters.

    Tanh activations (Papernot et al. 2021, arXiv 2007.14191) and no normalisation layer.
    """
    layers = OrderedDict(
        conv1=nn.Conv2d(1, 16, 3, padding=1),  # (n, 16, 8, 8)
        act1=nn.Tanh(),
        conv2=nn.Conv2d(16, 32, 3, stride=2, padding=1),  # (n, 32, 4, 4)
        act2=nn.Tanh(),
        flatten=nn.Flatten(),  # (n, 512)
        fc1=nn.Linear(32 * 4 * 4, 10),  # (n, 10)
    )
    return nn.Sequential(layers)


def digits_mlp() -> nn.Sequential:
    """Two-layer MLP for the 8x8 digits: input float (n, 1, 8, 8), output (n, 10); 9,610 params."""
    layers = OrderedDict(
        flatten=nn.Flatten(),  # (n, 64)
        fc1=nn.Linear(64, 128),  # (n, 128)
        act1=nn.ReLU(),
        fc2=nn.Linear(128, 10),  # (n, 10)
    )
    return nn.Sequential(layers)


@dataclass(frozen=True)
class ZooEntry:
    """How to build a zoo model and feed it: one sample's input shape, classes, size.

    ``vocab_size`` is set for token models (int64 ids in [0, vocab_size)); float inputs are
    drawn uniformly from [0, 1), the range of the scaled images.
    """

    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample, without the batch dim
    num_classes: int
    num_params: int
    vocab_size: int | None = None


ZOO: dict[str, ZooEntry] = {
    "mnist_cnn": ZooEntry(mnist_cnn, (1, 28, 28), 10, 26_010),
    "cifar10_cnn": ZooEntry(cifar10_cnn, (3, 32, 32), 10, 605_226),
    "imdb_embedding": ZooEntry(imdb_embedding, (IMDB_SEQ_LEN,), 2, 160_098, IMDB_VOCAB),
    "imdb_lstm": ZooEntry(imdb_lstm, (IMDB_SEQ_LEN,), 2, 1_081_402, IMDB_VOCAB),
    "digits_cnn": ZooEntry(digits_cnn, (1, 8, 8), 10, 9_930),
    "digits_mlp": ZooEntry(digits_mlp, (1, 8, 8), 10, 9_610),
}


def zoo_entry(name: str) -> ZooEntry:
    """The ZOO entry for ``name``, or a KeyError listing the valid names."""
    if name not in ZOO:
        raise KeyError(f"model name={name!r} is not in the zoo; choose one of {sorted(ZOO)}")
    return ZOO[name]


def make_model(name: str) -> nn.Module:
    """A freshly initialised zoo model (seed torch first for reproducible weights)."""
    return zoo_entry(name).factory()


def example_batch(
    name: str,
    n: int,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, targets) for zoo model ``name``: inputs (n, *input_shape), targets (n,).

    Inputs are ``dtype`` in [0, 1) for image models, int64 token ids for token models
    (``dtype`` is then ignored); targets are int64 class indices.
    """
    if n < 1:
        raise ValueError(f"batch size n={n} must be at least 1")
    entry = zoo_entry(name)
    shape = (n, *entry.input_shape)
    if entry.vocab_size is not None:
        inputs = torch.randint(0, entry.vocab_size, shape, generator=generator)  # (n, T)
    else:
        inputs = torch.rand(shape, generator=generator, dtype=dtype)  # (n, c, h, w)
    targets = torch.randint(0, entry.num_classes, (n,), generator=generator)  # (n,)
    return inputs, targets


__all__ = [
    "IMDB_SEQ_LEN", "IMDB_VOCAB", "ZOO", "MeanOver", "RNNOutput", "SelfAttention", "ZooEntry",
    "cifar10_cnn", "count_parameters", "digits_cnn", "digits_mlp", "example_batch",
    "imdb_embedding", "imdb_lstm", "make_model", "mnist_cnn", "zoo_entry",
]
