"""deepspeed.moe (zinf): no mixture-of-experts layers; the grouping helpers are the identity."""
from . import utils  # noqa: F401


class MoE:
    def __init__(self, *args, **kwargs):
        import zinf
        raise zinf.ZinfError("deepspeed.moe.layer.MoE: zinf has no expert parallelism; build "
                             "the experts as ordinary modules (every rank holds a partition of "
                             "each, as any parameter)")
