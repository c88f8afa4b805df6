"""The headless main job: python -m workbench audit (small settings).

Exit codes: 0 passed, 1 the audit found a failure, 2 usage or input error (one line, no
traceback, before any audit runs). --provider and --step audit the user's own code.
"""

import importlib.util
import json
import textwrap

import pytest
import torch
from torch import nn

from workbench.__main__ import main as workbench_main
from workbench.audit import bug_zoo, bug_zoo_parts, cli_suite
from workbench.audit.gradients import audit_gradients
from workbench.audit.providers import available_providers, backpack_provider
from workbench.audit.report_json import validate

USER_CODE = textwrap.dedent("""
    import torch
    from torch import nn
    import workbench as wb
    from workbench.audit import bug_zoo

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))

    def batch():
        return torch.randn(5, 3), torch.tensor([0, 1, 1, 0, 1])

    def one_tensor():
        return torch.randn(5, 3)

    def not_a_module():
        return 3

    def wide_model():
        return nn.Linear(7, 2)

    def fused_batch():
        return torch.randn(5, 3), torch.tensor([0, 1, 1])

    def provider(model, loss_fn, inputs, targets):
        return wb.per_sample_gradients(model, loss_fn, inputs, targets, method="vmap")

    def swapped(model, loss_fn, inputs, targets):
        g = wb.per_sample_gradients(model, loss_fn, inputs, targets, method="einsum")
        return {k: v[[1, 0, 2, 3, 4]] for k, v in g.items()}

    def step(C, sigma, B, generator):
        return bug_zoo.correct_step(C, sigma, B, generator)

    def short_step(C, sigma, B, generator):
        return lambda G: G.sum(0)[:-1]

    def nan_step(C, sigma, B, generator):
        return lambda G: G.sum(0) / 0 * 0  # NaN everywhere

    def class_weighted(out, y):  # cross_entropy(weight=w), mean: Σ_j w_{y_j} couples records
        w = torch.tensor([1.0, 6.0], dtype=out.dtype)[y]
        return len(y) * w * torch.nn.functional.cross_entropy(out, y, reduction="none") / w.sum()

    NUMBER = 3
""")


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    root = tmp_path_factory.mktemp("usercode")
    (root / "wb_user_code.py").write_text(USER_CODE)
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        yield root


def audit(*argv):
    return workbench_main(["audit", "--no-progress", *map(str, argv)])


def test_quick_audit_passes_and_writes_a_valid_report(tmp_path, capsys):
    code = audit("--quick", "--trials", 60, "--out", tmp_path)
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report.json").read_text())
    validate(report)
    titles = [s["title"] for s in report["sections"]]
    assert report["passed"] and "DP step: workbench DP optimizer" in titles
    assert "Per-sample gradients: workbench methods vs micro-batching" == titles[0]
    zoo = next(s for s in report["sections"] if "bug zoo" in s["title"])
    assert zoo["passed"] and len(zoo["table"]) == len(bug_zoo.ZOO) - 1 + len(bug_zoo_parts.PARTS)
    assert all(row["caught"] for row in zoo["table"])
    assert report["provenance"]["command"].endswith(f"--out {tmp_path}")
    verdicts = {s["title"]: (s["verdict"], s["part"]) for s in report["sections"]}
    assert verdicts["Record influence: workbench engine on digits_mlp"] == ("passed", "subject")
    assert verdicts["Record influence: a naive step on each coupled loss must be caught"] == (
        "passed", "self-check")
    libs = verdicts["Other libraries: dp-accounting and Opacus accountants vs the workbench"]
    assert libs in (("passed", "library"), ("skipped", "library"))
    for part, c in report["by_part"].items():  # counted apart, and adding up
        assert c["passed"] == sum(s["passed"] for s in report["sections"] if s["part"] == part)
    assert sum(c["passed"] for c in report["by_part"].values()) == report["counts"]["passed"]
    page = (tmp_path / "report.html").read_text()
    assert page.count("data:image/png;base64") == sum(s["figures"] for s in report["sections"])


