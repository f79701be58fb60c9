"""Ranks as processes: the launcher's environment becomes the engine's process group.

torchrun, accelerate and DeepSpeed's launcher set RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT (mpirun: OMPI_COMM_WORLD_*). With WORLD_SIZE > 1
the engine joins a group of that many processes: gloo on the host device, NCCL on a GPU, both
driven from C++. The ranks meet through a torch.distributed store: the default group's when
torch.distributed is initialised, else a TCPStore on MASTER_ADDR:MASTER_PORT (torchrun's agent
already serves one there and says so with TORCHELASTIC_USE_AGENT_STORE; otherwise rank 0 serves
it). A torch store rather than zinf's own: under torchrun the port is the agent's, and only a
client that speaks torch's protocol can use it.
"""

import datetime
import hashlib
import itertools
import os

import torch

from ._errors import error

_groups = itertools.count()  # each engine of a process gets its own keys in the store
_store = None                # this process's TCPStore, made once (rank 0 serves it)


def _int(name, default=None, minimum=0):
    text = os.environ.get(name, "")
    if text == "":
        if default is None:
            raise error("InvalidArgument", "%s is not set (the launcher's process group)" % name)
        return default
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise error("InvalidArgument", "%s=%r is not an integer >= %d (the launcher's process "
                                       "group)" % (name, text, minimum))
    return value


def from_env():
    """(rank, world_size, local_rank, local_world_size) from the launcher's variables; rank 0
    of 1 when none is set."""
    if os.environ.get("RANK", "") != "":
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    elif os.environ.get("OMPI_COMM_WORLD_RANK", "") != "":
        names = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")
    else:
        world = _int("WORLD_SIZE", 1, 1)
        if world > 1:
            raise error("InvalidArgument", "WORLD_SIZE=%d is set but RANK is not: start the "
                                           "processes with a launcher (torchrun) or set RANK"
                        % world)
        return 0, 1, 0, 1
    world = _int(names[1], 1, 1)
    rank = _int(names[0], 0, 0)
    local_world = _int(names[3], world, 1)
    local_rank = _int(names[2], rank, 0)
    if rank >= world:
        raise error("InvalidArgument", "%s=%d is not below %s=%d" % (names[0], rank, names[1],
                                                                   world))
    if local_rank >= local_world:
        raise error("InvalidArgument", "%s=%d is not below %s=%d" % (names[2], local_rank,
                                                                   names[3], local_world))
    return rank, world, local_rank, local_world


def _rendezvous(rank, world, timeout):
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_store()
    global _store
    if _store is not None:
        return _store
    addr = os.environ.get("MASTER_ADDR", "")
    if not addr:
        raise error("InvalidArgument", "a group of %d processes needs MASTER_ADDR and "
                                       "MASTER_PORT (where the ranks meet; torchrun sets both)"
                    % world)
    port = _int("MASTER_PORT", None, 1)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "") == "True"
    try:
        # multi_tenant: a torch.distributed group the script creates later (env://) shares
        # this server on the same port instead of failing to bind it.
        _store = dist.TCPStore(addr, port, world, rank == 0 and not agent,
                               datetime.timedelta(seconds=timeout), wait_for_workers=False,
                               multi_tenant=True)
    except (RuntimeError, OSError) as e:
        raise error("FailedPrecondition",
                    "rank %d: cannot %s the rendezvous store at %s:%d: %s (is rank 0 running, "
                    "is MASTER_PORT free and the same on every rank?)"
                    % (rank, "serve" if rank == 0 and not agent else "reach", addr, port, e))
    return _store


def group(summary):
    """The `group` argument of _zinf.Engine for this process: None for one rank."""
    rank, world, local_rank, local_world = from_env()
    if world == 1:
        return None
    timeout = float(summary["collective_timeout_seconds"])
    import torch.distributed as dist
    # A restarted group (torchrun --max-restarts) must not read the dead attempt's keys; two
    # jobs meeting in one store (one MASTER_PORT) must not read each other's.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    job = job_id()
    tag = "job-" + hashlib.sha256(job.encode()).hexdigest()[:16] + "/" if job else ""
    base = _rendezvous(rank, world, timeout)
    _same_job(base, rank, tag, timeout)
    store = dist.PrefixStore("zinf/%sattempt%s/%d" % (tag, attempt, next(_groups)), base)
    _claim(store, rank, world)
    return {"rank": rank, "world_size": world, "local_rank": local_rank,
            "local_world_size": local_world, "prefix": "g", "timeout_seconds": timeout,
            "store": store, "master_addr": os.environ.get("MASTER_ADDR", ""),
            "listen_addr": os.environ.get("ZINF_LISTEN_ADDR", "")}


def job_id():
    """The job's identity: ZINF_JOB_ID, else torchrun's run id ("" when neither is given)."""
    job = os.environ.get("ZINF_JOB_ID", "")
    if not job:
        run = os.environ.get("TORCHELASTIC_RUN_ID", "")
        job = run if run != "none" else ""
    return job


def _same_job(store, rank, tag, timeout):
    """Rank 0 marks the store with its job's tag; the other ranks check the mark, so that a
    rank of another job that reached this store (two jobs on one MASTER_PORT) fails at once,
    saying so, instead of waiting for keys its own rank 0 will never write there."""
    mark = tag or "job-none/"
    try:
        if rank == 0:
            store.set("zinf/job", mark)
            return
        store.wait(["zinf/job"], datetime.timedelta(seconds=timeout))
        held = store.get("zinf/job").decode(errors="replace")
    except (RuntimeError, OSError) as e:
        raise error("FailedPrecondition", "rank %d: the rendezvous store failed: %s" % (rank, e))
    if held != mark:
        raise error("FailedPrecondition",
                    "rank %d: the rendezvous store at %s:%s belongs to another job (its job id "
                    "is not this rank's): two jobs were started on one MASTER_PORT; give each "
                    "job its own MASTER_PORT, and every rank of one job the same ZINF_JOB_ID"
                    % (rank, os.environ.get("MASTER_ADDR", "?"),
                       os.environ.get("MASTER_PORT", "?")))


def _claim(store, rank, world):
    """Counts this process in as `rank`: a second process claiming the same rank of the same
    job (a rank started twice, or two jobs on one MASTER_PORT without job ids) is refused
    before it can pair with the others."""
    try:
        claims = store.add("claim/%d" % rank, 1)
    except (RuntimeError, OSError) as e:
        raise error("FailedPrecondition", "rank %d: the rendezvous store failed: %s" % (rank, e))
    if claims > 1:
        raise error("FailedPrecondition",
                    "rank %d of this job has already joined (%d processes claimed it): a rank "
                    "started twice, or two jobs on one MASTER_PORT; give each job its own "
                    "MASTER_PORT, or every rank of a job the same ZINF_JOB_ID of its own"
                    % (rank, claims))


def sampler(dataset, world, rank, shuffle):
    """The rank's share of `dataset` (DistributedSampler), or None for one rank."""
    if world == 1:
        return None
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise error("InvalidArgument",
                    "training_data is an IterableDataset and there are %d ranks: zinf cannot "
                    "split it (every rank would train on the same data); shard it per rank "
                    "(engine.rank, engine.world_size) and build the DataLoader yourself" % world)
    return torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=world,
                                                           rank=rank, shuffle=shuffle)
