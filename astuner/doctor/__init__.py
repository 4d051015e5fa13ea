"""`astuner doctor`: the first-hour checklist of a node as one command, run before a long job.

Each check returns a `Check`: pass, warn, fail or skip, with what was seen and, unless it passed, what to do.
The checks run in order (`CHECKS`: the system's and the config's memory plan, `system.py`, then the model's,
`model.py`); one failing check does not stop the others unless they need what it would have built (a model check
after the engine failed to start is skipped and says so). On CPU the checks that need CUDA are skipped with the
reason, and the rest run: that is how CI runs it.

Exit status: 0 when nothing failed (warnings allowed), 1 when a check failed, 2 for bad input (as every command).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from astuner.doctor.base import STATUSES, Check, Context
from astuner.doctor.model import MODEL_CHECKS, close, sync_bytes
from astuner.doctor.system import (
    check_devices,
    check_memory_plan,
    check_shared_memory,
    check_sleep_mode,
    check_versions,
)

log = logging.getLogger(__name__)

# Every check, in the order they run. The memory plan reads the free memory, so it runs before anything of the
# doctor's own is loaded; then the model checks (model.py: the engine first, then the trainer beside it).
CHECKS: dict[str, Callable[[Context], Check]] = {
    "versions": check_versions,
    "devices": check_devices,
    "sleep mode": check_sleep_mode,
    "shared memory": check_shared_memory,
    "memory plan": check_memory_plan,
    **MODEL_CHECKS,
}


def run_checks(ctx: Context, say: Callable[[Check], None]) -> list[Check]:
    """Every check in order; `say` sees each result as it comes. A check that raises fails with its error."""
    from astuner.runtime import quiet_library_progress

    quiet_library_progress()
    results: list[Check] = []
    try:
        try:
            ctx.built["sync_bytes"] = sync_bytes(ctx)
        except Exception:  # an unreadable model: the trainer check says so
            ctx.built["sync_bytes"] = 0
        for name, fn in CHECKS.items():
            started = time.perf_counter()
            try:
                # --quick: the model checks are skipped here, the one place that knows which they are
                result = Check(name, "skip", name, "--quick") if ctx.quick and name in MODEL_CHECKS else fn(ctx)
            except Exception as exc:  # a check's own failure is its result; the next checks still run
                log.exception("doctor: the %s check raised", name)
                result = Check(name, "fail", f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}",
                               _log_hint(ctx))
            result = Check(result.name, result.status, result.seen, result.todo,
                           round(time.perf_counter() - started, 2), result.figures)
            results.append(result)
            say(result)
    finally:
        close(ctx)
    return results


def _log_hint(ctx: Context) -> str:
    return f"details in {ctx.log_file}" if ctx.log_file else "run it again with a log file to see details"


def summary(results: list[Check]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in STATUSES}
    verdict = "not ready: fix the failed checks first" if counts["fail"] else "ready"
    return (f"doctor: {counts['pass']} passed, {counts['warn']} warned, {counts['fail']} failed, "
            f"{counts['skip']} skipped: {verdict}")


def write_json(results: list[Check], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
