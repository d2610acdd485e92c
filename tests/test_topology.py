"""Topology from launcher environments, Slurm host lists, layer partitions, logging helpers."""

from __future__ import annotations

import logging

import pytest

from flexgen_dist.distributed.partition import partition_layers
from flexgen_dist.distributed.topology import (
    DistContext,
    Topology,
    detect_topology,
    expand_hostlist,
    main as topology_main,
    print0,
    rank_log_path,
    setup_rank_logging,
)

TORCHRUN = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
            "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000"}
OMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "0", "MASTER_ADDR": "host0"}
SLURM = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0",
         "SLURM_JOB_NODELIST": "node[01-03,07],other"}


def test_torchrun_env() -> None:
    t = detect_topology(TORCHRUN)
    assert t == Topology(3, 4, 1, "10.0.0.5", 31000, "torchrun")
    assert t.is_last and not t.is_first and t.prev_rank == 2 and t.next_rank is None


def test_mpirun_env_and_master_sources() -> None:
    t = detect_topology(OMPI)
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.master_port, t.launcher) == (
        1, 2, 0, "host0", 29500, "mpirun")
    assert detect_topology(OMPI, master_addr="h9", master_port=4000).master_addr == "h9"
    assert detect_topology(OMPI | {"MASTER_PORT": "4100"}).master_port == 4100
    assert detect_topology(OMPI, master_port=4000).master_port == 4000


def test_mpirun_without_master_is_a_clear_error() -> None:
    env = {k: v for k, v in OMPI.items() if k != "MASTER_ADDR"}
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        detect_topology(env)
    one = env | {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1"}
    assert detect_topology(one).master_addr == "127.0.0.1"


def test_slurm_env_master_is_first_host() -> None:
    t = detect_topology(SLURM)
    assert (t.rank, t.world_size, t.local_rank, t.master_addr, t.launcher) == (
        2, 4, 0, "node01", "slurm")
    assert detect_topology(SLURM | {"MASTER_ADDR": "10.1.1.1"}).master_addr == "10.1.1.1"
    # In an srun step the step's size wins over the allocation's.
    step = SLURM | {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "3"}
    assert detect_topology(step).world_size == 3


def test_slurm_batch_shell_is_a_single_process() -> None:
    # sbatch's own shell has SLURM_PROCID=0 and the allocation's SLURM_NTASKS but is 1 process.
    env = SLURM | {"SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}
    assert detect_topology(env).launcher == "single"


def test_single_process_defaults() -> None:
    t = detect_topology({})
    assert t == Topology(0, 1, 0, "127.0.0.1", 29500, "single")
    assert t.is_first and t.is_last and t.prev_rank is None and t.next_rank is None


def test_launcher_precedence() -> None:
    assert detect_topology(SLURM | TORCHRUN).launcher == "torchrun"  # torchrun under srun
    assert detect_topology(SLURM | OMPI).launcher == "mpirun"
    assert detect_topology(SLURM | OMPI | TORCHRUN).launcher == "torchrun"


def test_bad_environment_values() -> None:
    with pytest.raises(ValueError, match="RANK"):
        detect_topology(TORCHRUN | {"RANK": "x"})
    with pytest.raises(ValueError, match="rank"):
        detect_topology(TORCHRUN | {"RANK": "4"})
    with pytest.raises(ValueError, match="MASTER_PORT"):
        detect_topology(TORCHRUN | {"MASTER_PORT": "70000"})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(rank=2, world_size=2), "rank"),
        (dict(rank=-1), "rank"),
        (dict(world_size=0, rank=0), "world_size"),
        (dict(local_rank=5), "local_rank"),
        (dict(master_addr=""), "MASTER_ADDR"),
        (dict(master_port=0), "master_port"),
        (dict(launcher="pbs"), "launcher"),
        (dict(launcher="single"), "single"),
    ],
)
def test_topology_validation(kwargs: dict, match: str) -> None:
    base = dict(rank=0, world_size=2, local_rank=0, master_addr="h", master_port=29500,
                launcher="torchrun")
    with pytest.raises(ValueError, match=match):
        Topology(**(base | kwargs))


