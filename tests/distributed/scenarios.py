"""What the 2-process CPU tests run: shared by the worker script (both ranks) and the 1-rank reference runs.

Every scenario is a plain function of an output folder, so the worker (``worker.py``, started once per
strategy and re-started by Lightning's launcher as rank 1) and pytest's own process run the same code.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning as L
import torch

from rlhf_lit import metrics as M
from rlhf_lit.modules.common import OptimizerConfig
from rlhf_lit.parallel import gathered_parameters
from rlhf_lit.rl.settings import KLConfig, PPOConfig, RewardShapingConfig

# The equality scenario: one global batch of 8 prompts, as 1 rank x 8 or 2 ranks x 4, in 2 global minibatches
# of 4 per epoch (ppo_minibatch_size 4 on one rank, 2 per rank on two), 2 epochs, 2 iterations.
GLOBAL_BATCH = 8
MINIBATCHES_PER_EPOCH = 2
EQUALITY_EPOCHS = 2
EQUALITY_ITERATIONS = 2
# Adam with eps = 1 takes a step of ~ lr * g for |g| << 1: linear in the gradient, so parameter changes
# compare like gradients (with the default eps a first step is ~ lr * sign(g), and the sign of a gradient
# that is 0 up to rounding would decide it).
EQUALITY_OPTIMIZER = OptimizerConfig(lr=1e-2, eps=1.0, scheduler="constant")
EQUALITY_MAX_GRAD_NORM = 0.05  # small, so clipping by the global norm is active and part of the check


def strategy_for(name: str):
    """A Trainer ``strategy`` for ``ddp``, ``ddp_nodes`` (DDP, one process per node) or ``fsdp2`` (FSDP2
    through ModelParallelStrategy)."""
    if name in ("ddp", "ddp_nodes"):
        return "ddp"
    if name == "fsdp2":
        from rlhf_lit.parallel.strategy import FSDP2Strategy

        return FSDP2Strategy()
    if name == "fsdp2_full":
        from rlhf_lit.parallel.strategy import FSDP2Strategy

        return FSDP2Strategy(save_distributed_checkpoint=False)
    raise ValueError(name)


def cli_strategy_args(name: str) -> list[str]:
    if name == "ddp":
        return ["--trainer.strategy=ddp"]
    return ['--trainer.strategy={"class_path": "rlhf_lit.parallel.strategy.FSDP2Strategy"}']


def rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


ROLLOUT_TOKENS: list[int] = []  # response tokens of each fixed rollout on this rank


def fixed_rollout(model, prompt_ids, prompt_mask, cfg, stop_ids, pad_token_id, synced_gpus=False):
    """A deterministic stand-in for ``sample_responses``: each response is a function of its prompt alone.

    Lengths 1..5 (the ranks of the equality test hold 6 and 12, then 17 and 14 response tokens), a stop
    token on two rows in three, pad after it. The same prompt gets the same response on any rank and in any
    batch.
    """
    rows, lengths, stops = [], [], []
    for ids, mask in zip(prompt_ids, prompt_mask.bool()):
        s = int(ids[mask].sum())
        length, has_stop = 1 + s % 5, s % 3 != 0
        tokens = [(s * 31 + 7 * j) % 200 + 40 for j in range(length)]
        if has_stop:
            tokens[-1] = stop_ids[0]
        rows.append(tokens)
        lengths.append(length)
        stops.append(has_stop)
    ROLLOUT_TOKENS.append(sum(lengths))
    width = max(lengths)
    response = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, tokens in enumerate(rows):
        response[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, : len(tokens)] = True
    return response.to(prompt_ids.device), mask.to(prompt_ids.device), torch.tensor(stops)


GROUP_SIZE = 2  # the group scenario: GRPO, 2 responses per prompt
GROUP_ROWS: list[bool] = []  # per rollout on this rank: every prompt's n rows were consecutive and distinct


def fixed_group_rollout(model, prompt_ids, prompt_mask, cfg, stop_ids, pad_token_id, synced_gpus=False):
    """``fixed_rollout`` for groups: the j-th consecutive copy of a prompt answers as prompt sum + 13 j, so
    the n responses of a prompt differ (the group has a spread) and are the same on any number of ranks as
    long as the copies of a prompt stay together. Records whether they did (``GROUP_ROWS``)."""
    copies, shifted = [], prompt_ids.clone()
    for i, (ids, mask) in enumerate(zip(prompt_ids, prompt_mask.bool())):
        same = i > 0 and torch.equal(ids, prompt_ids[i - 1]) and torch.equal(mask, prompt_mask[i - 1].bool())
        copies.append(copies[-1] + 1 if same else 0)
        shifted[i][mask.nonzero()[-1]] += (
            13 * copies[-1]
        )  # the last prompt token stands in for the copy index
    GROUP_ROWS.append(all(c == i % GROUP_SIZE for i, c in enumerate(copies)))
    return fixed_rollout(model, shifted, prompt_mask, cfg, stop_ids, pad_token_id, synced_gpus)


def equality_module(batch_per_rank: int, group: bool = False, **components):
    from rlhf_lit.rl.generation import SamplingConfig
    from tests.ppo.helpers import make_module

    n = GROUP_SIZE if group else 1
    extra = {"sampling": SamplingConfig(max_new_tokens=8, temperature=0.7, num_samples_per_prompt=n)}
    torch.manual_seed(0)  # the LoRA init: identical on every rank (FSDP2 keeps each rank's own slice)
    return make_module(
        **(extra if group else {}),
        ppo=PPOConfig(
            ppo_epochs=EQUALITY_EPOCHS,
            # per rank: the global minibatch is world_size x this, so 2 global minibatches per epoch
            ppo_minibatch_size=batch_per_rank * n // MINIBATCHES_PER_EPOCH,
            micro_batch_size=2,
            total_iterations=EQUALITY_ITERATIONS,
            max_grad_norm=EQUALITY_MAX_GRAD_NORM,
            **({"advantage_estimator": "grpo"} if group else {}),
        ),
        kl=KLConfig(kl_coef=0.05, adaptive=True, target_kl=0.01, horizon=100),
        reward=RewardShapingConfig(normalize=True, clip=5.0, missing_eos_penalty=0.5),
        optimizer=EQUALITY_OPTIMIZER,
        **components,
    )


def trainable_state(module) -> dict[str, torch.Tensor]:
    """Full copies of the trainable parameters (gathered from the shards under FSDP2; every rank calls)."""
    with gathered_parameters(module):
        return {n: p.detach().clone().cpu() for n, p in module.named_parameters() if p.requires_grad}


def run_equality(out: Path, strategy: str | None, world_size: int, group: bool = False) -> dict:
    """PPO iterations on fixed responses; returns (and, on rank 0, saves) the update and the statistics.
    ``group``: GRPO with ``GROUP_SIZE`` responses per prompt (``fixed_group_rollout``)."""
    from functools import partial

    from rlhf_lit.rl.sampler import HFSampler
    from rlhf_lit.rl.schedule import epoch_schedule
    from tests.ppo.helpers import make_data, make_trainer

    batch = GLOBAL_BATCH // world_size
    rows_per_minibatch: list[int] = []  # this rank's rows in each global minibatch, in order

    def schedule(*args):
        out = epoch_schedule(*args)
        rows_per_minibatch.extend(int(rows.numel()) for rows, _ in out)
        return out

    sampler = partial(HFSampler, generate=fixed_group_rollout if group else fixed_rollout)
    module = equality_module(batch, group, sampler=sampler, schedule=schedule)
    before = trainable_state(module)
    ROLLOUT_TOKENS.clear()
    GROUP_ROWS.clear()
    if strategy is None:
        kwargs = {}
    elif strategy == "ddp_nodes":  # launched by torchrun --nnodes world_size, one process per node
        kwargs = {"num_nodes": world_size, "devices": 1, "strategy": "ddp"}
    else:
        kwargs = {"devices": world_size, "strategy": strategy_for(strategy)}
    trainer = make_trainer(out / "run", **kwargs)
    trainer.fit(module, datamodule=make_data(module, batch_size=batch))
    after = trainable_state(module)
    result = {
        "delta": {n: after[n] - before[n] for n in after},
        "history": module.history,
        "kl_coef": module.kl_ctl.value,
        "score_stats": module.score_stats.state_dict(),
        "iteration": module.iteration,
        "world_size": module.trainer.world_size,
        "num_nodes": module.trainer.num_nodes,
        "global_step": module.trainer.global_step,
    }
    if world_size > 1:
        write_json(
            out / f"tokens_rank{rank()}.json",
            {
                "tokens": list(ROLLOUT_TOKENS),
                "rows_per_minibatch": rows_per_minibatch,
                "groups_together": list(GROUP_ROWS),
                "kl_coef": module.kl_ctl.value,
                "score_stats": module.score_stats.state_dict(),
            },
        )
    if rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / "equality.pt")
    return result


# The DPO equality scenario: 16 pairs in global batches of 4, as 1 process x 4 or 2 ranks x 2 (4 optimizer
# steps, one epoch). Equal per-rank batches, so DDP's mean of the 2 ranks' gradients (each of the mean loss
# over the rank's pairs) is the gradient of the mean over the global batch.
DPO_PAIRS = 16
DPO_GLOBAL_BATCH = 4
DPO_SEED = 0  # seed_everything's, as a config's ``seed_everything: 0``


class StepRecorder(L.Callback):
    """A Lightning callback: after each training batch, the logged ``train/loss`` (this rank's mean over its
    pairs) and one fingerprint per pair (the sum of its chosen token ids), so a test can see which pairs
    each rank trained on."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.pairs: list[list[int]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.callback_metrics[M.TRAIN_LOSS]))
        ids, mask = batch["chosen_input_ids"], batch["chosen_attention_mask"].bool()
        self.pairs.append([int(row[m].sum()) for row, m in zip(ids, mask)])


