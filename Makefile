# The two commands of the README: `make lab` (open the notebooks) and `make test`.
# Both create .venv when absent. torch is installed first, on its own, pinned to
# TORCH_VERSION, so that pip does not resolve `torch` to the newest build.
#
# Which torch build: on Linux the ordinary package index (PyPI) serves torch with CUDA, which
# pulls several GB of nvidia-* packages; PyTorch's CPU wheel index serves the CPU build
# (torch==2.13.0+cpu, ~200 MB). So on Linux TORCH_INDEX defaults to that index; elsewhere
# (macOS, Windows: PyPI's wheel is already the CPU/MPS build) it is empty and PyPI is used.
# If TORCH_INDEX cannot be reached (a mirror, a machine that sees only PyPI), the install
# falls back to plain `pip install torch==TORCH_VERSION`, says so, and goes on; on Linux that
# is the CUDA build. Override: `make test TORCH_INDEX=` (PyPI only), or another index, e.g.
# `TORCH_INDEX=https://download.pytorch.org/whl/cu126`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCH_VERSION ?= 2.13.0
# torchvision (timm needs it: the realmodels extra) comes with torch, from the same index: its
# C++ ops are compiled against one torch build (0.28 <-> 2.13; the CPU index serves both as
# +cpu). Where another build is installed beside torch (PyPI's torchvision is linked against
# CUDA torch), workbench.realzoo.imports imports its Python parts without the ops, and says so.
TORCHVISION_VERSION ?= 0.28.0
TORCH_PKGS := torch==$(TORCH_VERSION) torchvision==$(TORCHVISION_VERSION)
TORCH_INDEX   ?= $(if $(filter Linux,$(shell uname -s)),https://download.pytorch.org/whl/cpu,)

.PHONY: test lab audit bench lint unit notebooks notebooks-full browser clean record-notebooks \
        wheel-check book

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(if $(TORCH_INDEX),$(PY) -m pip install --timeout 20 --retries 1 \
	    --index-url $(TORCH_INDEX) $(TORCH_PKGS) || \
	  { echo "make: torch from $(TORCH_INDEX) failed; falling back to the default index:" \
	         "pip install $(TORCH_PKGS) (on Linux the CUDA build, several GB)"; \
	    $(PY) -m pip install $(TORCH_PKGS); }, \
	  $(PY) -m pip install $(TORCH_PKGS))
	$(PY) -m pip install -e '.[dev,crosscheck,realmodels]'
	touch $(STAMP)

test: lint unit notebooks browser

lint: $(STAMP)
	$(VENV)/bin/ruff check workbench tests notebooks tools

unit: $(STAMP)
	$(PY) -m pytest -q tests workbench --doctest-modules --ignore=tests/browser

notebooks: $(STAMP)
	WORKBENCH_FAST=1 WORKBENCH_SOLUTIONS=1 $(PY) -m pytest -q --nbval-lax -p no:cacheprovider notebooks

# Every notebook as a learner runs it: top to bottom in full mode (WORKBENCH_FAST unset), with
# nbclient; fails on an error or on a figure that would not show, prints each one's time.
# WORKBENCH_SOLUTIONS=1 (here and in `notebooks`): the on-ramp's reference solutions run and
# its exercise checks must pass (workbench/exercises.py).
notebooks-full: $(STAMP)
	$(PY) tools/nbchecks.py run notebooks/*.ipynb

# The book: every notebook in full mode as static HTML in build/book/ (open build/book/index.html;
# it works offline). Reuses the executed copies `make notebooks-full` saved in build/executed/
# (runs only the notebooks changed since), then opens every page in headless Chromium
# (tests/browser/test_book.py: no console error, figures loaded, navigation).
book: $(STAMP)
	$(PY) tools/book.py --out build/book
	WORKBENCH_BOOK_REQUIRED=1 $(PY) -m pytest -q -p no:cacheprovider -m browser \
	    tests/browser/test_book.py

# The widgets in JupyterLab in headless Chromium (Debian's /usr/bin/chromium, driven by
# playwright): each notebook with a widget is run and a slider of each widget moved. Skipped,
# with the reason printed, when chromium or playwright is missing (.ci/run installs chromium).
browser: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m browser tests/browser

# The installable package: build the wheel, install it into a fresh venv outside the checkout
# (torch and the other dependencies borrowed from .venv, not downloaded again: the script says
# how), check every data file's bytes, load the data and run the README example there.
wheel-check: $(STAMP)
	$(PY) tools/wheel_check.py

# JupyterLab refuses to run as root unless told to (containers, CI machines): say so only then.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: $(STAMP)
	$(VENV)/bin/jupyter lab notebooks/ $(ALLOW_ROOT)

# The headless main job: the audit suite, report in audit-report/ (report.html, report.json).
audit: $(STAMP)
	$(PY) -m workbench audit --out audit-report

# Every benchmark: CSVs and the Fig. 2/3-style figures in bench-results/ (minutes on a CPU).
bench: $(STAMP)
	$(PY) -m workbench.bench all --out-dir bench-results

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Re-record the stored outputs of the notebooks' `# NBVAL_CHECK_OUTPUT` cells (and strip the
# rest) after changing a notebook: nbval compares against what is stored.
record-notebooks: $(STAMP)
	$(PY) tools/nbchecks.py record notebooks/*.ipynb
