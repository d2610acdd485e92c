"""Entry point: ``python -m flexgen_dist.planner {plan,profile} ...`` (see ``cli.py``)."""
import sys

from flexgen_dist.planner.cli import main

sys.exit(main())