def run_dpo_equality(out: Path, strategy: str | None, world_size: int) -> dict:
    """A DPO fit (sigmoid loss, the reference = the base with the LoRA adapter off, ``EQUALITY_OPTIMIZER``) of
    ``DPO_PAIRS`` pairs in global batches of ``DPO_GLOBAL_BATCH``, per rank ``DPO_GLOBAL_BATCH / world_size``;
    ``strategy`` as in ``run_equality``. Writes ``dpo_rank<r>.json`` (that rank's logged losses and pairs per
    step) and, on rank 0, ``dpo_equality.pt`` (the change of every trainable parameter); returns the latter.
    """
    from tests.dpo.helpers import make_data, make_module, make_trainer, write_pairs

    out.mkdir(parents=True, exist_ok=True)
    # one file per process (no race), read in file order: under 2 ranks the data module's own sampler gives
    # rank r rows r, r + 2, ... (``BaseDataModule.train_dataloader``), so each global batch is one process's batch
    pairs = Path(write_pairs(out / f"pairs_{os.getpid()}.jsonl", n=DPO_PAIRS))
    L.seed_everything(DPO_SEED, verbose=False)  # the LoRA init
    module = make_module(loss_type="sigmoid", optimizer=EQUALITY_OPTIMIZER)
    before = trainable_state(module)
    if strategy is None:
        kwargs = {}
    elif strategy == "ddp_nodes":
        kwargs = {"num_nodes": world_size, "devices": 1, "strategy": "ddp"}
    else:
        kwargs = {"devices": world_size, "strategy": strategy_for(strategy)}
    recorder = StepRecorder()
    trainer = make_trainer(out / "run", callbacks=[recorder], **kwargs)
    data = make_data(module, str(pairs), batch_size=DPO_GLOBAL_BATCH // world_size, val_size=0, shuffle=False)
    trainer.fit(module, datamodule=data)
    after = trainable_state(module)
    write_json(out / f"dpo_rank{rank()}.json", {"losses": recorder.losses, "pairs": recorder.pairs})
    result = {
        "delta": {n: after[n] - before[n] for n in after},
        "losses": recorder.losses,
        "pairs": recorder.pairs,
        "world_size": trainer.world_size,
        "num_nodes": trainer.num_nodes,
        "global_step": trainer.global_step,
    }
    if rank() == 0:
        torch.save(result, out / "dpo_equality.pt")
    return result


def write_json(path: Path, data: dict) -> None:
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
