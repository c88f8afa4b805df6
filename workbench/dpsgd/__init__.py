"""DP-SGD training: Poisson sampling, the DP optimizer and the PrivacyEngine."""

from workbench.dpsgd.adaptive import AdaptiveClipDPOptimizer, AdaptiveClipping
from workbench.dpsgd.checkpoint import load_checkpoint, save_checkpoint
from workbench.dpsgd.engine import PrivacyEngine, VirtualStepLoader
from workbench.dpsgd.optimizer import DPOptimizer
from workbench.dpsgd.privatise import MODES
from workbench.dpsgd.sampling import DPDataLoader, PoissonBatchSampler
from workbench.dpsgd.train import accuracy, train

__all__ = ["AdaptiveClipDPOptimizer", "AdaptiveClipping", "DPDataLoader", "DPOptimizer", "MODES",
           "PoissonBatchSampler", "PrivacyEngine", "VirtualStepLoader", "accuracy",
           "load_checkpoint", "save_checkpoint", "train"]
