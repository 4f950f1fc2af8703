"""Kill -9 at any point, then ``--ckpt_path last``: the resumed run equals an uninterrupted one bit for bit, and
no kill leaves an unloadable checkpoint or a half export.

A real ``fit`` process is killed with SIGKILL by ``tests.cli.kill_points.KillAt`` (a callback given on the
command line; nothing in the package is patched) at a point drawn from a seeded RNG: during PPO's sampling (a
generated token), during its update (after a micro-batch's backward, before its optimizer step), or during a
checkpoint write (part of the bytes on disk). Then:

* the process died by SIGKILL; every ``*.ckpt`` left loads, and ``last.ckpt`` is the previous complete one
  (``ppo.checkpoint_every: 1``: the iteration before the killed one); the export folder does not exist (the
  export is one transaction, committed only at the end); the folder locks of the dead run are still there;
* the same command plus ``--ckpt_path last`` resumes from that ``last.ckpt`` (its log says so), takes over
  the stale locks, finishes, releases them and leaves no staging folder behind (nor the killed checkpoint
  write's temporary file: its first save removes it, in one log line);
* its final checkpoint (adapters, value head, optimizer and scheduler state, KL controller, reward statistics,
  RNG, iteration history) and its export equal those of one uninterrupted run with ``torch.equal``: resume is
  exact (``tests/cli/test_ckpt_path.py``), so the uninterrupted run from that checkpoint is the whole run.

The SFT and reward stages are killed once each in their update, in their second epoch, and resume from the
end-of-epoch ``last.ckpt`` of a ``ModelCheckpoint``, with shuffling on: their loaders do not resume mid-epoch
(the PPO prompt loader does), but the checkpoint carries the state of the generator their epoch orders come
from, so the second epoch sees the uninterrupted run's order (docs/resume.md).

Processes: the fits run ``rlhf_lit.cli.main`` -- the console script's entry point -- in child processes of a
``multiprocessing`` fork server that has imported torch, Lightning and transformers once (on 2 cores a fresh
interpreter spends ~15 s importing them); the PPO checkpoint-write case runs the ``rlhf-lit`` console script
itself. The ``-m slow`` run kills PPO once per phase and SFT and reward once each; ``-m heavy`` adds 5 more
points per PPO phase (different seeds).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.cli.helpers import assert_same, run_cli, without_timings
from tests.cli.kill_points import run_main
from tests.conftest import REPO_ROOT

pytestmark = pytest.mark.slow

N_ITER, PROMPTS, MINIBATCH, MICRO, EPOCHS, MAX_NEW_TOKENS = 4, 4, 2, 1, 2, 8
BACKWARDS_PER_ITER = EPOCHS * PROMPTS // MICRO  # 8 micro-batches (4 optimizer steps) per iteration
PRELOAD = ["torch", "lightning.pytorch", "transformers", "peft", "rlhf_lit.lightning_cli", "rlhf_lit.modules"]
KILL = "tests.cli.kill_points.KillAt"
_CONTEXT: list = []


def _fork_server():
    if not _CONTEXT:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _CONTEXT.append(context)
    return _CONTEXT[0]


def _fit(args: list[str], log: Path, console: bool = False) -> int:
    """Run ``rlhf-lit fit <args>``; its output goes to ``log``. Returns the exit status (-9: SIGKILL)."""
    if console:
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        result = run_cli("fit", *args, env={"PYTHONPATH": path}, timeout=600)
        log.write_text(result.stdout + result.stderr)
        return result.returncode
    process = _fork_server().Process(target=run_main, args=(["fit", *args], str(log)))
    process.start()
    process.join(600)
    if process.exitcode is None:
        process.kill()
        pytest.fail(f"fit did not end in 600 s: {log}")
    return process.exitcode


def _tail(log: Path) -> str:
    return log.read_text()[-3000:] if log.exists() else "(no log)"


def _load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def _checkpoints_load(root: Path) -> list[Path]:
    """Every ``*.ckpt`` under ``root`` loads (weights only); returns them."""
    found = sorted(root.rglob("*.ckpt"))
    for path in found:
        _load(path)
    return found


def _locks(root: Path) -> list[Path]:
    return sorted([*root.parent.glob(f".{root.name}.rlhf_lit.lock"), *root.rglob(".*.rlhf_lit.lock")])


def _assert_same_run(straight: dict, resumed: dict, what: str) -> None:
    assert straight["global_step"] == resumed["global_step"] > 0
    for key in ("state_dict", "optimizer_states", "lr_schedulers"):
        assert_same(straight[key], resumed[key], f"{what}.{key}")
    if "ppo_state" in straight:
        history = [without_timings(run["ppo_state"]["history"]) for run in (straight, resumed)]
        assert_same(history[0], history[1], f"{what}.history")
        rest = [{k: v for k, v in run["ppo_state"].items() if k != "history"} for run in (straight, resumed)]
        assert_same(rest[0], rest[1], f"{what}.ppo_state")


def _assert_same_export(straight: Path, resumed: Path) -> None:
    assert (resumed / "rlhf_lit.json").is_file()
    assert sorted(p.name for p in resumed.iterdir()) == sorted(p.name for p in straight.iterdir())
    weights = sorted(str(p.relative_to(straight)) for p in straight.rglob("*.safetensors"))
    assert weights
    for name in weights:  # the merged model and, for PPO, the adapter alone
        assert_same(load_file(straight / name), load_file(resumed / name), name)


# ---------------------------------------------------------------------------------------------------- PPO
def _ppo_args(root: Path) -> list[str]:
    """configs/ppo/tiny.yaml cut to 4 iterations of 4 prompts, 2 epochs x 2 minibatches x 2 micro-batches,
    adaptive KL and reward normalisation on (state that must be restored), a checkpoint every iteration, the
    TensorBoard logger on (each run its own version folder) and an export."""
    return [
        "--config",
        "configs/ppo/tiny.yaml",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        f"--model.init_args.export_dir={root / 'hf'}",
        f"--model.init_args.ppo.total_iterations={N_ITER}",
        f"--model.init_args.ppo.ppo_epochs={EPOCHS}",
        f"--model.init_args.ppo.ppo_minibatch_size={MINIBATCH}",
        f"--model.init_args.ppo.micro_batch_size={MICRO}",
        "--model.init_args.ppo.checkpoint_every=1",
        f"--data.init_args.batch_size={PROMPTS}",
        "--data.init_args.max_prompt_length=32",
        f"--model.init_args.sampling.max_new_tokens={MAX_NEW_TOKENS}",
        "--model.init_args.kl.adaptive=true",
        "--model.init_args.kl.target_kl=0.01",
        "--model.init_args.kl.horizon=100",
        "--model.init_args.reward.normalize=true",
        "--model.init_args.log_samples_every=0",
    ]


@pytest.fixture(scope="module")
def straight_ppo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("straight") / "run"
    assert _fit(_ppo_args(root), root.parent / "log") == 0, _tail(root.parent / "log")
    return root


def draw_point(phase: str, seed: int) -> dict:
    """Kill point number ``seed`` (0-5) of ``phase``, all six distinct, drawn by ``random.Random(phase)``: for
    sampling / update an iteration after the first (so a checkpoint exists to resume from) and the generated
    token or micro-batch within it; for a checkpoint write, which write (each of the 2nd to 4th twice) and the
    share of its bytes on disk (``random.Random(phase-seed)``)."""
    rng = random.Random(phase)
    if phase == "checkpoint":
        count = rng.sample(list(range(2, N_ITER + 1)) * 2, 6)[seed]
        fraction = round(random.Random(f"{phase}-{seed}").uniform(0.0, 0.99), 3)
        return {"phase": phase, "count": count, "fraction": fraction}
    per_iteration = MAX_NEW_TOKENS - 2 if phase == "sampling" else BACKWARDS_PER_ITER
    points = [(i, c) for i in range(2, N_ITER + 1) for c in range(1, per_iteration + 1)]
    batch, count = rng.sample(points, 6)[seed]
    return {"phase": phase, "batch": batch, "count": count}


def _kill_args(point: dict) -> list[str]:
    return [f"--trainer.callbacks+={KILL}", *(f"--trainer.callbacks.{k}={v}" for k, v in point.items())]


def kill_and_resume_ppo(root: Path, straight: Path, point: dict, console: bool = False) -> None:
    args, log = _ppo_args(root), root.parent / "killed.log"
    assert _fit(args + _kill_args(point), log, console) == -9, f"{point}: not killed\n{_tail(log)}"

    # what the kill left: loadable checkpoints, the previous complete last.ckpt, no export, the dead run's locks
    done = point["count"] - 1 if point["phase"] == "checkpoint" else point["batch"] - 1
    assert root / "last.ckpt" in _checkpoints_load(root), point
    assert _load(root / "last.ckpt")["ppo_state"]["iteration"] == done, point
    assert not (root / "hf").exists(), point
    assert _locks(root), point
    if point["phase"] == "checkpoint":
        assert [p.name for p in root.glob("last.ckpt.tmp-*")], point  # the part-written temporary file

    log = root.parent / "resumed.log"
    assert _fit([*args, "--ckpt_path", "last"], log) == 0, f"{point}\n{_tail(log)}"
    assert re.search(r"Restoring states from the checkpoint path at .*last\.ckpt", log.read_text()), point
    assert _locks(root) == [] and not list(root.glob(".hf.partial-*")), point
    if point["phase"] == "checkpoint":  # the resumed run's first save removed the killed run's temporary file
        assert not list(root.glob("*.tmp-*")), point
        assert "temporary file(s) of killed runs" in log.read_text(), point
    _checkpoints_load(root)
    _assert_same_run(_load(straight / "last.ckpt"), _load(root / "last.ckpt"), str(point))
    _assert_same_export(straight / "hf", root / "hf")


def test_the_straight_run_checkpoints_every_iteration_and_exports(straight_ppo):
    checkpoint = _load(straight_ppo / "last.ckpt")
    assert checkpoint["ppo_state"]["iteration"] == N_ITER
    assert checkpoint["global_step"] == N_ITER * EPOCHS * PROMPTS // MINIBATCH
    assert (straight_ppo / "hf" / "rlhf_lit.json").is_file() and _locks(straight_ppo) == []


@pytest.mark.parametrize("phase", ["sampling", "update"])
def test_ppo_killed_then_resumed_equals_the_uninterrupted_run(phase, straight_ppo, tmp_path):
    kill_and_resume_ppo(tmp_path / "run", straight_ppo, draw_point(phase, 0))


def test_ppo_killed_while_writing_a_checkpoint_keeps_the_previous_one(straight_ppo, tmp_path):
    """Through the ``rlhf-lit`` console script itself."""
    kill_and_resume_ppo(tmp_path / "run", straight_ppo, draw_point("checkpoint", 0), console=True)


@pytest.mark.heavy
@pytest.mark.parametrize("seed", range(1, 6))
@pytest.mark.parametrize("phase", ["sampling", "update", "checkpoint"])
def test_ppo_killed_at_more_random_points(phase, seed, straight_ppo, tmp_path):
    kill_and_resume_ppo(tmp_path / "run", straight_ppo, draw_point(phase, seed))


# ------------------------------------------------------------------------------------------ SFT and reward
STAGES = {
    "sft": ["--config", "configs/sft/tiny.yaml", "--data.init_args.max_train_samples_per_file=48"],
    "reward": ["--config", "configs/reward/tiny.yaml", "--data.init_args.max_train_samples_per_file=32"],
}
BATCHES_PER_EPOCH, STAGE_EPOCHS = 3, 2


def _stage_args(stage: str, root: Path) -> list[str]:
    return [
        *STAGES[stage],
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        f"--trainer.logger.init_args.save_dir={root}",
        f"--model.init_args.export_dir={root / 'hf'}",
        f"--trainer.max_epochs={STAGE_EPOCHS}",
        f"--trainer.limit_train_batches={BATCHES_PER_EPOCH}",
        "--trainer.limit_val_batches=1",
        "--data.init_args.val_size=8",
        "--data.init_args.batch_size=4",
        "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
        f"--trainer.callbacks.dirpath={root / 'ck'}",
        "--trainer.callbacks.save_last=true",
    ]


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_sft_and_reward_killed_in_the_update_then_resumed_equal_the_uninterrupted_run(stage, tmp_path):
    straight, root = tmp_path / "straight", tmp_path / "run"
    assert _fit(_stage_args(stage, straight), tmp_path / "straight.log") == 0, _tail(
        tmp_path / "straight.log"
    )
    rng = random.Random(f"{stage}-0")
    point = {"phase": "update", "batch": BATCHES_PER_EPOCH + rng.randint(1, BATCHES_PER_EPOCH), "count": 1}
    args, log = _stage_args(stage, root), tmp_path / "killed.log"
    assert _fit(args + _kill_args(point), log) == -9, f"{point}: not killed\n{_tail(log)}"
    assert _load(root / "ck" / "last.ckpt")["global_step"] == BATCHES_PER_EPOCH  # the first epoch's
    _checkpoints_load(root)
    assert not (root / "hf").exists() and _locks(root)

    log = tmp_path / "resumed.log"
    assert _fit([*args, "--ckpt_path", "last"], log) == 0, _tail(log)
    assert re.search(r"Restoring states from the checkpoint path at .*last\.ckpt", log.read_text())
    assert _locks(root) == []
    _checkpoints_load(root)
    _assert_same_run(_load(straight / "ck" / "last.ckpt"), _load(root / "ck" / "last.ckpt"), stage)
    _assert_same_export(straight / "hf", root / "hf")
