"""``python -m workbench audit [options]``: the headless audit (see workbench/audit/cli.py)."""

import sys

COMMANDS = {"audit": "workbench.audit.cli"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print("usage: python -m workbench audit [--help]\n"
              "  audit   run the audit suite and write an HTML/JSON report "
              "(python -m workbench.bench for benchmarks)", file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    import importlib

    return importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
