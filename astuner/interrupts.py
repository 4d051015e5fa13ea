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
    clients' states on the way out).

    Python runs a signal's handler only when the main thread is back in the interpreter, which a long C call (a
    backward pass, a kernel) may delay past the deadline itself; so the deadline starts from a thread that the
    signal wakes at once (`signal.set_wakeup_fd`), whatever the main thread is doing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = threading.Event()
    deadline = _Deadline(grace_s)

    def handler(signum, frame):
        if raised.is_set():
            return  # already unwinding
        raised.set()
        deadline.start()
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    woken = _wake_on_sigterm(deadline.start) if grace_s is not None else None
    try:
        yield
    finally:
        # Past the block, a late SIGTERM (a process group's second signal) must not raise in the exit path.
        signal.signal(signal.SIGTERM, signal.SIG_IGN if raised.is_set() else previous)
        if woken is not None:
            woken()


class _Deadline:
    """Kills the process and its children `grace_s` after the first start(); later starts change nothing."""

    def __init__(self, grace_s: float | None) -> None:
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._started = False

    def start(self) -> None:
        with self._lock:
            if self._started or self.grace_s is None:
                return
            self._started = True
        # A daemon timer: the process ending first leaves it unfired. It is not cancelled when the block ends,
        # since the interpreter's own exit (joining threads, atexit) may be what hangs.
        timer = threading.Timer(self.grace_s, kill_children_and_exit, args=(self.grace_s,))
        timer.daemon = True
        timer.start()


def _wake_on_sigterm(on_sigterm):
    """Calls `on_sigterm` from a daemon thread as soon as SIGTERM arrives (the C-level handler writes the signal's
    number to a pipe); returns what restores the previous wakeup fd and ends the thread."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    try:
        previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter: the handler's own deadline only
        os.close(read_fd)
        os.close(write_fd)
        return None

    def watch() -> None:
        while True:
            try:
                data = os.read(read_fd, 64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                on_sigterm()

    threading.Thread(target=watch, name="astuner-sigterm-deadline", daemon=True).start()

    def restore() -> None:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the thread reads the end of the pipe and returns

    return restore