def test_a_missing_library_is_skipped_not_passed(monkeypatch):
    monkeypatch.setattr(cli_suite, "available_providers", lambda: (
        {}, {"opacus_hooks": "opacus is not installed (pip install opacus)"}))
    torch.manual_seed(0)
    case = ("mlp", nn.Sequential(nn.Linear(3, 2)), torch.randn(4, 3), torch.tensor([0, 1, 0, 1]))
    sections = cli_suite.gradient_sections([case], nn.CrossEntropyLoss(reduction="none"), {},
                                           progress=False)
    lib = sections[-1]
    assert (lib.verdict, lib.must_pass) == ("skipped", False)
    assert lib.reason == "opacus is not installed (pip install opacus)"


def test_your_model_provider_and_step(user, tmp_path, capsys):
    code = audit("--model", "wb_user_code:model", "--data", "wb_user_code:batch", "--quick",
                 "--provider", "wb_user_code:provider", "--step", "wb_user_code:step",
                 "--trials", 50, "--out", tmp_path)
    assert code == 0, capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    verdicts = {s["title"]: s["verdict"] for s in report["sections"]}
    assert verdicts["Per-sample gradients: your provider wb_user_code:provider vs "
                    "micro-batching"] == "passed"
    assert verdicts["Record influence: your step wb_user_code:step"] == "passed"
    assert verdicts["Record influence: workbench engine on wb_user_code:model"] == "passed"
    sections = {s["title"]: s for s in report["sections"]}
    assert sections["DP step: workbench DP optimizer"]["part"] == "self-check"  # the reference
    for kind in ("DP step", "Clipping", "Canary audit", "Tight audit of one step"):
        assert any(t.startswith(f"{kind}: your step wb_user_code:step") and v == "passed"
                   for t, v in verdicts.items()), kind