def test_middle_rank_neighbours() -> None:
    t = Topology(1, 3, 1, "h", 29500, "torchrun")
    assert (t.prev_rank, t.next_rank, t.is_first, t.is_last) == (0, 2, False, False)


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[01-03,07],other", ["node01", "node02", "node03", "node07", "other"]),
        ("gpu1", ["gpu1"]),
        ("a,b", ["a", "b"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("r[1-2]-c[1,3]", ["r1-c1", "r1-c3", "r2-c1", "r2-c3"]),
        ("x[1-2],y[05]", ["x1", "x2", "y05"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[3-1]", "n[1-2", "n1-2]", "n[a]", "n[1-2]]"])
def test_expand_hostlist_errors(text: str) -> None:
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_hostlist_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert topology_main(["--first", "node[07-08]"]) == 0
    assert capsys.readouterr().out == "node07\n"
    assert topology_main(["a[1-2]"]) == 0
    assert capsys.readouterr().out == "a1\na2\n"


@pytest.mark.parametrize(
    "layers, stages, expected",
    [
        (12, 1, [(0, 12)]),
        (12, 4, [(0, 3), (3, 6), (6, 9), (9, 12)]),
        (10, 4, [(0, 3), (3, 6), (6, 8), (8, 10)]),
        (30, 4, [(0, 8), (8, 16), (16, 23), (23, 30)]),
        (3, 3, [(0, 1), (1, 2), (2, 3)]),
    ],
)
def test_partition_equal(layers: int, stages: int, expected: list[tuple[int, int]]) -> None:
    ranges = partition_layers(layers, stages)
    assert ranges == expected
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_partition_explicit() -> None:
    assert partition_layers(10, 3, [2, 5, 3]) == [(0, 2), (2, 7), (7, 10)]


@pytest.mark.parametrize(
    "layers, stages, stage_layers, match",
    [
        (4, 5, None, "at most 4"),
        (0, 1, None, "num_layers"),
        (4, 0, None, "num_stages"),
        (10, 3, [2, 5, 2], "sums to 9"),
        (10, 3, [0, 5, 5], "at least 1"),
        (10, 3, [5, 5], "2 entries"),
    ],
)
def test_partition_errors(layers: int, stages: int, stage_layers: list[int] | None,
                          match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition_layers(layers, stages, stage_layers)


def test_print0(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "1")
    print0("hidden")
    monkeypatch.setenv("RANK", "0")
    print0("shown", 1)
    assert capsys.readouterr().out == "shown 1\n"
    with DistContext.init(detect_topology({})) as ctx:
        monkeypatch.setenv("RANK", "1")  # ctx wins over the environment
        print0("from ctx", ctx=ctx)
    assert capsys.readouterr().out == "from ctx\n"


def test_world_one_context_has_no_process_group() -> None:
    import torch.distributed as dist

    ctx = DistContext.init(detect_topology({}), timeout_s=5)
    assert (ctx.backend, str(ctx.device), ctx.timeout_s) == ("gloo", "cpu", 5.0)
    assert not dist.is_initialized()
    ctx.barrier()
    ctx.close()
    ctx.close()  # idempotent
    with pytest.raises(ValueError, match="device_kind"):
        DistContext.init(detect_topology({}), device_kind="tpu")
    with pytest.raises(ValueError, match="nccl"):
        DistContext.init(detect_topology({}), backend="nccl")


def test_rank_logging(tmp_path) -> None:
    logger = logging.getLogger("flexgen_dist")
    before = list(logger.handlers)
    try:
        path = setup_rank_logging(tmp_path / "logs", 3)
        assert path == rank_log_path(tmp_path / "logs", 3) == tmp_path / "logs" / "rank3.log"
        setup_rank_logging(tmp_path / "logs", 3)  # again: replaces, does not duplicate
        logging.getLogger("flexgen_dist.test").info("hello from a child logger")
        for h in logger.handlers:
            h.flush()
        assert path.read_text().count("hello from a child logger") == 1
        assert "rank3" in path.read_text()
    finally:
        for h in list(logger.handlers):
            if h not in before:
                logger.removeHandler(h)
                h.close()
