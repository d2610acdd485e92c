"""``python -m flexgen_dist.bench SUBCOMMAND ...``: benchmarks that take a subcommand.

The other benchmarks are modules of their own (``python -m flexgen_dist.bench.single``, ...).
"""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module under flexgen_dist.bench with a main(argv) -> int, one line on what it does)
SUBCOMMANDS = {
    "compare": ("compare", "the same run job on a git revision and on the working tree, side by side"),
    "compare-attention": ("attention_compare", "the CPU decode-attention kernel of a git revision against the "
                          "working tree's, in one process"),
}


def usage() -> str:
    w = max(map(len, SUBCOMMANDS))
    lines = ["usage: python -m flexgen_dist.bench {" + ",".join(SUBCOMMANDS) + "} ...", "", "subcommands:"]
    lines += [f"  {name:<{w}}  {what}" for name, (_, what) in SUBCOMMANDS.items()]
    lines += ["", "`python -m flexgen_dist.bench SUBCOMMAND --help` for its options; the other benchmarks",
              "run as modules: python -m flexgen_dist.bench.{single,offload,scaling,accuracy,...}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        if argv:
            print(f"error: unknown subcommand '{argv[0]}'", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 2
    module = importlib.import_module(f"flexgen_dist.bench.{SUBCOMMANDS[argv[0]][0]}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
