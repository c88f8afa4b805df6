"""Prose that cannot drift from the outputs it describes (issue 27, item 3).

A number that a notebook's markdown states as a result ("over-estimates by 25%", "140x",
"about 73%", "ε = 6.04") goes stale silently when a re-measure changes the output. The rule:
every such *claim number* in a markdown cell must be

- a literal in one of the notebook's code cells: a setting (``EPSILONS = [1.0, 8.0]``) or an
  assert beside the output (``assert round(acc, 2) == 0.73``; a percentage p matches p/100),
  so that a changed result fails the notebook instead of leaving the text wrong; or
- in a citation's context (another paper's number: "[Opacus", "et al.", "the paper", "Table",
  "Fig."); or
- listed in :data:`ALLOWED` below with the reason (a constant of nature or of the definition).

Otherwise print it from a code cell (formatted from the output) and say "printed above".

What counts as a claim number (:data:`CLAIM`): a number with %, x, ×, "times" or "-fold",
one after "factor", "about", "almost", "roughly", "at least", "at most", "up to", or after
"ε =", "σ =". Code spans and math are not scanned.
"""

import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
NUM = r"\d+(?:\.\d+)?"
CLAIM = re.compile(
    rf"(?P<a>{NUM})\s*(?:%|x\b|×|times\b|-fold)"
    rf"|(?:factor(?: of)?|about|almost|roughly|at least|at most|up to)\s+(?P<b>{NUM})(?![\d⁻])"
    rf"|[εσ]\s*(?:=|≈|≤|>=|<=)\s*(?P<c>{NUM})")
CITATION = re.compile(r"\[[A-Z]|et al\.|[Tt]he paper|paper's|Table \d|Fig\. ?\d|Opacus 1\.|"
                      r"A100|H200|Thm\.|Def\. ")

# (notebook, number as written) -> why it is not a measured result of the notebook
ALLOWED = {
    ("00_tour", "2"): "'two-minute': a reading time",
    ("00b_foundations", "3"): "ln 3: randomised response with p = 1/2, a definition",
    ("04_privacy_accounting", "1"): "'1% of the data': an example of q in the text's formula",
    ("04_privacy_accounting", "10"): "10⁻⁴: q² for q = 1%, arithmetic of the formula",
    ("04_privacy_accounting", "1024"): "the largest default order (accounting.DEFAULT_ORDERS)",
    ("04_privacy_accounting", "63"): "Opacus' largest default order",
    ("05_dp_sgd_training", "37"): "e⁻¹ ≈ 37%: a constant",
    ("06_auditing", "0.1"): "α = 1e-3: the test's chosen false-alarm rate",
    ("06_auditing", "5"): "'at most 5%': the definition of a 95% bound",
    ("06_auditing", "95"): "a 95% bound: the chosen confidence",
    ("06_auditing", "10"): "'10% excess': the bug zoo's definition (1.1·C)",
    ("07_memory_and_speed", "1"): "'about 1 + L/C': the model's formula",
    ("07_memory_and_speed", "2"): "'b x 2 x 256': a tensor shape",
    ("08_private_language_model", "1"): "'about 1 bit': exposure of a random guess (definition)",
    ("08_private_language_model", "10"): "'last 10% held out': a setting of the data split",
    ("10_what_epsilon_means", "0.1"): "FPR 0.1%: the chosen operating point",
    ("10_what_epsilon_means", "95"): "a 95% lower bound: the chosen confidence",
    ("10_what_epsilon_means", "3"): "e^8 · 0.001 ≈ 3: arithmetic stated in the sentence",
}

# Measured numbers still in prose, each to be printed from its output (issue 27 sweep, not
# finished): a ratchet, so that no *new* one can be added. Remove entries as they are fixed.
KNOWN_UNDERIVED = {
    "02_layers": {"1.1", "1.8", "3.5", "11"},
    "03_ghost_clipping": {"1.3", "129", "334"},
    "06_auditing": {"4.9", "24"},
    "07_memory_and_speed": {"0.40", "0.6", "0.84", "1.4", "6", "9", "39", "72",
                            "140"},
}


def markdown_claims(nb):
    """(cell index, number, context) for every claim number in the markdown cells."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        text = re.sub(r"`[^`]*`|\$\$.*?\$\$|\$[^$]*\$", " ", cell.source, flags=re.S)
        for m in CLAIM.finditer(text):
            number = m.group("a") or m.group("b") or m.group("c")
            yield i, number, re.sub(r"\s+", " ", text[max(0, m.start() - 150):m.end() + 20])


def code_literals(nb) -> set[float]:
    literals = set()
    for cell in nb.cells:
        if cell.cell_type == "code":
            for token in re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?:e-?\d+)?", cell.source):
                literals.add(round(float(token), 9))
    return literals


def undocumented(path: Path, known=frozenset()) -> list[str]:
    """Claims of ``path`` that no code sets or asserts (``known`` numbers are let through)."""
    nb = nbformat.read(path, as_version=4)
    literals, name = code_literals(nb), path.stem
    problems = []
    for i, number, context in markdown_claims(nb):
        value = float(number)
        if {round(value, 9), round(value / 100, 9)} & literals or CITATION.search(context):
            continue
        if (name, number) in ALLOWED or number in known:
            continue
        problems.append(f"cell {i}: {number!r} in ...{context}...")
    return problems


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_claimed_number_comes_from_the_code(path):
    problems = undocumented(path, KNOWN_UNDERIVED.get(path.stem, frozenset()))
    assert not problems, (
        f"{path.name}: numbers in the prose that no code cell sets or asserts; print them from "
        "the output (formatted) or assert them beside it:\n" + "\n".join(problems))


@pytest.mark.parametrize("name", sorted(KNOWN_UNDERIVED))
def test_the_known_list_only_shrinks(name):
    """Each number of KNOWN_UNDERIVED is still in its notebook's prose: drop it once fixed."""
    still = {p.split("'")[1] for p in undocumented(ROOT / "notebooks" / f"{name}.ipynb")}
    fixed = KNOWN_UNDERIVED[name] - still
    assert not fixed, f"{name}: {sorted(fixed)} no longer in the prose: remove from the list"


def test_the_check_catches_a_drifted_number(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("# T\n\nThe model over-estimates by 25% to 185%."),
        nbformat.v4.new_code_cell("err = table['error']\nassert round(err.min(), 2) == 0.25")])
    path = tmp_path / "99_drift.ipynb"
    nbformat.write(nb, path)
    problems = undocumented(path)
    assert len(problems) == 1 and "'185'" in problems[0]


def test_the_tour_lists_every_notebook():
    tour = nbformat.read(ROOT / "notebooks" / "00_tour.ipynb", as_version=4)
    text = "\n".join(c.source for c in tour.cells if c.cell_type == "markdown")
    missing = [p.stem for p in NOTEBOOKS if p.stem != "00_tour" and f"**{p.stem}**" not in text]
    assert not missing, f"the tour's learning path omits {missing}"
