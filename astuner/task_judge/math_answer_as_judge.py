"""`MathAnswerAsJudge`: reward 1.0 when the episode's final answer is mathematically equal to the ground truth.

What it reads:
  workflow_output.metadata["final_answer"]  the prediction, e.g. "... so the answer is \\boxed{72}" (\\boxed{} content
      is preferred; with several, the last one counts) or a bare answer such as "72", "1,234", "\\frac{1}{2}".
      Missing or empty: (0.0, False).
  workflow_task.task.metadata               the ground truth: the first present of "answer", "ground_truth",
      "solution". A GSM8K answer ("...reasoning...\\n#### 1,234") counts from after "####". None present: UserError.
Returns (1.0, True) when `math_verify` (parse + verify) finds them equal, else (0.0, False). Thousands separators
("1,234") are dropped; bare LaTeX ("2\\pi", "\\sqrt{2}") is read as math, not as prose.

Why a child process: math_verify's timeouts use signal.alarm, which raises off the main thread (and the rollout may
judge from worker threads), and even on the main thread cannot stop a long C-level computation: verifying
\\boxed{9^{9^{9^{9}}}} holds the GIL for ever and freezes every thread of the process. So parsing and verifying run
in one long-lived child (`python -m astuner.task_judge.math_answer_as_judge`, JSON lines on stdin/stdout) with
math_verify's timeouts off; an answer that takes longer than `timeout_s` scores 0 and the child is restarted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from astuner.task_judge.base_judge import BaseJudge, final_answer_of, ground_truth_of
from astuner.workflow import WorkflowOutput, WorkflowTask

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 10.0
# The child imports sympy on start; generous, since a busy machine can take a while.
STARTUP_TIMEOUT_S = 120.0


class MathAnswerAsJudge(BaseJudge):
    def __init__(self, config: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        super().__init__(config)
        self._checker = _MathChecker(timeout_s)

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        gold = ground_truth_of(workflow_task)  # checked first: missing ground truth is a data error
        prediction = final_answer_of(workflow_output)
        if prediction is None:
            return 0.0, False
        correct = self._checker.equal(gold, prediction)
        return (1.0 if correct else 0.0), correct

    def close(self) -> None:
        """Stop the child process now (it is also stopped when the judge is collected or at exit)."""
        self._checker.close()


class _MathChecker:
    """Thread-safe client of the child process; one request at a time."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = float(timeout_s)
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self._pending = b""
        self._warned_golds: set[str] = set()

    def equal(self, gold: str, prediction: str) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps({"gold": gold, "pred": prediction}) + "\n").encode())
                self._proc.stdin.flush()
                reply = json.loads(self._read_line(self.timeout_s))
            except TimeoutError:
                log.warning("math judge: %r took over %.0fs to verify; scored 0", prediction[:200], self.timeout_s)
                self._stop()
                return False
            except (OSError, EOFError, ValueError) as exc:
                log.warning("math judge: checker process failed (%s); scored 0 and restarting it", exc)
                self._stop()
                return False
            if reply.get("error"):
                log.debug("math judge: %r vs %r: %s", prediction[:200], gold[:200], reply["error"])
            if reply.get("gold_unparsed") and gold not in self._warned_golds and len(self._warned_golds) < 100:
                self._warned_golds.add(gold)
                log.warning("math judge: ground truth %r is not parseable as math; its episodes score 0", gold[:200])
        return bool(reply.get("equal"))

    def close(self) -> None:
        with self._lock:
            self._stop()

    def _start(self) -> None:
        self._stop()
        env = dict(os.environ)
        # The child must import this package even when astuner is not installed (run from a source checkout).
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.timeout_s)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        try:
            ready = json.loads(self._read_line(STARTUP_TIMEOUT_S))
        except (OSError, EOFError, ValueError) as exc:
            self._stop()
            raise RuntimeError(f"math judge: checker process did not start ({exc}); see its error output") from exc
        if not ready.get("ready"):
            self._stop()
            raise RuntimeError(f"math judge: unexpected first line from checker process: {ready!r}")

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child, once
        self._proc, self._finalizer, self._pending = None, None, b""

    def _read_line(self, timeout_s: float) -> str:
        # select + os.read rather than readline(): a stuck child must not block the caller past the deadline.
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply within {timeout_s:.0f}s")
            readable, _, _ = select.select([fd], [], [], remaining)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise EOFError(f"checker process exited (code {self._proc.poll()})")
                self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass


# ---- everything below runs in the child process ----

# A word of two or more letters that is not a LaTeX command: the text is prose, so let math_verify find the answer
# in it rather than reading the whole text as one formula.
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}")
_THOUSANDS = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?")


_TEXT_GROUP = re.compile(r"\\(?:text|mbox|mathrm|textbf|operatorname)\s*\{[^{}]*\}")
_UNIT_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}\.?")


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of each \\boxed{...}, braces balanced."""
    spans, i = [], 0
    while (i := text.find("\\boxed{", i)) != -1:
        start = depth = i + len("\\boxed{")
        depth = 1
        j = start
        while j < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[j], 0)
            j += 1
        if depth == 0:
            spans.append((start, j - 1))
        i = j
    return spans


def strip_units_in_boxed(text: str) -> str:
    """\\boxed{18 dollars}, \\boxed{\\$18}, \\boxed{18\\text{ cm}} -> \\boxed{18}: units and currency inside the box
    are common model output and say nothing about the number. A box whose content is only words is kept."""
    out, last = [], 0
    for start, end in _boxed_spans(text):
        content = text[start:end]
        bare = _UNIT_WORD.sub("", _TEXT_GROUP.sub("", content)).replace("\\$", "").replace("$", "")
        bare = bare.replace("\\%", "").replace("%", "").strip().rstrip(".,;:").strip()
        if bare and any(ch.isdigit() for ch in bare):
            content = bare
        out.append(text[last:start] + content)
        last = end
    return "".join(out) + text[last:]


def _parse(text: str, parse, configs) -> list:
    text = strip_units_in_boxed(text.strip())
    if _THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    if "\\boxed" in text or "$" in text or _PROSE.search(text):
        return parse(text, configs, parsing_timeout=None)
    # Bare math ("2\pi", "\sqrt{2}") is only read whole inside $...$; without them math_verify reads "2\pi" as 2.
    return parse(f"${text}$", configs, parsing_timeout=None) or parse(text, configs, parsing_timeout=None)


def _serve(timeout_s: float) -> None:
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # stray prints from libraries go to stderr, never into the protocol
    logging.basicConfig(level=logging.WARNING, format="math judge checker: %(message)s")
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that timeouts are off; we know

    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    protocol.write('{"ready": true}\n')
    protocol.flush()
    # Backstop when the parent is gone or stuck: SIGALRM's default action ends this process even while a C-level
    # computation holds the GIL. The parent normally kills us first, at timeout_s.
    alarm_s = int(timeout_s) + 5
    for line in sys.stdin:
        signal.alarm(alarm_s)
        try:
            request = json.loads(line)
            gold = _parse(request["gold"], parse, configs)
            prediction = _parse(request["pred"], parse, configs)
            equal = bool(gold and prediction and verify(gold, prediction, timeout_seconds=None))
            reply = {"equal": equal, "gold_unparsed": not gold}
        except Exception as exc:  # a bad answer scores 0; it must not end the checker
            reply = {"equal": False, "error": f"{type(exc).__name__}: {exc}"}
        signal.alarm(0)
        protocol.write(json.dumps(reply) + "\n")
        protocol.flush()


if __name__ == "__main__":
    _serve(float(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_TIMEOUT_S)
