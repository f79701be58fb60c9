"""DeepSpeed's surface over zinf's own API: what exists to serve a trainer written for DeepSpeed
(`import zinf as deepspeed`, or the `deepspeed` package in zinf/compat, a naming layer over
these modules and zinf's).

    initialize.py  deepspeed.initialize (its 4-tuple), add_config_arguments, init_distributed
    engine.py      DeepSpeedEngine: DeepSpeed's checkpoint tags and accessors over ZinfEngine
    gathered.py    deepspeed.zero.GatheredParameters
    schedulers.py  DeepSpeed's learning-rate schedules (a config's "scheduler" block)
    batch.py       DeepSpeed's batch arithmetic (train = micro x accumulation x ranks)

Nothing here is imported by this file: zinf's own modules import the few they use (the
config's DeepSpeed blocks), and the DeepSpeed modules import zinf's.
"""
