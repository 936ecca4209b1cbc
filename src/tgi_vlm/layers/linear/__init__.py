"""Linear layers with one owner: a kernel per layer, chosen once at load by the plan (plan.py).

kernels.py   the ways of computing `x @ W.T + b` (torch, bucketed torch, oneDNN packed, MKL packed, MKL + native loop)
modules.py   `KernelLinear` (an nn.Linear computed by its kernel, with an optional extra term) and patch convolutions
fused.py     sibling projections (q/k/v, gate/up) as one product of one kernel
plan.py      `plan_linears`: the rules, the logged `LinearPlan`, warmup's kernel priming
"""

from tgi_vlm.layers.linear.fused import FusedProjections, fused_group, fused_groups
from tgi_vlm.layers.linear.kernels import LinearExtra, LinearKernel, PlainWeights
from tgi_vlm.layers.linear.modules import KernelLinear
from tgi_vlm.layers.linear.plan import LinearPlan, PlanOptions, plan_linears, prime_packed_kernels

__all__ = ["FusedProjections", "KernelLinear", "LinearExtra", "LinearKernel", "LinearPlan", "PlainWeights",
           "PlanOptions", "fused_group", "fused_groups", "plan_linears", "prime_packed_kernels"]
