"""Planning (pure Python, no ``torch.distributed``): profiles, alpha-beta cost model, timeline
simulator and planners that turn a profile into a :class:`~lightning_pipedap.schedule.Schedule`, and the
cost of gradient compression (:class:`CompressionCost`) that makes planning compression-aware.

Typical use::

    from lightning_pipedap.plan import CostModel, get_planner, load_profile, simulate
    prof = load_profile("resnet50")
    cm = CostModel.from_allreduce(alpha_s=1.3e-3, beta_s_per_byte=6e-11)
    sched = get_planner("optimal")(prof, cm, world_size=8)
    print(sched.describe(), sched.predicted_iteration_s, simulate(prof, cm, sched).exposed_comm_s)
"""

from lightning_pipedap.plan.bounds import LowerBounds, lower_bounds
from lightning_pipedap.plan.compression import CompressionCost, fit_compression_cost
from lightning_pipedap.plan.contention import (
    ContendedResult, Contention, contended_pair, fit_contention, simulate_contended,
)
from lightning_pipedap.plan.cost_model import AlphaBeta, CostModel, fit_alpha_beta, fit_cost_model, load_cost_model
from lightning_pipedap.plan.evaluator import Evaluator
from lightning_pipedap.plan.planners import PLANNERS, get_planner
from lightning_pipedap.plan.profile import (
    LayerProfile, ModelProfile, load_profile, load_reference_profile, save_profile, shared_profiles_dir,
)
from lightning_pipedap.plan.sharding import Sharding
from lightning_pipedap.plan.simulator import SimResult, simulate, to_op_records

__all__ = [
    "AlphaBeta", "CompressionCost", "ContendedResult", "Contention", "CostModel", "Evaluator", "LayerProfile",
    "LowerBounds", "ModelProfile", "PLANNERS", "Sharding", "SimResult", "contended_pair", "fit_alpha_beta",
    "fit_compression_cost", "fit_contention", "fit_cost_model", "get_planner", "load_cost_model", "load_profile",
    "load_reference_profile", "lower_bounds", "save_profile", "shared_profiles_dir", "simulate", "simulate_contended",
    "to_op_records",
]
