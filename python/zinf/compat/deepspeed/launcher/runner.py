"""deepspeed.launcher.runner (zinf): the environment file name accelerate reads."""
DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"
