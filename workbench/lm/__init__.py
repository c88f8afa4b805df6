"""The language-model chapter: a tiny GPT, a character corpus, its DP training, memorisation.

- ``gpt.py``: ``tiny_gpt`` (nanoGPT-style, GPT-2 §2.3: tied head, learned positions),
  ``sequence_cross_entropy`` (per-sequence sums, for per-sample clipping), ``generate``;
- ``corpus.py``: two public-domain authors, by character (``data/README.md``);
- ``training.py``: non-private pretraining and the DP-SGD loop under ``PrivacyEngine``;
- ``memorisation.py``: the exposure of a planted secret (Carlini et al. 2019, arXiv 1802.08232).

The old top-level paths (``workbench.models_gpt``, ``workbench.corpus``,
``workbench.lm_training``, ``workbench.memorisation``) still import, with a ``FutureWarning``,
for one release.
"""

from workbench.lm.corpus import TEXTS, CharTokenizer, load_text, split_ids, windows
from workbench.lm.gpt import TinyGPT, generate, sequence_cross_entropy, tiny_gpt
from workbench.lm.memorisation import exposure, insert_secret, pin_candidates
from workbench.lm.training import dp_train_lm, perplexity, train_lm

__all__ = [
    "TEXTS", "CharTokenizer", "TinyGPT", "dp_train_lm", "exposure", "generate",
    "insert_secret", "load_text", "perplexity", "pin_candidates", "sequence_cross_entropy",
    "split_ids", "tiny_gpt", "train_lm", "windows",
]
