"""Which thread drives an engine: the first that calls it, until that thread ends. A call from
another thread is refused before it changes anything (one thread runs an engine's forward,
backward and step; threads torch starts for autograd run the engine's hooks and pass).
"""
import threading

from ._errors import error


class Driver:
    """The one thread that drives an engine: the first to call it, until it ends."""

    def __init__(self):
        self._lock = threading.Lock()
        self._thread = None

    def check(self, what):
        current = threading.current_thread()
        if isinstance(current, threading._DummyThread):
            return  # a thread torch started (autograd's device threads run our hooks)
        with self._lock:
            owner = self._thread
            if owner is None or owner is current or not owner.is_alive():
                self._thread = current
                return
        raise error("FailedPrecondition",
                    "%s from thread %r: this zinf engine is driven by thread %r (one thread "
                    "runs an engine's forward, backward and step; nothing was done). Call it "
                    "from that thread, or give each thread its own engine"
                    % (what, current.name, owner.name))
