"""deepspeed.runtime: the engine, its config, schedules and ZeRO pieces (served by zinf)."""
