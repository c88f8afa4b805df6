"""Benchmarks: ``python -m workbench.bench {layers,accounting,...}``.

Speed and memory are measured here, never in unit tests. Every benchmark measures the things
it compares side by side in one run (interleaved repeats, medians) and reports ratios, because
the machines are shared and noisy. Absolute times are only meaningful with the device named,
so every CSV row carries the device.
"""


__all__: list[str] = []
