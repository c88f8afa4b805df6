import torch

from workbench.per_sample import memory


def test_large_cpu_buffers_get_huge_page_advice_when_enabled(monkeypatch):
    monkeypatch.setattr(memory, "HUGE_PAGES", True)
    like = torch.ones(1, dtype=torch.float64)
    t = memory.zeros_per_sample((1024, 1024), like=like)  # 8 MiB
    assert t.dtype == torch.float64 and t.shape == (1024, 1024) and not t.any()
    advised = memory.advise_huge_pages(torch.empty(1024, 1024))
    assert advised == (memory._madvise is not None)


def test_off_by_default_unless_the_environment_asks(monkeypatch):
    monkeypatch.setattr(memory, "HUGE_PAGES", False)
    assert not memory.advise_huge_pages(torch.empty(1024, 1024))


def test_small_buffers_are_plain():
    assert not memory.advise_huge_pages(torch.empty(10))
    t = memory.empty_per_sample((3, 2), like=torch.ones(1, dtype=torch.float32))
    assert t.shape == (3, 2) and t.dtype == torch.float32
