"""deepspeed.launcher (zinf): names the integrations read. zinf's launcher is
`python3 -m zinf.launch` (torchrun's); the `deepspeed` command is not provided."""
