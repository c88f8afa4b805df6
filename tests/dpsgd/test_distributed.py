"""DP-SGD across two processes (gloo on CPU) equals the single-process step.

Each rank clips its half of the batch; rank 0 adds the noise; the noised sums are
all-reduced. The result must equal one process clipping the whole batch with the same noise
seed. Rendezvous through a file (no network port).
"""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from workbench.dpsgd import DPOptimizer

SIGMA, C, B = 0.8, 0.5, 8.0


def model_and_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x = torch.randn(8, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (8,))
    return model, x, y


def dp_step(model, x, y, inner=None):
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), inner or model,
                      noise_multiplier=SIGMA, max_grad_norm=C, expected_batch_size=B,
                      loss_reduction="sum", generator=torch.Generator().manual_seed(7))
    opt.zero_grad()
    nn.CrossEntropyLoss(reduction="sum")(model(x), y).backward()
    opt.step()
    opt.detach()
    return [p.grad.clone() for p in (inner or model).parameters()]


def hard_exit():
    """End a worker once its results are saved, skipping interpreter teardown: gloo's C++
    destructors sometimes abort there (SIGABRT, "terminate called without an active
    exception"), one run in a few on a loaded machine, which spawn reports as a failure."""
    import os
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker(rank, world, store, out):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, x, y = model_and_batch()
    ddp = DistributedDataParallel(model)
    half = slice(rank * 4, rank * 4 + 4)
    grads = dp_step(ddp, x[half], y[half], inner=model)
    if rank == 0:
        torch.save(grads, out)
    del ddp  # DDP's reducer threads end before the group does (else gloo may abort)
    dist.barrier()
    dist.destroy_process_group()
    hard_exit()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_two_process_step_equals_single_process(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(worker, args=(2, str(tmp_path / "store"), str(out)), nprocs=2, join=True)
    distributed = torch.load(out)
    model, x, y = model_and_batch()
    single = dp_step(model, x, y)
    for a, b in zip(distributed, single):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def engine_worker(rank, world, store, out):
    from torch.utils.data import DataLoader, TensorDataset

    import workbench as wb

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.arange(40) % 3)
    model, _, _ = model_and_batch()
    engine = wb.PrivacyEngine()
    ddp = DistributedDataParallel(model)
    _, opt, loader = engine.make_private(
        module=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        sampling_generator=torch.Generator().manual_seed(rank))
    seen = []
    for x, y in loader:
        opt.zero_grad()
        nn.CrossEntropyLoss()(ddp(x), y).backward()
        opt.step()
        seen += y.tolist()
    torch.save({"rank": rank, "steps": len(engine.accountant), "n": len(loader),
                "B": opt.expected_batch_size, "shard": len(loader.dataset)}, f"{out}.{rank}")
    opt.detach()
    del ddp, opt  # DDP's reducer threads end before the group does (else gloo may abort)
    dist.barrier()
    dist.destroy_process_group()
    hard_exit()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_engine_under_ddp_samples_each_rank_shard(tmp_path):
    out = str(tmp_path / "engine")
    mp.spawn(engine_worker, args=(2, str(tmp_path / "store2"), out), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(f"{out}.{rank}")
        assert r["shard"] == 20 and r["B"] == 8.0  # q = 8/40 of the whole set, global B
        assert r["steps"] == r["n"] == 5  # every logical step accounted on each rank


def spawn_two(worker, tmp_path, name):
    """Run ``worker`` on two gloo ranks; what rank 0 saved."""
    out = str(tmp_path / f"{name}.pt")
    mp.spawn(worker, args=(2, str(tmp_path / f"{name}.store"), out), nprocs=2, join=True)
    return torch.load(out)


def stall_worker(rank, world, store, out):
    import os
    import time

    from workbench.dpsgd.distributed import CollectiveTimeoutError, all_reduce

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    summed = all_reduce(torch.full((3,), rank + 1.0), timeout_minutes=0.5, name="warm-up")
    if rank == 1:  # the stalled rank: never joins the next collective
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        hard_exit()
    start = time.monotonic()
    try:
        all_reduce(torch.zeros(2, 2), timeout_minutes=0.02, name="noised sum of fc.weight")
        message = None
    except CollectiveTimeoutError as e:
        message = str(e)
    torch.save({"summed": summed, "message": message, "waited": time.monotonic() - start}, out)
    hard_exit()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_stalled_rank_times_out_naming_the_collective(tmp_path):
    r = spawn_two(stall_worker, tmp_path, "stall")
    assert torch.equal(r["summed"], torch.full((3,), 3.0))  # the healthy all-reduce sums
    assert r["message"] is not None and 1.0 < r["waited"] < 30  # 0.02 min = 1.2 s, not 30 min
    assert "'noised sum of fc.weight'" in r["message"]
    assert "within 0.02 minutes on rank 0 of 2" in r["message"]
    assert "all_reduce_timeout_minutes" in r["message"]


def test_all_reduce_needs_a_process_group_and_a_valid_timeout():
    from workbench.dpsgd.distributed import all_reduce

    with pytest.raises(ValueError, match="all_reduce_timeout_minutes must be .* got 0"):
        all_reduce(torch.zeros(1), timeout_minutes=0)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match=r"'noise' needs torch.distributed initialised"):
            all_reduce(torch.zeros(1), name="noise")


