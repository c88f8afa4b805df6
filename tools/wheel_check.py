"""Does the *installed* package work? ``make wheel-check`` (CI runs it after ``make test``).

    python tools/wheel_check.py [--keep]

1. builds the wheel from a clean copy of this checkout's pyproject.toml, setup.py,
   MANIFEST.in, README.md, data/ and workbench/ (``pip wheel --no-deps``; nothing is
   written into the checkout);
2. installs it, without dependencies, into a fresh virtual environment (``venv
   --without-pip``) in a temporary directory outside the checkout;
3. runs, from an empty directory and with ``python -I`` (no PYTHONPATH, no current directory
   on sys.path), a check that the imported ``workbench`` is the installed one, that every data
   file of ``data/`` arrived (as ``workbench/_data/``) with the same bytes (sha256; the
   texts' CRLF line ends included), that ``load_digits``, ``load_text`` and
   ``shipped_results`` find their files, and then the README's "The API in ten lines"
   example, as tests/test_readme.py does.

Where the fresh environment gets torch, numpy, ... from: installing them afresh would download
several hundred MB (torch alone ~200 MB from the CPU index, then scipy, jupyterlab, ...) on
every CI run, for no test of ours. So the fresh venv borrows them: a ``.pth`` file in its
site-packages holds the path of this checkout's ``.venv`` site-packages. A ``.pth`` *path* line
only appends that directory to sys.path; ``.pth`` files inside it are not processed, so the
editable install of the checkout (``__editable__...pth`` and its import finder) stays off, and
the fresh venv's own site-packages, where the wheel went, comes first. Step 3 asserts both
(``workbench.__file__`` lies in the fresh venv, not the checkout), and ``pip check`` confirms
that the wheel's declared dependencies are met by what is borrowed. pip too is borrowed (run by
the fresh interpreter, it installs into the fresh venv): a pip of the venv's own would bring an
older setuptools that shadows .venv's. Not tested here: pip resolving the dependencies from an
index; ``make`` does that for the checkout (``pip install -e``).

The wheel is built with the build backend already in ``.venv`` (``--no-build-isolation``, no
download) when setuptools is there, else in pip's isolated build environment.
"""

import argparse
import hashlib
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"  # shipped in the wheel as workbench/_data/ (setup.py)

# Run by the fresh venv's interpreter, in an empty directory; argv[1]: the JSON manifest
# {relative path under data/: sha256} of the checkout, argv[2]: the checkout root.
CHECK = r"""
import hashlib, json, sys
from pathlib import Path

import workbench
from workbench.bench.memory_explore import shipped_results
from workbench.data import bundled, load_digits, load_text, TEXTS

manifest, checkout = json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2])
where = Path(workbench.__file__).resolve()
assert where.is_relative_to(Path(sys.prefix).resolve()), f"imported {where}, not the wheel's"
assert not where.is_relative_to(checkout), f"imported the checkout's workbench: {where}"
root = bundled()
installed = {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
             for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
missing, extra = sorted(set(manifest) - set(installed)), sorted(set(installed) - set(manifest))
assert not missing and not extra, f"data files missing from the wheel: {missing}; extra: {extra}"
changed = [name for name in manifest if installed[name] != manifest[name]]
assert not changed, f"data files whose bytes changed in the wheel: {changed}"
train, test = load_digits()
assert (len(train), len(test)) == (1437, 360)
lengths = {name: len(load_text(name)) for name in TEXTS}  # each sha256-checked
assert lengths == {"shakespeare": 122_813, "carroll": 143_255}, lengths
assert len(shipped_results()) >= 2
print(f"wheel-check: workbench imported from {where.parent}")
print(f"wheel-check: {len(installed)} data files, every sha256 as in the checkout; digits "
      f"{len(train)}/{len(test)}, texts {lengths}, {len(shipped_results())} memory CSVs")
"""


def readme_example() -> str:
    """The README's "The API in ten lines" block (the regex of tests/test_readme.py)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"## The API in ten lines\n.*?```python\n(.*?)```", text, re.S)
    if not match:
        raise SystemExit("wheel-check: no python block under '## The API in ten lines' in README")
    return match.group(1)


def run(*cmd, cwd=None) -> str:
    done = subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"wheel-check: failed ({done.returncode}): {' '.join(map(str, cmd))}\n"
                         f"{done.stdout}{done.stderr}")
    return done.stdout


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="workbench-wheel-check-"))
    times, start = {}, time.perf_counter()

    def lap(name):
        nonlocal start
        times[name], start = time.perf_counter() - start, time.perf_counter()

    try:
        build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", tmp / "dist"]
        if importlib.util.find_spec("setuptools"):
            build.append("--no-build-isolation")  # .venv's backend: nothing to download
        src = tmp / "src"  # a clean copy: setuptools would reuse a stale build/ in the checkout
        src.mkdir()
        for name in ("pyproject.toml", "README.md", "setup.py", "MANIFEST.in"):  # with
            shutil.copy2(ROOT / name, src / name)  # workbench/ and data/: all the build reads
        shutil.copytree(DATA, src / "data")
        shutil.copytree(ROOT / "workbench", src / "workbench",
                        ignore=shutil.ignore_patterns("__pycache__"))
        run(*build, src)
        wheel = next((tmp / "dist").glob("*.whl"))
        lap("build")
        venv = tmp / "venv"
        run(sys.executable, "-m", "venv", "--without-pip", venv)  # on .venv's base interpreter
        python = venv / "bin" / "python"
        site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])")
                    .strip())
        borrowed = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
        (site / "_workbench_borrowed_deps.pth").write_text("\n".join(borrowed) + "\n")
        # .venv's pip (borrowed like the rest), run by the fresh interpreter: it installs into
        # the fresh venv. A pip of its own would bring its own setuptools, shadowing .venv's.
        pip = [python, "-m", "pip", "--disable-pip-version-check"]
        run(*pip, "install", "--no-deps", "--quiet", wheel)
        run(*pip, "check")
        lap("install")
        work = tmp / "run"
        work.mkdir()
        manifest = {p.relative_to(DATA).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                    for p in DATA.rglob("*") if p.is_file() and "__pycache__" not in p.parts}
        (work / "manifest.json").write_text(json.dumps(manifest))
        (work / "check.py").write_text(CHECK)
        print(run(python, "-I", "check.py", "manifest.json", ROOT, cwd=work), end="")
        lap("data")
        (work / "readme_example.py").write_text(readme_example())
        out = run(python, "-I", "readme_example.py", cwd=work)
        if "BatchNorm1d" not in out:
            raise SystemExit(f"wheel-check: the README example printed no BatchNorm1d:\n{out}")
        lap("readme")
        print(f"wheel-check: passed ({wheel.name}); seconds: "
              + ", ".join(f"{k} {v:.1f}" for k, v in times.items())
              + f", total {sum(times.values()):.1f}")
    finally:
        if args.keep:
            print(f"wheel-check: kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
