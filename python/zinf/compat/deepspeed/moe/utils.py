"""deepspeed.moe.utils (zinf): with no MoE layers every parameter is a dense one."""


def is_moe_param(param):
    return False


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """The groups as they are (no expert parameters to split off); a dict becomes [dict]."""
    if isinstance(param_groups, tuple):
        return list(param_groups)
    if isinstance(param_groups, dict):
        return [param_groups]
    return param_groups


def split_params_grads_into_shared_and_expert_params(group):
    return list(group), []