def engine_stall_worker(rank, world, store, out):
    import os
    import time

    from torch.utils.data import DataLoader, TensorDataset

    import workbench as wb
    from workbench.dpsgd.distributed import CollectiveTimeoutError

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    model, _, _ = model_and_batch()
    engine = wb.PrivacyEngine()
    data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.arange(40) % 3)
    _, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        data_loader=DataLoader(data, batch_size=8), noise_multiplier=1.0, max_grad_norm=1.0,
        all_reduce_timeout_minutes=0.02, sampling_generator=torch.Generator().manual_seed(rank))
    if rank == 1:  # the stalled rank: never takes its step
        deadline = time.monotonic() + 60
        while not os.path.exists(out) and time.monotonic() < deadline:
            time.sleep(0.05)
        hard_exit()
    before = [p.detach().clone() for p in model.parameters()]
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.CrossEntropyLoss()(model(x), y).backward()
    start = time.monotonic()
    try:
        opt.step()
        message = None
    except CollectiveTimeoutError as e:
        message = str(e)
    torch.save({"message": message, "waited": time.monotonic() - start,
                "steps": len(engine.accountant),
                "moved": any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))},
               out)
    hard_exit()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_engine_step_with_a_stalled_rank_times_out_unaccounted_and_unmoved(tmp_path):
    r = spawn_two(engine_stall_worker, tmp_path, "engine_stall")
    assert r["message"] is not None and 1.0 < r["waited"] < 30, r  # 1.2 s, not 30 min
    assert "within 0.02 minutes on rank 0 of 2" in r["message"]
    assert r["steps"] == 0 and not r["moved"]  # nothing moved, nothing accounted


def shuffled_worker(rank, world, store, out):
    import warnings

    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    import workbench as wb

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    warnings.simplefilter("ignore")
    data = TensorDataset(torch.randn(32, 5, dtype=torch.float64), torch.arange(32))
    model, _, _ = model_and_batch()
    result = {}
    for kind in ("random", "distributed"):
        ddp = DistributedDataParallel(model)
        sampler = RandomSampler(data) if kind == "random" else DistributedSampler(data)
        engine = wb.PrivacyEngine()
        try:
            _, opt, loader = engine.make_private(
                module=ddp, optimizer=torch.optim.SGD(ddp.parameters(), lr=0.1),
                data_loader=DataLoader(data, batch_size=4, sampler=sampler),
                noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)
        except ValueError as err:
            result[kind] = str(err)
            continue
        seen = torch.zeros(32, dtype=torch.long)
        for x, i in loader:
            seen[i] += 1
            opt.zero_grad()
            ddp(x).pow(2).sum(1).mean().backward()
            opt.step()
        dist.all_reduce(seen)
        bounds = engine.epsilon_bounds(1e-5)
        result[kind] = (bounds.upper, engine.sample_rate, len(loader), int(seen.min()),
                        int(seen.max()))
        opt.detach()
        del ddp, opt
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()
    hard_exit()


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available")
def test_shuffled_batches_under_ddp_need_a_distributed_sampler(tmp_path):
    """Every rank's RandomSampler covers all N: a step's batches can hold a record twice and
    a pass holds each record once per rank, which the bracket charged as one (4.38 for
    6.57 at 2 ranks, until 2026-11-30): refused. A DistributedSampler shares the records
    out: each once a pass, the bracket's one epoch."""
    import workbench as wb

    result = spawn_two(shuffled_worker, tmp_path, "shuffled")
    assert "DistributedSampler" in result["random"] and "2 x max_grad_norm" in result["random"]
    upper, q, T, least, most = result["distributed"]
    assert least == most == 1  # each record once in the pass, over both ranks
    ref = wb.accounting.epsilon_bounds("shuffle", sample_rate=q, noise_multiplier=1.0,
                                       epochs=1, delta=1e-5, batches_per_epoch=T)
    assert upper == ref.upper
