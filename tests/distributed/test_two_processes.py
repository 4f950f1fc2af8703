"""Two CPU processes (gloo) under ``ddp`` and under FSDP2 (``ModelParallelStrategy`` via ``FSDP2Strategy``).

Each strategy's scenarios run in ONE worker launch (``worker.py``; Lightning's launcher starts rank 1), once
per session, because starting two processes and importing the stack costs most of the time; each test then
checks its scenario's results. What is checked:

* the tiny reward and PPO configs run through the CLI on 2 processes, and export;
* a rank whose responses all stop at the first token keeps stepping until the other rank finishes
  (synchronised generation; docs/pitfalls.md: FSDP generation) -- forced on rank 0 with a logits processor;
* a 2-rank PPO run (2 x 4 prompts) makes the same updates as a 1-rank run on the same 8 prompts, with 2
  global minibatches per epoch and 2 epochs (one permutation of the global batch per epoch, shared by the
  ranks; fixed, prompt-determined responses of uneven lengths, so the ranks hold different row and token
  counts in a minibatch; global whitening, reward normalisation, adaptive KL, clipping by the global
  gradient norm) -- under DDP and FSDP2 on one machine, and under DDP across 2 "nodes" of one process each,
  launched like a multi-node job (``torchrun --nnodes 2`` twice on localhost, gloo; Lightning
  ``num_nodes=2``);
* across the same 2 "nodes", a DPO fit (sigmoid loss, LoRA, 4 steps of 2 pairs per rank) logs the losses and
  makes the updates of one process fitting the same 4-pair global batches;
* FSDP2 checkpoints, sharded (a folder) and full (one file), resume a PPO run exactly (each rank takes back
  its own random state);
* the two ranks, started from one seed and given the same prompt in every row, sample different responses,
  in training and in validation.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rlhf_lit import metrics as M
from tests.conftest import REPO_ROOT
from tests.distributed import scenarios as S

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("worker.py")
SCENARIOS = {
    "ddp": ["equality", "equality_grpo", "reward_tiny", "dpo_tiny", "ppo_tiny", "sample_apart"],
    "fsdp2": ["equality", "equality_grpo", "resume", "reward_tiny", "dpo_tiny", "ppo_tiny"],
}
# Statistics that must agree between 1 and 2 ranks (global by construction); the rest are timings.
GLOBAL_STATS = (
    M.ROLLOUT_SCORE_MEAN,
    M.ROLLOUT_SCORE_STD,
    M.ROLLOUT_KL_REF,
    M.ROLLOUT_RESPONSE_LEN,
    M.ROLLOUT_NO_EOS_FRAC,
    M.PPO_ADVANTAGE_MEAN,
    M.PPO_RETURN_MEAN,
    M.CRITIC_VALUE_MEAN,
    M.PPO_POLICY_LOSS,
    M.PPO_VALUE_LOSS,
    M.PPO_ENTROPY,
    M.PPO_GRAD_NORM,
    M.PPO_KL_COEF,
    M.PPO_CLIPFRAC,
    M.PPO_APPROX_KL,
)


# A cap, not a cost: on a machine shared with other jobs a worker took over 240 s (the earlier cap) and the
# fixture errored though nothing was wrong.
WORKER_TIMEOUT_S = 900


def _launch(strategy: str, out: Path, scenarios: list[str] | None = None) -> Path:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(WORKER), strategy, str(out), *(scenarios or SCENARIOS[strategy])],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=WORKER_TIMEOUT_S,
    )
    (out / "worker.log").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (
        f"{strategy} worker failed after {time.perf_counter() - start:.0f} s:\n"
        + (proc.stdout + proc.stderr)[-6000:]
    )
    return out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch_two_nodes(out: Path) -> Path:
    """``torchrun --nnodes 2 --nproc-per-node 1 --node-rank {0,1}`` on localhost: how a 2-machine job starts
    (each machine runs the same command with its own node rank, pointing at node 0's address)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    port = _free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run"]  # what the `torchrun` console script runs
    procs = [
        subprocess.Popen(
            [
                *torchrun,
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(WORKER),
                "ddp_nodes",
                str(out),
                "equality",
                "dpo_equality",
            ],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=WORKER_TIMEOUT_S)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    (out / "worker.log").write_text("\n".join(logs))
    assert all(p.returncode == 0 for p in procs), "torchrun 2-node launch failed:\n" + "\n".join(logs)[-6000:]
    return out


_RUNS: dict[str, Path] = {}


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def run(request, tmp_path_factory) -> tuple[str, Path]:
    strategy = request.param
    if strategy not in _RUNS:
        _RUNS[strategy] = _launch(strategy, tmp_path_factory.mktemp(f"dist_{strategy}"))
    return strategy, _RUNS[strategy]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The 1-rank reference: 1 process x 8 prompts, in this process."""
    return S.run_equality(tmp_path_factory.mktemp("one_rank"), None, world_size=1)


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _weights_file(strategy: str) -> str:
    """What names an export's merged weights: under FSDP2 they are streamed one FSDP unit per file, with an index."""
    return "model.safetensors.index.json" if strategy == "fsdp2" else "model.safetensors"


def test_tiny_reward_config_runs_on_two_processes(run):
    strategy, out = run
    result = _read(out / "reward_tiny.json")
    assert result["finished"] and result["world_size"] == 2 and result["global_step"] == 2
    assert {"reward_head.safetensors", _weights_file(strategy), "eval_results.json"} <= set(result["export"])
    assert result["temperature"] > 0


def test_tiny_dpo_config_runs_on_two_processes(run):
    """packing is on by default: each rank packs its own rows into one forward per batch, under DDP and under
    FSDP2, where every forward gathers with the other rank (``trim_padding``, a forward per length group, falls
    back to one padded forward there: ranks grouping differently would wait for each other forever)."""
    strategy, out = run
    result = _read(out / "dpo_tiny.json")
    assert result["finished"] and result["world_size"] == 2 and result["global_step"] == 2
    assert {_weights_file(strategy), "rlhf_lit.json"} <= set(result["export"])
    assert 0.5 < result["loss"] < 0.9  # near ln 2 after 2 small steps


def test_tiny_ppo_config_runs_and_generation_waits_for_the_slowest_rank(run):
    strategy, out = run
    result = _read(out / "ppo_tiny.json")
    assert result["finished"] and result["world_size"] == 2 and result["iteration"] == 2
    assert {"adapter", _weights_file(strategy), "rlhf_lit.json"} <= set(result["export"])
    # pitfall: FSDP generation: rank 0 stops every response at its first token; rank 1 keeps sampling; both ranks then went on
    # to the reference, update and next rollout (2 iterations, no hang).
    rank0 = _read(out / "ppo_tiny_rank0.json")["response_lengths"]
    rank1 = _read(out / "ppo_tiny_rank1.json")["response_lengths"]
    assert len(rank0) == len(rank1) == 2
    assert all(length == 1 for rollout in rank0 for length in rollout)
    assert max(max(rollout) for rollout in rank1) >= 5
    history = result["history"]
    assert all(torch.isfinite(torch.tensor(h[M.PPO_POLICY_LOSS])) for h in history)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory) -> Path:
    return _launch_two_nodes(tmp_path_factory.mktemp("dist_two_nodes"))


def test_two_ranks_make_the_same_update_as_one_rank(run, one_rank):
    strategy, out = run
    _check_equality(out, one_rank)


def test_two_nodes_of_one_process_make_the_same_update_as_one_rank(two_nodes, one_rank):
    two = _check_equality(two_nodes, one_rank)
    assert two["num_nodes"] == 2 and two["world_size"] == 2


@pytest.fixture(scope="module")
def one_process_dpo(tmp_path_factory) -> dict:
    """The 1-process DPO reference: 4 pairs per batch, in this process."""
    return S.run_dpo_equality(tmp_path_factory.mktemp("one_process_dpo"), None, world_size=1)


def test_two_nodes_of_one_process_make_the_same_dpo_fit_as_one_process(two_nodes, one_process_dpo):
    """DDP averages the 2 ranks' gradients, each of the mean loss over the rank's 2 pairs: with equal per-rank
    batches that is the gradient of the mean over the global batch of 4, which one process computes whole."""
    one = one_process_dpo
    two = torch.load(two_nodes / "dpo_equality" / "dpo_equality.pt", weights_only=False)
    ranks = [_read(two_nodes / "dpo_equality" / f"dpo_rank{r}.json") for r in (0, 1)]
    assert two["num_nodes"] == 2 and two["world_size"] == 2 and one["world_size"] == 1
    steps = S.DPO_PAIRS // S.DPO_GLOBAL_BATCH
    assert one["global_step"] == two["global_step"] == steps == 4
    # each step, the ranks held disjoint halves of the one process's batch (Lightning's DistributedSampler), and
    # the epoch saw every pair once
    assert len(set(sum(ranks[0]["pairs"] + ranks[1]["pairs"], []))) == S.DPO_PAIRS
    for k in range(steps):
        assert len(ranks[0]["pairs"][k]) == len(ranks[1]["pairs"][k]) == S.DPO_GLOBAL_BATCH // 2
        assert sorted(ranks[0]["pairs"][k] + ranks[1]["pairs"][k]) == sorted(one["pairs"][k]), k
    # every loss is log 2 before the first update (lora_B starts at 0); then the mean of the ranks' losses is
    # the one process's loss, which moved (0.693 -> 0.682) by far more than the tolerance. The two runs sum
    # in other orders (2 pairs packed per forward vs 4): 4e-7 relative apart at most, measured; 1e-5 allowed.
    global_losses = [(a + b) / 2 for a, b in zip(ranks[0]["losses"], ranks[1]["losses"])]
    assert one["losses"][0] == pytest.approx(math.log(2.0), abs=1e-6)
    assert one["losses"][0] - one["losses"][-1] > 5e-3
    assert ranks[0]["losses"][1:] != ranks[1]["losses"][1:]  # the ranks' pairs differ, so do their losses
    assert global_losses == pytest.approx(one["losses"], rel=1e-5)
    assert set(two["delta"]) == set(one["delta"])
    # the updates (after - before: lora_A's entries are ~0.1, its changes ~3e-5) agree to 1e-8 + 1e-4 relative;
    # measured: 9.3e-10 apart at most, where lora_B moves up to 2.9e-3
    for name, delta in one["delta"].items():
        assert delta.abs().max() > 1e-5, name  # every LoRA matrix moved (lora_A from the second step on)
        torch.testing.assert_close(
            two["delta"][name], delta, rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
        )


def _check_equality(out: Path, one_rank: dict) -> dict:
    two = torch.load(out / "equality" / "equality.pt", weights_only=False)
    assert two["iteration"] == one_rank["iteration"] == S.EQUALITY_ITERATIONS
    assert one_rank["world_size"] == 1 and two["world_size"] == 2
    # several optimizer steps per iteration: 2 epochs x 2 minibatches, none skipped
    steps = S.EQUALITY_ITERATIONS * S.EQUALITY_EPOCHS * S.MINIBATCHES_PER_EPOCH
    assert one_rank["global_step"] == two["global_step"] == steps == 8
    for h in one_rank["history"] + two["history"]:
        assert h[M.PPO_SKIPPED_STEPS] == 0.0
    # the ranks held different numbers of response tokens (else per-rank and global token means agree)
    ranks = [_read(out / "equality" / f"tokens_rank{r}.json") for r in (0, 1)]
    tokens = [r["tokens"] for r in ranks]
    assert len(tokens[0]) == S.EQUALITY_ITERATIONS and all(a != b for a, b in zip(*tokens)), tokens
    # each global minibatch (4 rows) is split between the ranks by the shared permutation: uneven at least once
    # (so a rank ran an empty, zero-weight micro-batch), and always 4 rows in all
    rows = [r["rows_per_minibatch"] for r in ranks]
    assert len(rows[0]) == S.EQUALITY_ITERATIONS * S.EQUALITY_EPOCHS * S.MINIBATCHES_PER_EPOCH
    assert all(a + b == S.GLOBAL_BATCH // S.MINIBATCHES_PER_EPOCH for a, b in zip(*rows)), rows
    assert any(a != b for a, b in zip(*rows)), rows
    # the KL controller and the reward normaliser hold the same state on both ranks
    assert ranks[0]["kl_coef"] == ranks[1]["kl_coef"]
    assert ranks[0]["score_stats"] == ranks[1]["score_stats"]
    for h in one_rank["history"]:
        assert h[M.PPO_GRAD_NORM] > S.EQUALITY_MAX_GRAD_NORM  # clipping by the global norm was active
    for name, delta in one_rank["delta"].items():
        # lora_A moves ~1e-8 here (lora_B starts at 0), hence the tiny atol: rtol carries the check
        torch.testing.assert_close(
            two["delta"][name], delta, rtol=1e-4, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )
        if ("lora_B" in name and ".actor." in name) or "value_head" in name:
            # the update is not trivially zero (the critic adapter barely moves: the value head starts at 0)
            assert delta.abs().max() > 1e-5, name
    assert two["kl_coef"] == pytest.approx(one_rank["kl_coef"], rel=1e-6) != 0.05
    assert two["score_stats"]["count"] == one_rank["score_stats"]["count"] == 2 * S.GLOBAL_BATCH
    assert two["score_stats"]["mean"] == pytest.approx(one_rank["score_stats"]["mean"], rel=1e-5)
    assert two["score_stats"]["m2"] == pytest.approx(one_rank["score_stats"]["m2"], rel=1e-5)
    for h1, h2 in zip(one_rank["history"], two["history"]):
        for key in GLOBAL_STATS:
            # KL-type statistics are differences of nearly equal float32 log-probs (|log p| ~ 5 nats): their
            # rounding is ~1e-6 nats per response whatever their value, hence the absolute tolerance
            tol = 2e-6 if key in (M.ROLLOUT_KL_REF, M.PPO_APPROX_KL) else 1e-7
            assert h2[key] == pytest.approx(h1[key], rel=1e-4, abs=tol), key
    return two


def test_fsdp2_checkpoints_sharded_and_full_resume_exactly(run):
    strategy, out = run
    if strategy != "fsdp2":
        pytest.skip("checkpoint formats of ModelParallelStrategy (FSDP2)")
    result = torch.load(out / "resume.pt", weights_only=False)
    assert result["fsdp2_is_dir"] and not result["fsdp2_full_is_dir"]  # sharded folder vs single file
    straight = result["straight"]
    for kind in ("fsdp2", "fsdp2_full"):
        assert result[f"{kind}_iteration"] == 2
        assert result[f"{kind}_kl"] == result["straight_kl"]
        for name, value in straight.items():
            torch.testing.assert_close(result[kind][name], value, atol=1e-6, rtol=0)
    # only adapters and heads are saved (no frozen base), in both formats
    from torch.distributed.checkpoint import FileSystemReader

    keys = [
        k
        for k in FileSystemReader(out / "fsdp2.ckpt").read_metadata().state_dict_metadata
        if k.startswith("state_dict.")
    ]
    assert keys and all("lora_" in k or "value_head" in k for k in keys)
    full = torch.load(out / "fsdp2_full.ckpt", weights_only=False)
    assert full["state_dict"] and all("lora_" in k or "value_head" in k for k in full["state_dict"])


def test_ranks_started_from_one_seed_sample_apart_in_training_and_validation(run):
    """Every row holds the same prompt on both ranks and both start from the same seed; had each rank drawn the
    same random numbers (as before ``rlhf_lit.rng.start_rank_stream``), row i of rank 0 would equal row i of
    rank 1."""
    strategy, out = run
    if strategy != "ddp":
        pytest.skip("one strategy is enough: the streams are set apart by the module, not the strategy")
    ranks = [_read(out / f"sample_apart_rank{r}.json") for r in (0, 1)]
    for phase in ("train", "validation"):
        rank_0, rank_1 = ranks[0][phase], ranks[1][phase]
        assert len(rank_0) == len(rank_1) >= 4, phase
        assert sum(map(len, rank_0)) >= 2 * len(rank_0), phase  # responses long enough to tell apart
        same = sum(a == b for a, b in zip(rank_0, rank_1))
        assert same <= 1, (phase, same)  # at most a chance match (both stopping at once, say)


@pytest.fixture(scope="module")
def one_rank_grpo(tmp_path_factory) -> dict:
    """The 1-rank GRPO reference: 1 process x 8 prompts x 2 responses."""
    return S.run_equality(tmp_path_factory.mktemp("one_rank_grpo"), None, world_size=1, group=True)


def test_two_ranks_keep_groups_together_and_make_the_same_grpo_update_as_one_rank(run, one_rank_grpo):
    """GRPO, 2 responses per prompt: each rank samples the 2 responses of its prompts in consecutive rows
    (the group statistics are local), and 2 ranks x 4 prompts update as 1 rank x 8 prompts (DDP, and FSDP2:
    no value head to shard)."""
    strategy, out = run
    two = torch.load(out / "equality_grpo" / "equality.pt", weights_only=False)
    ranks = [_read(out / "equality_grpo" / f"tokens_rank{r}.json") for r in (0, 1)]
    assert all(r["groups_together"] == [True] * S.EQUALITY_ITERATIONS for r in ranks)
    assert two["iteration"] == one_rank_grpo["iteration"] == S.EQUALITY_ITERATIONS
    assert one_rank_grpo["global_step"] == two["global_step"] == 8
    rows = [r["rows_per_minibatch"] for r in ranks]  # 8 responses per global minibatch, split unevenly once
    assert all(a + b == S.GLOBAL_BATCH * S.GROUP_SIZE // S.MINIBATCHES_PER_EPOCH for a, b in zip(*rows)), rows
    assert any(a != b for a, b in zip(*rows)), rows
    assert not [n for n in one_rank_grpo["delta"] if "critic" in n or "value_head" in n]
    assert set(two["delta"]) == set(one_rank_grpo["delta"])
    for name, delta in one_rank_grpo["delta"].items():
        torch.testing.assert_close(
            two["delta"][name], delta, rtol=1e-4, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
        )
        if "lora_B" in name:
            assert delta.abs().max() > 1e-5, name
    keys = [k for k in GLOBAL_STATS if k in one_rank_grpo["history"][0]] + [M.PPO_KL_LOSS]
    assert M.PPO_VALUE_LOSS not in keys and len(keys) > 8
    for h1, h2 in zip(one_rank_grpo["history"], two["history"]):
        for key in keys:
            tol = 2e-6 if key in (M.ROLLOUT_KL_REF, M.PPO_APPROX_KL, M.PPO_KL_LOSS) else 1e-7
            assert h2[key] == pytest.approx(h1[key], rel=1e-4, abs=tol), key
