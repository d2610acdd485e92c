"""Self-check of the distributed foundation: pass a tensor around the ring of ranks.

    torchrun --standalone --nproc-per-node 3 -m flexgen_dist.distributed.check --rounds 5
    MODULE=flexgen_dist.distributed.check launch/single_node.sh 3 --rounds 5

Rank 0 sends a tensor to rank 1, each rank adds 1 and forwards it, the last rank sends it back
to rank 0, which checks the sum; R rounds with isend/irecv. Prints on rank 0
"ring ok: world=W rounds=R bytes=B" and exits 0. For the failure tests, `--fail-rank K` makes
rank K raise mid-way, `--kill-rank K` makes it SIGKILL itself and `--hang-rank K` makes it
SIGSTOP itself; the other ranks must then exit non-zero within the timeout, naming rank K.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch

from flexgen_dist.distributed.comm import StageComm
from flexgen_dist.distributed.monitor import FailureMonitor
from flexgen_dist.distributed.topology import DistContext, detect_topology, print0, setup_rank_logging

log = logging.getLogger("flexgen_dist.check")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flexgen_dist.distributed.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, default=1 << 18, help="float32 elements per message")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds before a peer is dead")
    p.add_argument("--poll", type=float, default=1.0, help="failure monitor poll interval, s")
    p.add_argument("--monitor-timeout", type=float, default=None,
                   help="seconds without a heartbeat before a peer is dead (default: --timeout)")
    p.add_argument("--linger", type=float, default=0.0,
                   help="a failing rank reports, then waits this long before exiting (as if "
                        "cleaning up), so the others must learn of it from the failure monitor")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--backend", default=None, help="gloo or nccl (default: by device)")
    p.add_argument("--log-dir", default=None, help="write rank{r}.log files here")
    p.add_argument("--fail-round", type=int, default=None, help="default: rounds // 2")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--fail-rank", type=int, default=None, help="this rank raises mid-way")
    g.add_argument("--kill-rank", type=int, default=None, help="this rank SIGKILLs itself")
    g.add_argument("--hang-rank", type=int, default=None, help="this rank SIGSTOPs itself")
    args = p.parse_args(argv)
    if args.size < 1 or args.rounds < 1:
        p.error("--size and --rounds must be >= 1")
    if args.fail_round is None:
        args.fail_round = args.rounds // 2
    return args


def _maybe_fail(args: argparse.Namespace, rank: int, rnd: int) -> None:
    if rnd != args.fail_round or rank not in (args.fail_rank, args.kill_rank, args.hang_rank):
        return
    how = {args.fail_rank: "raise", args.kill_rank: "SIGKILL", args.hang_rank: "SIGSTOP"}[rank]
    # The time stamp lets tests measure how long the others take to notice.
    print(f"rank {rank}: failing on purpose ({how}) in round {rnd} at unix time {time.time():.3f}",
          file=sys.stderr, flush=True)
    if how == "raise":
        raise RuntimeError(f"rank {rank} failing on purpose (--fail-rank) in round {rnd}")
    logging.shutdown()
    os.kill(os.getpid(), signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)


def ring(ctx: DistContext, comm: StageComm, args: argparse.Namespace) -> int:
    """Run the ring; return the bytes moved over all links."""
    rank, world = ctx.rank, ctx.world_size
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    # Metadata goes around once with the blocking object path.
    meta = {"size": args.size, "rounds": args.rounds, "visited": []}
    if rank == 0:
        comm.send_obj(meta | {"visited": [0]}, nxt)
        meta = comm.recv_obj(prev)
    else:
        meta = comm.recv_obj(prev)
        comm.send_obj(meta | {"visited": meta["visited"] + [rank]}, nxt)
    expected_visited = list(range(world if rank == 0 else rank))
    if meta["visited"] != expected_visited or meta["size"] != args.size:
        raise RuntimeError(f"metadata came back wrong: {meta}")

    # One lap of token-id-like int64 data and bfloat16 data into a non-contiguous buffer.
    ids = torch.arange(12, device=ctx.device).reshape(3, 4)
    half = torch.linspace(-1, 1, 12, device=ctx.device).to(torch.bfloat16).reshape(4, 3)
    got_ids = torch.empty_like(ids)
    got_half = torch.empty(3, 4, dtype=torch.bfloat16, device=ctx.device).t()  # a strided view
    if rank == 0:
        comm.send(ids, nxt)
        comm.wait(comm.isend(half, nxt))
    comm.recv(ids.shape, ids.dtype, prev, out=got_ids)
    comm.wait(comm.irecv(got_half, prev))
    if rank != 0:
        comm.send(got_ids, nxt)
        comm.wait(comm.isend(got_half, nxt))
    if not (torch.equal(got_ids, ids) and torch.equal(got_half, half)):
        raise RuntimeError(f"rank {rank}: int64/bfloat16 data from rank {prev} came wrong")

    base = torch.arange(args.size, dtype=torch.float32, device=ctx.device) % 1000
    buf = torch.empty_like(base)
    for rnd in range(args.rounds):
        _maybe_fail(args, rank, rnd)
        start = base + 1000 * rnd
        if rank == 0:
            send = comm.isend(start, nxt)
            recv = comm.irecv(buf, prev)
            comm.wait(send)
            comm.wait(recv)
            expected = start + (world - 1)
        else:
            comm.wait(comm.irecv(buf, prev))
            expected = start + (rank - 1)
            if not torch.equal(buf, expected):
                raise RuntimeError(f"round {rnd}: rank {rank} got wrong data from rank {prev}")
            comm.wait(comm.isend(buf + 1, nxt))
            expected = None
        if expected is not None and not torch.equal(buf, expected):
            raise RuntimeError(f"round {rnd}: the tensor came back wrong to rank 0")
        log.info("round %d ok", rnd)
    return args.size * 4 * args.rounds * world


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    topo = detect_topology()
    if args.log_dir:
        setup_rank_logging(args.log_dir, topo.rank)
    ctx = DistContext.init(topo, args.device, args.backend, timeout_s=args.timeout)
    try:
        with FailureMonitor(ctx, None, poll_s=args.poll, timeout_s=args.monitor_timeout) as mon:
            t0 = time.perf_counter()
            try:
                nbytes = ring(ctx, StageComm(ctx), args)
            except Exception as exc:
                if args.linger > 0:
                    mon.report(exc)
                    time.sleep(args.linger)
                raise
            dt = time.perf_counter() - t0
        print0(f"ring ok: world={ctx.world_size} rounds={args.rounds} bytes={nbytes} "
               f"time={dt:.3f}s launcher={topo.launcher}", ctx=ctx, flush=True)
    finally:
        ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
