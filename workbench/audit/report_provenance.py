"""Provenance of an audit report: which code, versions, machine, settings and seeds made it.

Everything needed to reproduce the report or to judge whether it still applies: the
workbench's version and git commit (when run from a checkout, with a flag for uncommitted
changes), the versions of Python and the libraries that did the work (optional ones when
installed), date and time, machine and device, every setting and seed, and the command line.
"""

import datetime
import os
import platform
import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import torch

LIBRARIES = {"torch": "torch", "numpy": "numpy", "scipy": "scipy", "pandas": "pandas",
             "matplotlib": "matplotlib"}
OPTIONAL = {"opacus": "opacus", "dp-accounting": "dp-accounting",
            "backpack": "backpack-for-pytorch"}


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def git_commit(path: Path | None = None) -> dict | None:
    """{"commit", "dirty"} of the checkout holding the workbench, or None (not a checkout,
    or git missing)."""
    root = Path(path or Path(__file__).resolve().parents[2])
    if not (root / ".git").exists():
        return None
    try:
        def git(*args):
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, timeout=10, check=True).stdout.strip()
        return {"commit": git("rev-parse", "HEAD"),
                "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return None


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo, macOS sysctl), else platform.processor()."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    try:
        return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return platform.processor() or platform.machine() or "unknown"


def device() -> str:
    if torch.cuda.is_available():
        return f"cuda: {torch.cuda.get_device_name(0)} (audit ran on cpu)"
    return "cpu"


def command_line(argv) -> str:
    """The command that reproduces the report (``python -m workbench audit ...``)."""
    return shlex.join(["python", "-m", "workbench", "audit", *map(str, argv)])


def provenance(argv, settings: dict, seeds: dict) -> dict:
    """The report's provenance block (JSON-ready)."""
    versions = {"workbench": _version("dpsgd-workbench") or "not installed (source tree)",
                "python": platform.python_version()}
    versions.update({k: _version(v) for k, v in LIBRARIES.items()})
    versions.update({k: _version(v) or "not installed" for k, v in OPTIONAL.items()})
    now = datetime.datetime.now(datetime.timezone.utc).astimezone()
    return {
        "versions": versions,
        "git": git_commit(),
        "date": now.isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "machine": platform.machine(),
                    "processor": platform.processor() or platform.machine(),
                    "cpu_model": cpu_model(),
                    "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "device": device()},
        "settings": settings,
        "seeds": seeds,
        "command": command_line(argv),
        "python_executable": sys.executable,
    }


__all__ = [
    "LIBRARIES", "OPTIONAL", "command_line", "cpu_model", "device", "git_commit", "provenance",
]
