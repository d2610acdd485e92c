"""Choosing a policy per stage: hardware specs, the cost model, and the LP search.

See docs/planner.md. Imports models/, engine/ (policy, peaks), memory/, the run's config and
budgets, and of distributed/ only the layer split (partition.py) and the item stream it
replays (items.py): never the stage engine, the pipeline loop or the communicator.
"""
from flexgen_dist.planner.cost_model import (StageCost, WorkShape, estimate_pipeline,
                                             estimate_stage)
from flexgen_dist.planner.hardware import HardwareSpec
from flexgen_dist.planner.profile_cache import load_or_profile
from flexgen_dist.planner.profiler import profile_hardware
from flexgen_dist.planner.pipeline import PipelinePlan, PlannedStage, plan_pipeline
from flexgen_dist.planner.search import PlanError, plan_stage

__all__ = ["HardwareSpec", "PipelinePlan", "PlanError", "StageCost", "PlannedStage", "WorkShape",
           "estimate_pipeline", "estimate_stage", "load_or_profile",
           "plan_pipeline", "plan_stage", "profile_hardware"]
