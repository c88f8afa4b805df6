"""The public names, listed: a change to what the workbench exports is a deliberate edit here.

Every module of ``workbench`` declares ``__all__`` (what ``from m import *`` and the reader may
use) and every name in it exists; each package's ``__all__`` is the literal list below;
``dir(wb)`` shows the API, not the helper modules importing it loaded (``checks``,
``errors``, ...). The old module paths kept for one release (``deprecation.py``) are not
modules of their own: importing one warns and hands over the new module.
"""

import ast
import importlib
from pathlib import Path

import pytest

import workbench as wb

ROOT = Path(wb.__file__).resolve().parent
MOVED = {"workbench.models_gpt", "workbench.corpus", "workbench.lm_training",
         "workbench.memorisation"}  # deprecated paths of workbench/lm/ (one release)

EXPECTED = {
    "workbench": [
        "GRAD_SAMPLERS", "LoopError", "LossCouplingError", "LossShapeError", "METHODS",
        "NonFiniteGradientError",
        "PerSampleCheckError", "PrivacyEngine", "RecordCountError", "SampleMixingError",
        "UnattributedGradientError",
        "UnsupportedLayerError", "WorkbenchError", "accounting", "audit", "bench",
        "clipped_grad_sum", "clipping", "data", "dpsgd", "fix_model", "ghost_routes", "layers",
        "lm", "methods", "models", "per_sample", "per_sample_grad_norms", "per_sample_gradients",
        "register_grad_sampler", "register_norm_sampler", "train", "validate_model", "viz",
        "widgets",
    ],
    "workbench.accounting": [
        "ACCOUNTANTS", "Accountant", "AccountantSpec", "BudgetResult", "Calibration",
        "DEFAULT_ORDERS", "EpsilonBounds", "EpsilonCurve", "PLDAccountant", "PLD_DISCRETIZATION",
        "RDPAccountant", "SAMPLERS", "SNRResult", "calibrate", "compute_rdp", "epsilon",
        "epsilon_bounds", "epsilon_curve", "explore_budget", "explore_snr", "gaussian_delta",
        "gaussian_epsilon", "get_noise_multiplier", "history_epsilon", "make_accountant",
        "rdp_to_epsilon", "register_accountant", "steps_from_epochs", "steps_per_epoch",
        "unregister_accountant",
    ],
    "workbench.accounting.accountants": [],
    "workbench.audit": [
        "AuditResult", "CanaryAudit", "Claim", "ClaimAudit", "ClaimError", "GaussianAudit",
        "GradientAudit", "InfluenceAudit", "MechanismAudit", "MembershipAudit", "SamplingAudit",
        "attainable_bound", "audit_canaries", "audit_claim", "audit_dp_step", "audit_gaussian_step",
        "audit_gradients", "audit_record_influence", "audit_sampling", "audit_user_sampling",
        "available_providers",
        "bug_zoo", "bug_zoo_coupling", "bug_zoo_parts", "engine_released_sum",
        "epsilon_lower_bound", "load_claim",
        "membership_inference", "naive_released_sum", "opacus_provider", "register_evidence",
        "step_released_sum", "torch_func_provider", "workbench_step",
    ],
    "workbench.bench": [],
    "workbench.clipping": [
        "CLIP_METHODS", "ClippingResult", "NORM_METHODS", "NORM_SAMPLERS", "clip_at",
        "clip_factors", "clipped_grad_sum", "clipping_snapshot", "ghost_routes",
        "per_sample_grad_norms", "per_sample_snapshot", "register_norm_sampler",
    ],
    "workbench.dpsgd": [
        "AdaptiveClipDPOptimizer", "AdaptiveClipping", "DPDataLoader", "DPOptimizer", "MODES",
        "PoissonBatchSampler", "PrivacyEngine", "VirtualStepLoader", "accuracy", "load_checkpoint",
        "save_checkpoint", "train",
    ],
    "workbench.layers": [
        "DPGRU", "DPLSTM", "DPMultiheadAttention", "DPRNN", "DPRNNBase", "DP_REPLACEMENTS",
        "LoRALinear", "add_lora", "dp_replacement", "merge_lora",
    ],
    "workbench.lm": [
        "CharTokenizer", "TEXTS", "TinyGPT", "dp_train_lm", "exposure", "generate", "insert_secret",
        "load_text", "perplexity", "pin_candidates", "sequence_cross_entropy", "split_ids",
        "tiny_gpt", "train_lm", "windows",
    ],
    "workbench.per_sample": [
        "GRAD_SAMPLERS", "METHODS", "per_sample_gradients", "register_grad_sampler",
    ],
    "workbench.realzoo": [
        "PROBLEMS", "Problem", "REFUSED", "label_loss", "next_token_loss",
    ],
    "workbench.rules": [
        "LayerRule", "MATERIALISE", "RULES", "Route", "fast_reweighted", "fast_weight_grads",
        "find_layer_rule", "register_rule", "unregister_rule",
    ],
    "workbench.viz": [],
    "workbench.widgets": [],
}


def module_names():
    """Every module of the package, by path (``__main__`` files are scripts, not API)."""
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__main__":
            continue
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name not in MOVED:
            yield name, path


def declared_all(path: Path):
    """The ``__all__`` a module assigns at top level (None when it assigns none)."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return ast.literal_eval(node.value)
    return None


@pytest.mark.parametrize("package", sorted(EXPECTED))
def test_each_package_exports_exactly_its_listed_names(package):
    assert sorted(importlib.import_module(package).__all__) == EXPECTED[package]


def test_dir_of_workbench_is_its_api_not_its_helper_modules():
    assert dir(wb) == EXPECTED["workbench"]
    for helper in ("checks", "errors", "validate", "deprecation", "shipped", "plugins"):
        assert helper not in dir(wb)
        assert importlib.import_module(f"workbench.{helper}")  # still importable by path


@pytest.mark.parametrize("name,path", list(module_names()), ids=lambda v: str(v))
def test_every_module_declares_all_and_every_name_exists(name, path):
    names = declared_all(path)
    assert names is not None, f"{name} declares no __all__"
    assert len(set(names)) == len(names), f"{name}.__all__ lists a name twice"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as err:  # an optional dependency (opacus, transformers, ...)
        if err.name and err.name.split(".")[0] != "workbench":
            pytest.skip(f"{name} needs {err.name}")
        raise
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names {missing}, which it does not define"
