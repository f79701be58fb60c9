"""`python3 -m zinf.launch [torchrun's flags] script.py [args]`: runs a script written for
DeepSpeed unchanged, on zinf, on every rank torchrun starts (default one: --nproc_per_node N for
more). Every rank's `import deepspeed` is zinf's DeepSpeed API (zinf/compat/deepspeed; its
distribution metadata says version 0.16.0+zinf, which accelerate and transformers accept, and
`deepspeed.__zinf__` holds zinf's version).

    python3 -m zinf.launch --nproc_per_node 2 train.py --deepspeed_config ds_config.json
    python3 -m zinf.launch --deepspeed-path     # the folder to put first on PYTHONPATH for
                                                # other launchers (accelerate launch, mpirun)

The launcher is torch's own (zinf.torchrun: torch.distributed.run with Debian 12's fix). On one
machine with no --master_addr, --master_port, --rdzv_endpoint, --standalone or --nnodes, the
ranks meet on 127.0.0.1 at a free port; otherwise torchrun's flags say where.
A DeepSpeed installed on this machine is not replaced: for the run, zinf's comes first on the
path, and the launcher says so.
"""
import importlib.util
import os
import socket
import sys

COMPAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compat")

# torchrun flags that choose where the ranks meet.
_RENDEZVOUS = ("--master_port", "--master-port", "--rdzv_endpoint", "--rdzv-endpoint",
               "--standalone", "--rdzv_backend", "--rdzv-backend")


# torchrun flags that take no value (the word after one is the script).
_NO_VALUE = ("--standalone", "--no_python", "--no-python", "--module", "-m", "--run_path",
             "--run-path")


def deepspeed_path():
    """The folder holding zinf's `deepspeed` package and its metadata."""
    return COMPAT


def _installed_deepspeed():
    """The origin of a `deepspeed` importable without zinf's folder, or None."""
    saved = list(sys.path)
    try:
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != COMPAT]
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        spec = None
    finally:
        sys.path[:] = saved
    if spec is None or spec.origin is None or spec.origin.startswith(COMPAT):
        return None
    return spec.origin


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_argv(argv):
    """torchrun's arguments for `argv` (launcher flags, the script, its arguments): on one
    machine with nothing saying where the ranks meet, 127.0.0.1 and a free port first."""
    script_at = next((i for i, a in enumerate(argv) if not a.startswith("-") and
                      (i == 0 or not argv[i - 1].startswith("-") or "=" in argv[i - 1] or
                       argv[i - 1] in _NO_VALUE)), len(argv))
    launcher_flags = [f.split("=")[0] for f in argv[:script_at]]
    one_node = not any(f in ("--nnodes", "--master_addr", "--master-addr")
                       for f in launcher_flags)
    if one_node and not any(f in _RENDEZVOUS for f in launcher_flags):
        return ["--master_addr", "127.0.0.1", "--master_port", str(_free_port())] + argv
    return list(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["--deepspeed-path"], ["--deepspeed_path"]):
        print(COMPAT)
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    other = _installed_deepspeed()
    if other is not None:
        print("zinf.launch: a DeepSpeed is installed (%s); this run imports zinf's DeepSpeed API "
              "instead (%s)" % (other, COMPAT), file=sys.stderr)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [COMPAT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    argv = torchrun_argv(argv)
    from . import torchrun
    return torchrun.main(argv)


if __name__ == "__main__":
    sys.exit(main())
