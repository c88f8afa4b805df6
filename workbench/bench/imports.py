"""What ``import workbench`` costs over ``import torch``: seconds, resident memory, modules.

Each run is a fresh interpreter (``sys.executable``) that imports torch, reads the clock and
its resident set size, imports ``workbench`` (or the module named), and reads both again; the
difference is what the workbench adds. Runs are repeated and the median is reported. The
heavy optional libraries (pandas, scipy, matplotlib, ipywidgets) are loaded only by the
functions that use them (lazy imports), so the row also says which of them the import loaded.
Target (issue 25 item 5): ≤ 0.5 s and ≤ 20 MB over ``import torch``.

The resident set size is read from ``/proc/self/statm`` (Linux); elsewhere the peak RSS of
``resource.getrusage`` stands in (an upper bound on what was added).

    python -m workbench.bench imports [--repeats 5] [--module workbench]
"""

import argparse
import json
import statistics
import subprocess
import sys

from workbench.outputs import output_file_arg

HEAVY = ("pandas", "scipy", "matplotlib", "ipywidgets")

_PROBE = r"""
import json, os, resource, sys, time

def rss():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024

import torch
t0, m0, n0 = time.perf_counter(), rss(), len(sys.modules)
__import__(sys.argv[1])
t1, m1 = time.perf_counter(), rss()
print(json.dumps({"seconds": t1 - t0, "MB": (m1 - m0) / 2**20,
                  "modules": len(sys.modules) - n0,
                  "heavy": sorted(m for m in sys.argv[2:] if m in sys.modules)}))
"""


def measure_once(module: str = "workbench") -> dict:
    """One fresh interpreter: seconds, MB and modules ``import module`` adds over torch."""
    out = subprocess.run([sys.executable, "-c", _PROBE, module, *HEAVY], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(repeats: int = 5, module: str = "workbench") -> dict:
    """Medians over ``repeats`` fresh interpreters, and the heavy libraries any run loaded."""
    runs = [measure_once(module) for _ in range(repeats)]
    return {"module": module, "repeats": repeats,
            "seconds": statistics.median(r["seconds"] for r in runs),
            "MB": statistics.median(r["MB"] for r in runs),
            "modules": statistics.median(r["modules"] for r in runs),
            "heavy_loaded": sorted({m for r in runs for m in r["heavy"]})}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m workbench.bench imports",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--module", default="workbench")
    parser.add_argument("--out", type=output_file_arg("--out"), default=None,
                        help="also write the figures as a one-row CSV")
    args = parser.parse_args(argv)
    r = run(args.repeats, args.module)
    if args.out is not None:
        import pandas as pd

        args.out.parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame([{**r, "heavy_loaded": " ".join(r["heavy_loaded"])}]).to_csv(args.out,
                                                                               index=False)
    print(f"import {r['module']} over import torch (median of {r['repeats']} fresh "
          f"interpreters): {r['seconds']:.3f} s, {r['MB']:.1f} MB resident, "
          f"{r['modules']:.0f} modules; heavy libraries loaded: "
          f"{', '.join(r['heavy_loaded']) or 'none'}")
    return 0


__all__ = ["HEAVY", "main", "measure_once", "run"]


if __name__ == "__main__":
    sys.exit(main())
