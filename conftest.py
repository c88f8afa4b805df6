"""Collection for ``pytest tests workbench --doctest-modules`` (the Makefile's ``unit``).

The old module paths of ``workbench/lm/`` (``deprecation.py``: kept for one release) warn when
imported, which the pytest filter turns into an error; they hold no doctests of their own, so
the doctest collector skips them (``tests/test_renamed.py`` imports them on purpose).
"""

collect_ignore = [f"workbench/{name}.py"
                  for name in ("corpus", "lm_training", "memorisation", "models_gpt")]