def test_a_wrong_provider_fails_the_run_with_exit_1(user, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(cli_suite, "privacy_sections", lambda *a: [])  # gradients only: quick
    code = audit("--model", "wb_user_code:model", "--data", "wb_user_code:batch",
                 "--provider", "wb_user_code:swapped", "--out", tmp_path)
    out = capsys.readouterr().out
    assert code == 1
    assert "FAILED: Per-sample gradients: your provider wb_user_code:swapped" in out


def test_your_coupled_loss_is_caught_by_the_record_influence_audit(user, tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.setattr(cli_suite, "gradient_sections", lambda *a: [])
    monkeypatch.setattr(cli_suite, "privacy_sections", lambda *a: [])
    code = audit("--model", "wb_user_code:model", "--data", "wb_user_code:batch",
                 "--loss", "wb_user_code:class_weighted", "--out", tmp_path)
    assert code == 1, capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    engine = next(s for s in report["sections"] if s["title"].startswith(
        "Record influence: workbench engine on wb_user_code:model"))
    assert engine["verdict"] == "failed" and engine["part"] == "subject"  # flagged or refused


def test_a_wrong_or_crashing_step_is_a_failed_section():
    mech, clip, canary = cli_suite.step_sections("no noise", bug_zoo.no_noise, trials=50)
    assert (mech.verdict, clip.verdict, canary.verdict) == ("failed", "passed", "failed")

    def crashing(C, sigma, B, generator):
        def step(G):
            raise RuntimeError("out of coffee")
        return step

    crashed = cli_suite.step_sections("crash", crashing, trials=50)
    assert all(s.verdict == "failed" and "out of coffee" in s.finding for s in crashed)


def test_a_step_returning_nan_fails_its_sections_and_the_report_is_written(user, tmp_path,
                                                                          capsys, monkeypatch):
    monkeypatch.setattr(cli_suite, "gradient_sections", lambda *a: [])  # the steps only: quick
    monkeypatch.setattr(cli_suite, "privacy_sections", lambda args, steps, progress, *part: [
        s for spec, f in steps.items()
        for s in cli_suite.step_sections(f"your step {spec}", f, trials=50)])
    code = audit("--step", "wb_user_code:nan_step", "--out", tmp_path)
    out = capsys.readouterr().out
    assert code == 1 and (tmp_path / "report.json").exists() and (tmp_path / "report.html").exists()
    assert "FAILED: Canary audit: your step wb_user_code:nan_step" in out
    assert "raised NonFiniteStepError: your step wb_user_code:nan_step's step_fn returned" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("argv, message", [
    (["--model", "wb_user_code:not_a_module", "--data", "wb_user_code:batch"],
     "--model 'wb_user_code:not_a_module' returned a int, not a torch.nn.Module"),
    (["--model", "wb_user_code:wide_model", "--data", "wb_user_code:batch"],
     "--model 'wb_user_code:wide_model' cannot take --data 'wb_user_code:batch''s inputs"),
    (["--model", "wb_user_code:model", "--data", "wb_user_code:one_tensor"],
     "--data 'wb_user_code:one_tensor' returned a Tensor of shape (5, 3); it must return a "
     "pair (inputs, targets)"),
    (["--model", "wb_user_code:model", "--data", "wb_user_code:fused_batch"],
     "need the same batch size"),
    (["--model", "wb_user_code:model"], "--model needs --data"),
    (["--data", "wb_user_code:batch"], "--data needs --model"),
    (["--model", "nocolon", "--data", "x:y"], "--model must look like module:callable"),
    (["--model", "no_such_module_xyz:f", "--data", "x:y"], "could not be imported"),
    (["--model", "wb_user_code:nope", "--data", "wb_user_code:batch"], "has no attribute"),
    (["--provider", "wb_user_code:NUMBER"], "--provider 'wb_user_code:NUMBER' is a int"),
    (["--provider", "wb_user_code:step", "--model", "wb_user_code:model", "--data",
      "wb_user_code:batch"], "--provider 'wb_user_code:step' returned a function; "
                             "provider(model, loss_fn, inputs, targets) must return"),
    (["--provider", "wb_user_code:not_a_module", "--model", "wb_user_code:model", "--data",
      "wb_user_code:batch"], "--provider 'wb_user_code:not_a_module' raised TypeError"),
    (["--step", "wb_user_code:short_step"], "returned (31,); it must return a Tensor of "
                                            "shape (32,)"),
    (["--loss", "mse", "--model", "wb_user_code:model", "--data", "wb_user_code:batch"],
     "--loss mse"),
    (["--trials", "3"], "--trials must be >= 50"),
    (["--loss", "hinge"], "--loss 'hinge': choose one of cross_entropy, mse, "
                          "sequence_cross_entropy or give module:callable"),
    (["--loss", "wb_user_code:nope"], "has no attribute 'nope'"),
])
def test_input_errors_exit_2_with_one_line(user, tmp_path, capsys, monkeypatch, argv, message):
    def must_not_run(*args):
        raise AssertionError("the audit ran despite an input error")

    monkeypatch.setattr(cli_suite, "gradient_sections", must_not_run)
    monkeypatch.setattr(cli_suite, "zoo_cases", lambda quick: [])
    assert audit(*argv, "--out", tmp_path / "r") == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m workbench audit: error: ") and message in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_unwritable_out_is_found_before_the_audit(tmp_path, capsys, monkeypatch, where):
    monkeypatch.setattr(cli_suite, "zoo_cases", lambda quick: pytest.fail("audit ran"))
    (tmp_path / "f").write_text("")
    out = tmp_path / "f" if where == "a file" else tmp_path / "f" / "sub"
    assert audit("--out", out) == 2
    assert f"--out {str(out)!r}" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        audit("--no-such-option")
    assert exit_info.value.code == 2
    assert workbench_main(["nonsense"]) == 2


def test_help_explains_every_option_and_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        workbench_main(["audit", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--out", "--quick", "--model", "--data", "--loss", "--trials", "--provider",
                   "--step", "--no-progress"):
        assert option in text
    assert "per_sample_grads(model, loss_fn, inputs, targets)" in text
    assert "make_step(max_grad_norm, noise_multiplier, batch_size, generator)" in text
    assert "0 passed, 1 the audit found a failure, 2 usage or input error" in text


def test_backpack_is_skipped_with_the_reason_when_absent():
    if importlib.util.find_spec("backpack") is not None:
        pytest.skip("BackPACK is installed: test_backpack_agrees_with_micro_batching runs")
    found, missing = available_providers()
    assert "backpack" not in found
    assert missing["backpack"] == "backpack is not installed (pip install backpack-for-pytorch)"


@pytest.mark.crosscheck
def test_backpack_agrees_with_micro_batching():
    pytest.importorskip("backpack", reason="BackPACK not installed: "
                                           "pip install backpack-for-pytorch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    result = audit_gradients(model, nn.CrossEntropyLoss(reduction="none"), torch.randn(5, 3),
                             torch.tensor([0, 1, 1, 0, 1]), methods=(),
                             providers={"backpack": backpack_provider})
    assert result.passed, result.table


HF_USER_CODE = textwrap.dedent("""
    import torch
    import workbench.realzoo.imports as imports

    def model():
        torch.manual_seed(0)
        transformers = imports.import_transformers()
        cfg = transformers.GPT2Config(vocab_size=16, n_embd=8, n_layer=1, n_head=2,
                                      n_positions=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)  # the audits replay no SDPA dropout
        return transformers.GPT2LMHeadModel(cfg).double().eval()  # forward -> ModelOutput

    def batch():
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, 16, (4, 5), generator=g), torch.randint(0, 16, (4, 5),
                                                                          generator=g)
""")


@pytest.mark.realmodels
def test_a_hugging_face_model_through_the_cli(tmp_path, capsys, monkeypatch):
    """--model accepts a transformers model: input_ids -> ModelOutput with logits."""
    if importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed: pip install '.[realmodels]'")
    (tmp_path / "wb_hf_code.py").write_text(HF_USER_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert_gradients_pass(tmp_path, capsys, monkeypatch, "wb_hf_code:model",
                          "wb_hf_code:batch", "sequence_cross_entropy")


def assert_gradients_pass(tmp_path, capsys, monkeypatch, model, data, loss):
    """The CLI on --model/--data/--loss, gradients section only: it runs and passes."""
    monkeypatch.setattr(cli_suite, "privacy_sections", lambda *a: [])  # gradients only: quick
    code = audit("--model", model, "--data", data, "--loss", loss, "--out", tmp_path / "report")
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    grads = next(s for s in report["sections"]
                 if s["title"] == "Per-sample gradients: workbench methods vs micro-batching")
    assert grads["verdict"] == "passed", grads


@pytest.mark.realmodels
@pytest.mark.slow
def test_a_real_architecture_through_the_cli(tmp_path, capsys, monkeypatch, name="bert"):
    """--model/--data/--loss accept the real-architecture table (``workbench.realzoo.cli``)."""
    for package in ("transformers", "timm"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed: pip install '.[realmodels]'")
    spec = f"workbench.realzoo.cli:{name}"
    assert_gradients_pass(tmp_path, capsys, monkeypatch, spec, spec + "_batch", spec + "_loss")


def test_the_real_architecture_module_names_what_it_has():
    import workbench.realzoo.cli as cli

    with pytest.raises(AttributeError, match="models: gpt2"):
        cli.no_such_model  # noqa: B018
    assert {"gpt2", "gpt2_batch", "gpt2_loss"} <= set(dir(cli))
