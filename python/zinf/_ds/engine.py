"""DeepSpeedEngine: what deepspeed.initialize returns (initialize.py), a ZinfEngine whose
save_checkpoint / load_checkpoint take DeepSpeed's arguments (tags: one checkpoint folder per
tag under the directory, and a `latest` file naming the newest) and return its shapes, plus
DeepSpeed's accessors. It uses the engine's context (context_of) and _checkpoint.py, never the
engine's private fields.
"""
import logging
import os

import torch

from .. import _checkpoint, _distributed
from .._engine import ZinfEngine, context_of
from .._errors import error

logger = logging.getLogger("zinf")


class DeepSpeedEngine(ZinfEngine):
    """A ZinfEngine with DeepSpeed's checkpoint signatures and accessors."""

    training_dataloader = None
    _last_stats = None  # the last step()'s statistics

    @property
    def global_rank(self):
        return self.rank

    @property
    def dp_world_size(self):
        return self.world_size

    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True,
                        exclude_frozen_parameters=False):
        """DeepSpeed's save: the checkpoint goes to save_dir/<tag> (tag: "global_step<N>" by
        default), and save_dir/latest names it. Each tag folder is a zinf checkpoint folder
        (written atomically, locked while this engine lives); frozen parameters are recorded
        by the hash of their values, whatever exclude_frozen_parameters says. Returns True."""
        context_of(self).enter("save_checkpoint")
        # exclude_frozen_parameters: zinf's checkpoints never hold a frozen parameter's values
        # (each is recorded by the hash of its value, checked at load), so either is served.
        if tag is None:
            tag = "global_step%d" % self.global_steps
        tag = str(tag)
        if not tag or os.sep in tag or tag in (".", ".."):
            raise error("InvalidArgument", "save_checkpoint: tag %r is not a folder name" % tag)
        if tag == "latest" or tag.startswith("latest.tmp"):
            raise error("InvalidArgument", "save_checkpoint: tag %r is taken: save_dir/latest is "
                                           "the file that names the newest checkpoint; pick "
                                           "another tag" % tag)
        os.makedirs(save_dir, exist_ok=True)
        _checkpoint.save(context_of(self), self, os.path.join(save_dir, tag),
                         {} if client_state is None else client_state, extra={"tag": tag})
        if save_latest and self.rank == 0:
            _write_latest(save_dir, tag)
        return True

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True,
                        load_optimizer_states=True, load_lr_scheduler_states=True,
                        load_module_only=False, custom_load_fn=None):
        """DeepSpeed's load: load_dir/<tag>, or the tag load_dir/latest names. Returns
        (load_path, client_state), or (None, None) with a warning when load_dir has no
        `latest` (and no tag was given), as DeepSpeed does."""
        context_of(self).enter("load_checkpoint")
        if load_module_only or not load_optimizer_states or custom_load_fn is not None:
            raise error("NotSupported",
                        "load_checkpoint: zinf restores a checkpoint whole (parameters, "
                        "optimizer states, counters); load_module_only, "
                        "load_optimizer_states=False and custom_load_fn are not supported "
                        "(to load weights alone, use zinf.load_safetensors or "
                        "model.load_state_dict)")
        if tag is None:
            latest = os.path.join(load_dir, "latest")
            if os.path.lexists(latest) and not os.path.isfile(latest):
                raise error("Corruption", "%s is not a file: it should name the newest "
                                          "checkpoint folder (pass a tag, or remove it)" % latest)
            if not os.path.isfile(latest):
                held = _checkpoint_folders(load_dir)
                if held:
                    # Never a silent fresh start where checkpoints are.
                    raise error("NotFound", "%s holds checkpoints (%s) but no 'latest' file "
                                            "naming the newest: pass tag= to load one"
                                % (load_dir, ", ".join(held)))
                logger.warning("zinf: no checkpoint to load: %s does not exist (pass a tag)",
                               latest)
                return None, None
            with open(latest, "r", encoding="utf-8") as f:
                tag = f.read().strip()
            if not tag:
                raise error("Corruption", "%s is empty: it should name the newest checkpoint "
                                          "folder" % latest)
        path = os.path.join(load_dir, str(tag))
        scheduler = self.lr_scheduler
        if not load_lr_scheduler_states:
            self.lr_scheduler = None
        try:
            user = _checkpoint.load(context_of(self), self, path)
        finally:
            self.lr_scheduler = scheduler
        client = None if user is None else user.get("client_state")
        return path, ({} if client is None else client)

    def _micro_batch(self):
        return self.config.summary["train_micro_batch_size_per_gpu"] or None

    def train_micro_batch_size_per_gpu(self):
        return self._micro_batch()

    def train_batch_size(self):
        """micro x accumulation x ranks (DeepSpeed's arithmetic: _ds/batch.py)."""
        return self.config.summary["train_batch_size"] or None

    def gradient_accumulation_steps(self):
        return context_of(self).gas

    def get_global_grad_norm(self):
        return self._last_stats.get("grad_norm") if self._last_stats else None

    def was_step_applied(self):
        return bool(self._last_stats and self._last_stats["optimizer_ran"]
                    and not self.optimizer.overflow)

    def step(self, lr_kwargs=None):
        boundary = self.__dict__.pop("_boundary_set", None)
        ctx = context_of(self)
        if boundary is not None and boundary != self.is_gradient_accumulation_boundary():
            raise error("FailedPrecondition",
                        "set_gradient_accumulation_boundary(%s) but this step is micro-step %d of "
                        "%d of its accumulation window: the trainer's accumulation (e.g. "
                        "accelerate's gradient_accumulation_steps) and the config's "
                        "gradient_accumulation_steps (%d) must be the same"
                        % (boundary, ctx.micro.index % ctx.gas + 1, ctx.gas, ctx.gas))
        self._last_stats = super().step(lr_kwargs)
        return self._last_stats

    def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False,
                 scale_wrt_gas=None):
        """DeepSpeed's backward: scale_wrt_gas (None: initialize's) divides the loss by the
        accumulation steps; gradients are always reduced across the ranks."""
        if not allreduce_gradients:
            raise error("NotSupported", "backward(allreduce_gradients=False): zinf reduces each "
                                        "gradient as it is produced")
        ctx = context_of(self)
        keep = ctx.scale_wrt_gas
        if scale_wrt_gas is not None:
            ctx.scale_wrt_gas = bool(scale_wrt_gas)
        try:
            return super().backward(loss, retain_graph=retain_graph)
        finally:
            ctx.scale_wrt_gas = keep

    def set_gradient_accumulation_boundary(self, is_boundary):
        """What the trainer thinks the next step() is (accelerate sets it every micro-step);
        zinf counts the window itself and refuses a step where the two differ."""
        self._boundary_set = bool(is_boundary)

    def bfloat16_enabled(self):
        return context_of(self).dtype == torch.bfloat16

    def fp16_enabled(self):
        return context_of(self).dtype == torch.float16

    def amp_enabled(self):
        return False

    def zero_optimization(self):
        return True

    def zero_optimization_stage(self):
        return int(self.config.get("zero_optimization", "stage", default=3))

    def zero_optimization_partition_weights(self):
        return self.zero_optimization_stage() == 3

    def zero_cpu_offload(self):
        return self.config.get("zero_optimization", "offload_optimizer", "device",
                               default="none") in ("cpu", "nvme")

    @property
    def global_samples(self):
        return self.global_steps * (self.train_batch_size() or 0)

    def zero_gather_16bit_weights_on_model_save(self):
        """The config's zero_optimization.stage3_gather_16bit_weights_on_model_save (DeepSpeed's
        default False; its alias gather_fp16_weights_on_model_save too)."""
        z = self.config.get("zero_optimization", default={}) or {}
        return bool(z.get("stage3_gather_16bit_weights_on_model_save",
                          z.get("stage3_gather_fp16_weights_on_model_save", False)))

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters=False):
        """The model's state_dict with whole values in the parameters' dtype on rank 0 (None on
        the others, which accelerate's save_model reads as "not this rank's to save");
        collective."""
        ctx = context_of(self)
        ctx.enter("_zero3_consolidated_16bit_state_dict")
        ctx.between_steps("_zero3_consolidated_16bit_state_dict")
        state = self.full_state_dict(dtype=ctx.dtype)
        if exclude_frozen_parameters:
            frozen = {n for p in ctx.registry.params if not p.trainable for n in p.names}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state if self.rank == 0 else None

    def save_16bit_model(self, save_dir, save_filename="pytorch_model.bin",
                         exclude_frozen_parameters=False):
        """torch.save of the consolidated state_dict into save_dir/save_filename on rank 0."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    save_fp16_model = save_16bit_model

    def destroy(self):
        self.close()

    def __getattr__(self, name):
        # DeepSpeed's engine hands unknown attributes to the module it wraps.
        module = self.__dict__.get("module")
        if module is None or name.startswith("__") or hasattr(type(self), name):
            # (hasattr: an engine property that raised AttributeError is not the module's.)
            raise AttributeError(name)
        return getattr(module, name)

    def deepspeed_io(self, dataset, batch_size=None, route=None, pin_memory=True,
                     data_sampler=None, collate_fn=None, num_local_io_workers=None):
        """A DataLoader over `dataset` with the micro-batch size, shuffled, as DeepSpeed's
        training_data loader: with several ranks each gets its share (DistributedSampler; call
        loader.sampler.set_epoch(epoch) for a new order each epoch)."""
        if not isinstance(dataset, torch.utils.data.Dataset):
            raise TypeError("training_data must be a torch.utils.data.Dataset")
        size = batch_size or self._micro_batch()
        if not size:
            raise error("InvalidArgument", "training_data needs a batch size: set "
                                           "train_micro_batch_size_per_gpu (or "
                                           "train_batch_size) in the config")
        drop_last = bool(self.config.get("dataloader_drop_last", default=False))
        if data_sampler is None:
            data_sampler = _distributed.sampler(dataset, self.world_size, self.rank, True)
        return torch.utils.data.DataLoader(
            dataset, batch_size=size, sampler=data_sampler,
            shuffle=data_sampler is None and not isinstance(dataset,
                                                            torch.utils.data.IterableDataset),
            collate_fn=collate_fn, num_workers=num_local_io_workers or 0,
            pin_memory=pin_memory and self.device.type == "cuda", drop_last=drop_last)


def _checkpoint_folders(load_dir):
    """The names of the folders in load_dir that hold something (tag folders, as
    save_checkpoint writes them)."""
    try:
        names = sorted(os.listdir(load_dir))
    except OSError:
        return []
    held = []
    for n in names:
        path = os.path.join(load_dir, n)
        if n.startswith(".") or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            if os.listdir(path):
                held.append(n)
        except OSError:
            pass  # unreadable: not one we could load either
    return held


def _write_latest(save_dir, tag):
    """save_dir/latest = tag, replaced atomically (written, synced, renamed); the temporary
    file never stays behind."""
    path = os.path.join(save_dir, "latest")
    if os.path.lexists(path) and not os.path.isfile(path):
        raise error("FailedPrecondition", "save_checkpoint: %s is not a file (it should name the "
                                          "newest checkpoint); remove it" % path)
    tmp = "%s.tmp.%d" % (path, os.getpid())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        try:
            os.write(fd, tag.encode("utf-8"))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # already gone
        raise error("IoError", "save_checkpoint: writing %s: %s" % (path, e))
    dfd = os.open(save_dir, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
