"""The accountants, one file each; every file here is imported and registers itself.

| name  | file    | ε of a run of the sampled Gaussian mechanism                              |
|-------|---------|---------------------------------------------------------------------------|
| "rdp" | rdp.py  | Rényi DP, summed over steps, converted to (ε, δ) (``../rdp.py``)          |
| "pld" | pld.py  | privacy-loss distribution, composed by FFT (``../pld.py``, ``../compose``) |

A new accountant is a new file here that calls ``registry.register_accountant`` (see
``registry.py`` for what it gives); ``epsilon``, ``get_noise_multiplier``,
``PrivacyEngine(accountant=...)``, the budget explorer and the audit report find it by name.
The table above is a reading aid; ``accounting.ACCOUNTANTS`` is the live one.
"""

from workbench.plugins import import_submodules

import_submodules(__name__, __path__)


__all__: list[str] = []  # the files here register themselves; nothing to import
