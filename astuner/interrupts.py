"""SIGTERM as Ctrl-C: a scheduler's or a timeout's `kill` unwinds the command like an interrupt (every `finally`
runs), for `astuner` runs and `astuner serve`.

The unwinding has a deadline (`grace_s`, 10 s for runs, eval and warmstart): a cleanup still going then (an engine
that does not answer its shutdown, a thread that holds the interpreter's exit) is cut short, the command's child
processes (vLLM's engine core and workers) are killed and the process exits 143, saying so once. A second SIGTERM
during the unwinding changes nothing: the first is already at work."""

import contextlib
import os
import signal
import threading

TERMINATED_EXIT = 143  # 128 + SIGTERM, as a shell reports it
GRACE_S = 10.0


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, a timeout, `kill`): unwinds like Ctrl-C, so every `finally` runs and the engine's
    own processes (vLLM's engine core and workers, which outlive a parent killed outright) are stopped."""


def kill_children_and_exit(grace_s: float) -> None:
    """The unwinding ran past its deadline: kill every descendant process, then this one (exit 143)."""
    os.write(2, f"astuner: terminated (SIGTERM); the stop ran past {grace_s:g} s, so its processes were killed\n"
             .encode())
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
    finally:
        os._exit(TERMINATED_EXIT)


@contextlib.contextmanager
def sigterm_as_interrupt(grace_s: float | None = GRACE_S):
    """SIGTERM raises Terminated in the main thread. `grace_s`: the unwinding's deadline from the first SIGTERM,
    after which the process and its children are killed; None: no deadline (`astuner serve`, which saves its
    clients' states on the way out)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = threading.Event()

    def handler(signum, frame):
        if received.is_set():
            return  # already unwinding
        received.set()
        if grace_s is not None:
            # A daemon timer: the process ending first leaves it unfired. It is not cancelled when this block
            # ends, since the interpreter's own exit (joining threads, atexit) may be what hangs.
            timer = threading.Timer(grace_s, kill_children_and_exit, args=(grace_s,))
            timer.daemon = True
            timer.start()
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        # Past the block, a late SIGTERM (a process group's second signal) must not raise in the exit path.
        signal.signal(signal.SIGTERM, signal.SIG_IGN if received.is_set() else previous)
