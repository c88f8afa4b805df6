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


BIG = (1024, 1024)  # 4 MiB of float32: large enough to be pooled


def test_a_dropped_buffer_is_reused_and_zeroed_again():
    memory.release_pool()
    like = torch.ones(1)
    a = memory.zeros_per_sample(BIG, like)
    ptr = a.data_ptr()
    a += 1
    del a
    b = memory.zeros_per_sample(BIG, like)
    assert b.data_ptr() == ptr or memory._ALONE is None  # reused where the count is trusted
    assert not b.any()


def test_a_held_result_is_never_handed_out_again():
    memory.release_pool()
    like = torch.ones(1)
    kept = memory.zeros_per_sample(BIG, like)
    kept += 1
    row = memory.zeros_per_sample(BIG, like)[0]  # only a view of the second one survives
    as_numpy = memory.zeros_per_sample(BIG, like).numpy()  # only a numpy array over the third
    for _ in range(3):
        memory.zeros_per_sample(BIG, like).fill_(7.0)
    assert bool((kept == 1).all()) and not row.any() and not as_numpy.any()
    ptrs = {kept.data_ptr(), memory.zeros_per_sample(BIG, like).data_ptr()}
    assert len(ptrs) == 2


def test_pooling_off_and_the_cap(monkeypatch):
    memory.release_pool()
    like = torch.ones(1)
    with memory.pooling(False):
        memory.zeros_per_sample(BIG, like)
    assert memory.pool_bytes() == 0
    monkeypatch.setattr(memory, "POOL_BYTES", 6 * 2**20)  # room for one 4 MiB buffer
    memory.zeros_per_sample(BIG, like)
    memory.zeros_per_sample((2048, 512), torch.ones(1, dtype=torch.float64))  # 8 MiB: too big
    held = [memory.zeros_per_sample(BIG, like) for _ in range(3)]
    assert memory.pool_bytes() <= 6 * 2**20 and len(held) == 3
    memory.release_pool()
    assert memory.pool_bytes() == 0


def test_buffers_made_in_inference_mode_are_reusable_outside_it():
    memory.release_pool()
    with torch.inference_mode():
        memory.zeros_per_sample(BIG, torch.ones(1))
    assert not memory.zeros_per_sample(BIG, torch.ones(1)).any()  # an in-place zero_ works
