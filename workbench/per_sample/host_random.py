"""Random numbers drawn outside torch: NumPy's and Python's global generators.

Every exact twin of a random forward pass replays torch's generators (``fallback.replayed``,
``state_replay``: a model's own ``torch.Generator``): record i alone, or the batch again with
the others substituted, draws the numbers the batch's pass drew. NumPy's global generator
(``np.random``) and Python's (``random``) are replayed by nothing: a re-run draws other
numbers, so no twin computes what the pass computed. Where the draws are made for the whole
batch, record i's numbers also depend on the records beside it: transformers' SpecAugment
(``_compute_mask_indices``, Wav2Vec2, HuBERT, WavLM, Data2VecAudio, SEW, UniSpeech in training
mode, ``config.mask_time_prob`` > 0 (0.05 by default) or ``mask_feature_prob`` > 0) draws one
ε for the batch, then each record's masked spans after those of the records before it, with
``np.random.choice`` over a range set by each earlier record's length: one record's length
moves every later record's mask.

Until 2026-12-01 such a model was refused with another cause's message (the self-check's
halves: "a statistic of the batch"), and in every recording method first crashed on the
feature encoder's ``x.requires_grad = True`` (an AttributeError, ``derived.spread``). Now a
pass that drew from either generator is refused by name, with the fix (``error``): each
recording pass (``uses.UseTracker``: the functional API's methods, the DP optimizer in every
mode) and the record-alone methods' check (``selfcheck.check_alone``) compare the two
generators' states before and after (a few microseconds).
"""

import random

import numpy as np

from workbench.errors import SampleMixingError


def states() -> tuple:
    """NumPy's and Python's global generator states (copies)."""
    return np.random.get_state(), random.getstate()


def drew(before: tuple) -> str | None:
    """Which global generator outside torch drew since ``before`` (``states``), or None."""
    now = states()
    kind, keys, pos, gauss, cached = before[0]
    kind2, keys2, pos2, gauss2, cached2 = now[0]
    if pos != pos2 or gauss != gauss2 or cached != cached2 or not np.array_equal(keys, keys2):
        return "NumPy's global generator (np.random)"
    if before[1] != now[1]:
        return "Python's global generator (the random module)"
    return None


def error(which: str) -> SampleMixingError:
    return SampleMixingError(
        f"the forward pass (or the loss) drew random numbers from {which}, which no exact twin "
        f"can replay: the workbench replays torch's generators, so the self-check, the "
        f"fallback and micro-batching would draw other numbers than the batch's pass drew. "
        f"Numbers drawn for the whole batch also make each record's result depend on the "
        f"records beside it: transformers' SpecAugment (Wav2Vec2, HuBERT, WavLM, "
        f"Data2VecAudio, SEW, UniSpeech in training mode, with config.mask_time_prob > 0, "
        f"0.05 by default, or mask_feature_prob > 0) draws one number for the batch and each "
        f"record's masked spans after the spans of the records before it, as many draws as "
        f"their lengths allow, so one record's length moves the masks of the others. Set "
        f"config.mask_time_prob = 0 and config.mask_feature_prob = 0 (or "
        f"config.apply_spec_augment = False), or run the model in eval mode; draw such "
        f"augmentation per record in the data pipeline (a Dataset transform), or with torch's "
        f"generator inside the model")


__all__ = ["drew", "error", "states"]
