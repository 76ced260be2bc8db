"""``deepspeed.moe.utils``: the helpers scripts call on every model, MoE or not, when they build
their parameter groups. zerocore has no expert parallelism: a model without expert parameters gets
its groups back unchanged; expert parameters are refused, naming one."""
from __future__ import annotations


def is_moe_param(param) -> bool:
    """An expert parameter (DeepSpeed marks them ``allreduce = False``)."""
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """``param_groups`` (a dict or a list of dicts, as for a torch optimizer) as a list of groups.
    Raises ValueError when a group holds an expert parameter."""
    groups = [param_groups] if isinstance(param_groups, dict) else list(param_groups)
    for i, group in enumerate(groups):
        for p in group["params"]:
            if is_moe_param(p):
                raise ValueError(f"zerocore.deepspeed.moe: param group {i} ({group.get('name', 'unnamed')}) holds "
                                 f"an expert parameter of shape {tuple(p.shape)}; zerocore has no expert "
                                 "parallelism")
    return groups
