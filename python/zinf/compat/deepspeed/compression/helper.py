"""deepspeed.compression.helper (zinf)."""


def recursive_getattr(model, module_name):
    """model.a.b.c for module_name "a.b.c"."""
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model, module_name, module):
    """Sets model.a.b.c = module for module_name "a.b.c"."""
    parts = module_name.split(".")
    setattr(recursive_getattr(model, ".".join(parts[:-1])) if len(parts) > 1 else model,
            parts[-1], module)
