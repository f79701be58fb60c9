"""Which managed parameters are acquired, for whom, and which memory torch sees (what FSDP2's
FSDPParamGroup does with unshard and reshard).

A parameter is acquired from the engine for two kinds of holder, counted apart (ParamState,
_param.py): forward frames (a module call of the engine's forward, or a read of the parameter
outside it), released when the last frame holding it closes; and backward, where saved
references (_packing.py) read it, released once the last reference died (or when the backward
ends: a later unpack acquires it again). Memory is handed back to the engine only when no
holder of either kind is left, so backward never reads memory the engine has reused.
"""
import weakref

from torch.utils import dlpack

from ._calls import storage_ptr


class Frame:
    """A module call in the engine's forward (or one access outside it): the parameters it
    holds, and the saved-tensor hooks it pushed when it was the outermost one."""

    __slots__ = ("params", "hooks")

    def __init__(self):
        self.params = []
        self.hooks = None


class Residency:
    """An engine's acquired parameters: forward frames, backward holds, the memory torch sees."""

    def __init__(self, engine, registry, micro):
        self._engine = weakref.ref(engine)  # its core (gone once the engine is closed)
        self._registry = registry
        self._micro = micro
        self.live = {}  # storage pointer -> ManagedParam (memory currently handed to torch)
        self.stack = []  # forward frames (Frame): the module calls running now
        self.traced = True  # this forward's acquires are training ones (recorded, traced)
        self.deferred = []  # parameters whose last saved reference died

    def _core(self):
        return self._engine()._core

    # -- Forward

    def acquire_forward(self, owned, frame, inference=None):
        """`frame` holds each of `owned` in forward; those not held yet are acquired (in one
        call) and their `param.data` becomes the engine's memory."""
        if inference is None:
            inference = not self.traced
        need = []
        for p in owned:
            if not p.state.in_forward and p not in need:
                need.append(p)
        if need:
            if not inference:
                self._micro.started = True
            core = self._core()
            capsules = core.acquire([p.id for p in need], inference=inference)
            done = []
            try:
                for p, capsule in zip(need, capsules):
                    flat = dlpack.from_dlpack(capsule)
                    p.gather_forward(flat)
                    done.append(p)
                    self._add_live(p, flat)
            except BaseException:
                for p in done:
                    p.release_forward()
                    if not p.state.in_backward:
                        self._drop_live(p)
                del capsules
                core.release([p.id for p in need])
                raise
        for p in owned:
            p.add_forward_holder()
            frame.params.append(p)

    def release_forward(self, frame):
        done = []
        for p in frame.params:
            if p.drop_forward_holder():
                p.release_forward()
                if not p.state.in_backward:
                    self._drop_live(p)
                done.append(p.id)
        frame.params = []
        if done:
            self._core().release(done)

    def touch(self, param):
        """A parameter read during forward (through a module's _parameters)."""
        p = self._registry.by_obj.get(id(param))
        if p is not None and not p.state.in_forward:
            self.acquire_forward([p], self.stack[-1])

    def close_frame(self, frame):
        try:
            self.release_forward(frame)
        finally:
            if frame.hooks is not None:
                hooks, frame.hooks = frame.hooks, None
                hooks.__exit__(None, None, None)

    def unwind(self):
        """Closes every open frame (a forward that raised, or an entry point that needs none)."""
        while self.stack:
            self.close_frame(self.stack.pop())

    # -- Backward

    def acquire_backward(self, p):
        """For a saved reference autograd unpacks: `p` held in backward."""
        self.flush()
        # Backward is training, whatever mode the forward ran in.
        capsule = self._core().acquire([p.id])[0]
        try:
            flat = dlpack.from_dlpack(capsule)
            p.gather_backward(flat)
        except BaseException:
            # Nothing holds it: the engine gets it back once torch frees the view, if any.
            self._core().release([p.id])
            raise
        self._add_live(p, flat)

    def flush(self):
        """Releases the parameters backward no longer needs (their saved references died)."""
        if not self.deferred:
            return
        deferred, self.deferred = self.deferred, []
        done = []
        for p in deferred:
            if p.backward_unneeded:
                self._drop_backward(p, done)
        if done:
            self._core().release(done)

    def end_backward(self):
        """A backward ended: every backward hold goes (a later unpack acquires again)."""
        self.flush()
        done = []
        for p in self._registry.params:
            if p.state.in_backward:
                self._drop_backward(p, done)
        if done:
            self._core().release(done)

    def _drop_backward(self, p, done):
        p.release_backward()
        if not p.state.in_forward:
            self._drop_live(p)
        done.append(p.id)

    # -- The memory torch sees

    def holder_of(self, t):
        """The parameter whose acquired memory `t` lies in, or None."""
        return self.live.get(storage_ptr(t))

    def _add_live(self, p, flat):
        p.live_ptr = storage_ptr(flat)
        self.live[p.live_ptr] = p

    def _drop_live(self, p):
        self.live.pop(p.live_ptr, None)
        p.live_ptr = None
