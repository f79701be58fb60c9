"""DeepSpeed's entry points over zinf, so that a trainer written for DeepSpeed runs with
`import zinf as deepspeed`:

    model_engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset)

initialize() called this way (the model as a keyword, or args first) returns DeepSpeed's
4-tuple and a DeepSpeedEngine (engine.py); add_config_arguments and init_distributed are
DeepSpeed's too.
"""
import argparse
import os

import torch

from .. import _distributed, _initialize, _optim
from .._config import Config
from .._errors import error
from .engine import DeepSpeedEngine


def initialize(args=None, model=None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port=None, mpu=None,
               dist_init_required=None, collate_fn=None, config=None, config_params=None,
               device=None, scale_wrt_gas=True):
    """DeepSpeed's initialize (see zinf.initialize)."""
    _distributed.from_env()  # a malformed launcher environment fails before anything is built
    if mpu is not None:
        raise error("NotSupported", "zinf.initialize: model parallelism (mpu) is not provided")
    if config is not None and config_params is not None:
        raise error("InvalidArgument", "zinf.initialize: config and config_params are both "
                                       "given; pass one")
    config = config if config is not None else config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if from_args is not None and config is not None:
        raise error("InvalidArgument", "zinf.initialize: a config came both in args "
                                       "(--deepspeed_config) and in the call; pass one")
    cfg = Config(config if config is not None else from_args)
    tree = dict(cfg.tree or {})

    plan = None
    client = optimizer
    if client is not None and not isinstance(client, torch.optim.Optimizer):
        if callable(client):  # DeepSpeed accepts a factory of the parameters
            params = model_parameters if model_parameters is not None else model.parameters()
            client = client(params)
        else:
            raise TypeError("optimizer must be a torch.optim.Optimizer or a callable")
    if client is not None:
        # The client optimizer's groups (DeepSpeed trains what it holds).
        tree["optimizer"], plan = _optim.from_torch(client, tree.get("optimizer"))
        if cfg.tree is not None:
            cfg = Config(tree)
    elif model_parameters is not None:
        plan = _optim.model_parameter_groups(model_parameters,
                                             _initialize.hyperparameters(cfg))

    engine = _initialize.build(model, cfg, device=device, scale_wrt_gas=scale_wrt_gas,
                               engine_class=DeepSpeedEngine, client_optimizer=client,
                               lr_scheduler=lr_scheduler, plan=plan)
    if training_data is not None:
        engine.training_dataloader = engine.deepspeed_io(training_data, collate_fn=collate_fn)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def add_config_arguments(parser):
    """DeepSpeed's command-line flags: --deepspeed, --deepspeed_config (and the deprecated
    --deepscale, --deepscale_config)."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError("add_config_arguments: an argparse.ArgumentParser")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (zinf)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="run with zinf (accepted for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed-style JSON config")
    group.add_argument("--deepscale", default=False, action="store_true", help=argparse.SUPPRESS)
    group.add_argument("--deepscale_config", default=None, type=str, help=argparse.SUPPRESS)
    return parser


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=None,
                     verbose=True, timeout=None, init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """DeepSpeed's init_distributed: torch.distributed's default group (gloo on the CPU, nccl
    with a GPU), one rank included (as DeepSpeed's: torch.distributed.get_rank() works after
    it), so that the script's own collectives work; zinf's engine joins its own group through
    the launcher's store. Nothing happens when a default group exists already."""
    rank_env, world, _, _ = _distributed.from_env()
    import torch.distributed as dist
    if dist.is_initialized():
        return
    backend = dist_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    kwargs = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if world == 1 and init_method is None and "MASTER_ADDR" not in os.environ:
        # One process without a launcher: an in-process store, no port taken.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
        return
    dist.init_process_group(backend, init_method=init_method or "env://", rank=rank_env,
                            world_size=world, **kwargs)
