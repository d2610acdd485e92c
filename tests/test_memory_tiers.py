"""Sizes, peak accounting, the budget check, and copy_between across tensor/disk/QTensor."""
from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from flexgen_dist.budgets import Budgets, available_ram, check_budgets, machine_budgets, user_caps
from flexgen_dist.config import ConfigError
from flexgen_dist.plan import Peaks
from flexgen_dist.memory.disk import DiskStore
from flexgen_dist.memory.quant import dequantize, quantize
from flexgen_dist.memory.tiers import (MemoryBudgetError, MemoryTracker, Tier, copy_between, host_empty,
                                       pin_if_cuda, tensor_nbytes)
from flexgen_dist.memory.units import format_bytes, parse_size

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.uint8]


@pytest.fixture
def store(tmp_path: Path):
    with DiskStore(tmp_path / "offload") as s:
        yield s


def _rand(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


@pytest.mark.parametrize("text,expected", [
    ("16GiB", 16 * 2**30), ("512MB", 512 * 10**6), ("1.5G", 3 * 2**29), ("100", 100),
    ("0", 0), ("2 KiB", 2048), ("1k", 1024), ("3mib", 3 * 2**20), ("1TB", 10**12),
    ("7B", 7), (4096, 4096), (1.5e3, 1500), (" 1.5 GiB ", 3 * 2**29),
])
def test_parse_size(text: str | int | float, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12XB", "-1G", "1.2.3G", "GiB", -5, float("inf")])
def test_parse_size_rejects_with_the_bad_string(bad: str | float) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(bad)
    assert repr(bad) in str(info.value)


def test_format_bytes() -> None:
    assert format_bytes(3 * 2**29) == "1.50 GiB"
    assert format_bytes(512) == "512 B"
    assert format_bytes(2048) == "2.00 KiB"
    assert format_bytes(5 * 2**40) == "5.00 TiB"


def test_tracker_counts_peaks() -> None:
    t = MemoryTracker()
    t.add(Tier.GPU, 100)
    t.add("gpu", 50)
    t.sub(Tier.GPU, 120)
    t.add(Tier.DISK, 7)
    assert t.peak_bytes() == {"gpu": 150, "cpu": 0, "disk": 7}
    t.add(Tier.GPU, 200)  # 30 still counted: the peak is 230
    assert t.peak_bytes()["gpu"] == 230
    with pytest.raises(ValueError, match="frees must match"):
        t.sub(Tier.CPU, 1)
    with pytest.raises(ValueError, match="use sub"):
        t.add(Tier.CPU, -1)


def test_tracker_is_thread_safe() -> None:
    """The compute thread and the weight loader's threads count into one tracker, and a peak
    never falls. One thread adds ever larger amounts (each add raises the peak) while eight
    add and free one byte. Unlocked, a small adder switched out between computing its new
    peak and storing it (the switch interval set to a microsecond makes switches frequent)
    stores a stale, lower peak over the big one, which the big adder sees before its next
    add: with the lock removed this test failed six runs of six here (13 to 243 falls each)."""
    t = MemoryTracker()
    step, loops = 100, 30000
    done = threading.Event()
    fell: list[tuple[int, int]] = []

    def small() -> None:
        while not done.is_set():
            t.add(Tier.CPU, 1)
            t.sub(Tier.CPU, 1)

    def big() -> None:
        try:
            for k in range(1, loops + 1):
                peak = t.peak_bytes()["cpu"]
                if peak < (k - 1) * step:  # the last add reached (k - 1) * step
                    fell.append((k, peak))
                t.add(Tier.CPU, k * step)
                t.sub(Tier.CPU, k * step)
        finally:
            done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=small) for _ in range(8)] + [threading.Thread(target=big)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert not fell, f"the peak fell {len(fell)} times, e.g. {fell[0]}"
    assert t.peak_bytes()["cpu"] >= loops * step
    with pytest.raises(ValueError, match="frees must match"):
        t.sub(Tier.CPU, 1)  # every add was freed: nothing is left counted


def test_budget_check_names_tier_peak_cap_and_stage() -> None:
    """The run's budget check (on predicted peaks, before anything is allocated): a GPU
    machine checks each tier against its cap, naming the flag the user gave."""
    gpu = dict(pooled=False, given=("gpu", "disk"))
    check_budgets(Peaks(2 * 2**30, 10**15, 0), Budgets(gpu=2 * 2**30, cpu=None, disk=0, **gpu))
    with pytest.raises(MemoryBudgetError) as info:
        check_budgets(Peaks(int(3.2 * 2**30), 0, 0), Budgets(gpu=2 * 2**30, **gpu), stage=1)
    msg = str(info.value)
    assert msg.startswith("predicted GPU memory peak 3.20 GiB on stage 1 exceeds --gpu-mem 2.00 GiB: lower ")
    assert "--percent" in msg
    with pytest.raises(MemoryBudgetError, match="exceeds --disk-mem 10 B"):
        check_budgets(Peaks(0, 0, 11), Budgets(disk=10, **gpu))


def test_budget_check_pools_ram_without_a_gpu() -> None:
    """Without a GPU the compute tier is RAM too: both tiers are checked together, and a
    budget that came from the machine says so."""
    machine = Budgets(gpu=None, cpu=10 * 2**30, disk=None, pooled=True, source="available memory")
    check_budgets(Peaks(6 * 2**30, 4 * 2**30, 0), machine)  # exactly the pool
    with pytest.raises(MemoryBudgetError) as info:
        check_budgets(Peaks(6 * 2**30, 5 * 2**30, 0), machine)
    msg = str(info.value)
    assert msg.startswith("predicted RAM peak 11.00 GiB (compute tier 6.00 GiB + host tier 5.00 GiB) exceeds "
                          "the 10.00 GiB of RAM this process may use (available memory): ")
    assert "--policy auto" in msg
    given = Budgets(gpu=None, cpu=8 * 2**30, pooled=True, given=("cpu",))
    with pytest.raises(MemoryBudgetError, match=r"exceeds --cpu-mem 8.00 GiB"):
        check_budgets(Peaks(9 * 2**30, 0, 0), given)


def test_machine_budgets_fill_what_the_user_left_out(tmp_path) -> None:
    caps = user_caps(None, "3GiB", None)
    b = machine_budgets(caps, torch.device("cpu"), str(tmp_path / "not-yet" / "offload"))
    assert b.pooled and b.given == ("cpu",) and b.cpu == 3 * 2**30 and b.gpu is None
    assert b.disk is not None and b.disk > 0  # the free space of the nearest existing parent
    free = machine_budgets(user_caps(None, None, None), torch.device("cpu"), str(tmp_path))
    assert free.given == () and 0 < free.cpu <= available_ram()[0] * 1.5
    with pytest.raises(ConfigError, match="--gpu-mem 'lots'"):
        user_caps("lots", None, None)


def test_planner_sees_the_pooled_ram_split_between_its_two_tiers() -> None:
    """On a CPU-only machine the LP's compute and host tiers share the RAM budget: halves,
    or the user's compute-tier cap and the rest where that cap is below the pool."""
    from flexgen_dist.planner.auto import _within
    from flexgen_dist.planner.hardware import HardwareSpec

    hw = HardwareSpec.from_yaml(Path(__file__).resolve().parents[1] / "configs" / "hardware" / "cpu-2core.yaml")
    gib = 2**30
    halves = _within(hw, Budgets(cpu=8 * gib, pooled=True, given=("cpu",)))
    assert (halves.gpu_mem, halves.cpu_mem) == (4 * gib, 4 * gib)
    capped = _within(hw, Budgets(gpu=3 * gib, cpu=8 * gib, pooled=True, given=("gpu", "cpu")))
    assert (capped.gpu_mem, capped.cpu_mem) == (3 * gib, 5 * gib)
    above = _within(hw, Budgets(gpu=8 * gib, cpu=8 * gib, pooled=True, given=("gpu", "cpu")))
    assert above.gpu_mem + above.cpu_mem == 8 * gib and above.cpu_mem > 0


def test_tensor_nbytes(store: DiskStore) -> None:
    x = torch.zeros(10, 3, dtype=torch.float16)
    assert tensor_nbytes(x) == 60
    assert tensor_nbytes(x[::2]) == 30  # elements, not the underlying storage
    assert tensor_nbytes(store.allocate("d", (10, 3), torch.bfloat16)) == 60
    q = quantize(torch.randn(4, 128), bits=4, group_size=64)
    assert tensor_nbytes(q) == 4 * 64 + 2 * 4 * 2 * 4
    with pytest.raises(TypeError):
        tensor_nbytes([1, 2])


def test_copy_tensor_to_tensor_with_rows() -> None:
    src = torch.arange(20.0).reshape(10, 2)
    dst = torch.zeros(6, 2)
    copy_between(dst, src, dst_rows=(1, 4), src_rows=(5, 8))
    assert torch.equal(dst[1:4], src[5:8])
    assert torch.equal(dst[0], torch.zeros(2)) and torch.equal(dst[4:], torch.zeros(2, 2))
    with pytest.raises(ValueError, match="shapes differ"):
        copy_between(dst, src, src_rows=(0, 3))
    with pytest.raises(ValueError, match="out of range"):
        copy_between(dst, src, dst_rows=(4, 7), src_rows=(0, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_tensor_disk_roundtrip_with_rows(store: DiskStore, dtype: torch.dtype) -> None:
    x = _rand((33, 7, 5), dtype)  # 35 elements per row: rows straddle 4 KiB blocks
    d = store.allocate("x", x.shape, dtype)
    copy_between(d, x)
    back = torch.empty_like(x)
    copy_between(back, d)
    assert torch.equal(back, x)

    patch = _rand((9, 7, 5), dtype, seed=1)
    copy_between(d, patch, dst_rows=(11, 18), src_rows=(2, 9))
    expected = x.clone()
    expected[11:18] = patch[2:9]
    part = torch.zeros(12, 7, 5, dtype=dtype)
    copy_between(part, d, dst_rows=(2, 12), src_rows=(10, 20))
    assert torch.equal(part[2:12], expected[10:20])
    assert torch.equal(part[:2], torch.zeros(2, 7, 5, dtype=dtype))
    full = torch.empty_like(x)
    copy_between(full, d)
    assert torch.equal(full, expected)


def test_copy_disk_to_disk_and_noncontiguous(store: DiskStore) -> None:
    x = _rand((20, 6), torch.float16)
    a = store.allocate("a", (20, 6), torch.float16)
    b = store.allocate("b", (8, 6), torch.float16)
    copy_between(a, x.t().contiguous().t())  # same values, column-major source
    copy_between(b, a, dst_rows=(0, 8), src_rows=(12, 20))
    assert torch.equal(b.read(), x[12:20])
    out = torch.zeros(6, 20, dtype=torch.float16).t()  # non-contiguous destination
    copy_between(out, a)
    assert torch.equal(out, x)
    with pytest.raises(ValueError, match="shapes differ"):
        copy_between(b, a)


def test_copy_qtensor_through_disk_with_rows(store: DiskStore) -> None:
    x = torch.randn(6, 10, 64, generator=torch.Generator().manual_seed(5)).half()
    q = quantize(x, bits=4, group_size=32)
    on_disk = store.allocate_qtensor("kv", x.shape, x.dtype, bits=4, group_size=32)
    assert tensor_nbytes(on_disk) == q.nbytes
    copy_between(on_disk, q, dst_rows=(0, 3), src_rows=(0, 3))
    copy_between(on_disk, q, dst_rows=(3, 6), src_rows=(3, 6))
    back = quantize(torch.zeros_like(x), bits=4, group_size=32)
    copy_between(back, on_disk)
    assert torch.equal(dequantize(back), dequantize(q))
    with pytest.raises(TypeError, match="QTensor"):
        copy_between(torch.empty_like(x), q)
    with pytest.raises(ValueError, match="layouts differ"):
        copy_between(quantize(x, bits=8, group_size=32), q)


def test_pin_if_cuda_is_identity_for_cpu() -> None:
    t = torch.ones(3)
    assert pin_if_cuda(t, torch.device("cpu")) is t


def test_host_empty_is_plain_ram_for_a_cpu_device() -> None:
    t = host_empty((2, 3), torch.bfloat16, "cpu", zero=True)
    assert t.device.type == "cpu" and t.dtype == torch.bfloat16 and t.shape == (2, 3) and not t.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_empty_is_pinned_for_a_gpu_and_a_quantized_cache_can_be_too() -> None:
    from flexgen_dist.memory.quant import empty_qtensor

    t = host_empty((4, 5), torch.float16, torch.device("cuda"), zero=True)
    assert t.device.type == "cpu" and t.is_pinned() and not t.any()
    q = empty_qtensor((4, 64), torch.float16, device="cpu", pin_memory=True)
    assert q.data.is_pinned() and q.mins.is_pinned() and q.scales.is_pinned() and not q.data.any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_cuda_disk_roundtrip(store: DiskStore, dtype: torch.dtype) -> None:
    x = _rand((33, 7, 5), dtype).cuda()
    d = store.allocate("x", x.shape, dtype)
    copy_between(d, x)
    back = torch.zeros_like(x)
    copy_between(back, d, dst_rows=(3, 20), src_rows=(3, 20), non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back[3:20], x[3:20])
    assert pin_if_cuda(torch.ones(3), torch.device("cuda")).is_pinned()
