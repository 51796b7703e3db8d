"""dit-train run in the test's own process (a subprocess spends seconds importing torch), and everything it changes
in that process undone afterwards. Loaded by path (tests are no package): see its users."""

import contextlib
import os
import signal

# the handlers dit-train installs (preemption: ditcore's runs stop with a checkpoint on these)
DIT_TRAIN_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


@contextlib.contextmanager
def process_restored(signals: tuple[int, ...] = DIT_TRAIN_SIGNALS):
    """Around dit-train's setup or train() run in this process: afterwards its process group is gone, and the
    environment (Fabric's MASTER_PORT & co., which later dit-train processes would inherit) and the handlers of
    `signals` are as they were."""
    from ditcore.parallel.dims import destroy

    environ = dict(os.environ)
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        destroy()
        os.environ.clear()
        os.environ.update(environ)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
