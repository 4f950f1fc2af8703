"""Runs the 2-process CPU scenarios of one strategy: ``python worker.py <ddp|fsdp2> <out_dir> <scenario>...``.

``ddp_nodes`` is DDP across 2 nodes of one process each: the worker is then started by ``torchrun --nnodes 2``
once per "node" (no Lightning launcher), and ``equality`` and ``dpo_equality`` run with
``Trainer(num_nodes=2, devices=1)``.

Started by ``test_two_processes.py`` as an ordinary script. Its first ``Trainer.fit`` makes Lightning's
launcher start this same command again as rank 1 (``LOCAL_RANK=1``); later fits in the same processes
reuse the process group. Each rank runs the scenarios in the same order; results go to ``<out_dir>``
(rank 0's files, plus per-rank ``*_rank<r>.json`` where a scenario records something per rank).

Scenarios:
    reward_tiny  ``configs/reward/tiny.yaml`` through the CLI, 2 steps, outputs in ``<out_dir>``.
    dpo_tiny     ``configs/dpo/tiny.yaml`` through the CLI, 2 steps (``packing`` on).
    ppo_tiny     ``configs/ppo/tiny.yaml`` through the CLI, 2 iterations, with rank 0 forced to emit its
                 stop token first (docs/pitfalls.md: FSDP generation: it must keep stepping until rank 1 finishes).
    equality     ``scenarios.run_equality`` on 2 ranks x 4 prompts (2 global minibatches per epoch, 2 epochs).
    equality_grpo  the same with GRPO and 2 responses per prompt (``run_equality(group=True)``).
    dpo_equality  ``scenarios.run_dpo_equality``: a DPO fit on 2 ranks x 2 pairs per batch (4 steps).
    resume       FSDP2 only: 2 iterations straight, vs 1 + a checkpoint (sharded, then full) + 1 resumed.
    sample_apart  1 tiny PPO iteration and a validation pass, the same prompt in every row on both ranks.
    sharded_sft  FSDP2 only: one SFT step with the base loaded whole on every rank, then built on meta and
                 loaded shard by shard (``sharded_load.py``); ``<out_dir>/base`` must hold the saved base.
    sharded_dpo  FSDP2 only: one DPO / KTO / full fine-tuning DPO (reference copy) step each, built on meta and
                 loaded shard by shard (``sharded_load.DPO_KINDS``); ``<out_dir>/base`` must hold the saved base.
    sharded_ppo  FSDP2 only: one PPO and one GRPO iteration, each with the policy's base loaded whole, then built on meta and loaded
                 shard by shard (``sharded_load.run_ppo``); ``<out_dir>/base`` must hold the saved base.
    ppo_cli_sharded  FSDP2 only: ``rlhf-lit fit`` of ``<out_dir>/ppo.yaml`` (PPO, policy and reward model on that base).
    sft_cli_sharded  FSDP2 only: ``rlhf-lit fit`` of ``<out_dir>/sft.yaml`` (SFT on that base), 2 steps.
    sharded_vllm  FSDP2 or DDP: 2 PPO iterations on that base with ``sampling.backend: vllm``, through the
                 server at the address in ``<out_dir>/vllm_url`` (``vllm_push.py``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tests.distributed import scenarios as S  # noqa: E402
from tests.distributed.sharded_load import sharded_dpo, sharded_ppo, sharded_sft  # noqa: E402
from tests.distributed.vllm_push import sharded_vllm  # noqa: E402


def _cli_fit(config: str, root: Path, strategy: str, *extra: str) -> object:
    from rlhf_lit.cli import cli_main
    from tests.tiny_runs import tiny_overrides

    args = ["fit", "--config", config, *tiny_overrides(Path(config), root), "--trainer.devices=2", *extra]
    args += S.cli_strategy_args(strategy)
    return cli_main(args)


def reward_tiny(out: Path, strategy: str) -> None:
    # 8 validation pairs per file (not 32): calibration scores them on every rank; the run stays the config's
    cli = _cli_fit("configs/reward/tiny.yaml", out / "reward_tiny", strategy, "--data.init_args.val_size=8")
    if S.rank() == 0:
        S.write_json(
            out / "reward_tiny.json",
            {
                "global_step": cli.trainer.global_step,
                "world_size": cli.trainer.world_size,
                "finished": cli.trainer.state.finished,
                "export": sorted(os.listdir(out / "reward_tiny" / "hf")),
                "temperature": float(cli.model.temperature),
            },
        )


def dpo_tiny(out: Path, strategy: str) -> None:
    """``configs/dpo/tiny.yaml`` through the CLI, 2 steps, ``packing`` on (the default): each rank's pairs
    differ in length, so the ranks pack their rows into different bins, one forward each."""
    cli = _cli_fit("configs/dpo/tiny.yaml", out / "dpo_tiny", strategy)
    if S.rank() == 0:
        S.write_json(
            out / "dpo_tiny.json",
            {
                "global_step": cli.trainer.global_step,
                "world_size": cli.trainer.world_size,
                "finished": cli.trainer.state.finished,
                "export": sorted(os.listdir(out / "dpo_tiny" / "hf")),
                "loss": float(cli.trainer.callback_metrics["train/loss"]),
            },
        )


def ppo_tiny(out: Path, strategy: str) -> None:
    """The tiny PPO config; rank 0's policy is forced to emit its stop token first (pitfall: FSDP generation)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    import rlhf_lit.rl.sampler as sampler_mod
    from rlhf_lit.models.adapters import AdaptedLM

    class StopNow(LogitsProcessor):
        def __init__(self, stop_id: int) -> None:
            self.stop_id = stop_id

        def __call__(self, input_ids, scores):
            forced = torch.full_like(scores, float("-inf"))
            forced[:, self.stop_id] = 0.0
            return forced

    original_generate, original_sample = AdaptedLM.generate, sampler_mod.sample_responses
    lengths: list[list[int]] = []

    def generate(self, **kwargs):
        if S.rank() == 0:
            stop_id = kwargs["generation_config"].eos_token_id[0]
            kwargs["logits_processor"] = LogitsProcessorList([StopNow(stop_id)])
        return original_generate(self, **kwargs)

    def sample(*args, **kwargs):
        response_ids, response_mask, has_stop = original_sample(*args, **kwargs)
        lengths.append(response_mask.sum(-1).tolist())
        return response_ids, response_mask, has_stop

    AdaptedLM.generate, sampler_mod.sample_responses = generate, sample
    try:
        cli = _cli_fit("configs/ppo/tiny.yaml", out / "ppo_tiny", strategy)
    finally:
        AdaptedLM.generate, sampler_mod.sample_responses = original_generate, original_sample
    S.write_json(out / f"ppo_tiny_rank{S.rank()}.json", {"response_lengths": lengths})
    if S.rank() == 0:
        S.write_json(
            out / "ppo_tiny.json",
            {
                "iteration": cli.model.iteration,
                "world_size": cli.trainer.world_size,
                "finished": cli.trainer.state.finished,
                "export": sorted(os.listdir(out / "ppo_tiny" / "hf")),
                "history": cli.model.history,
            },
        )


def _cli_fit_counting_fills(stage_module, name: str, out: Path, strategy: str):
    """``rlhf-lit fit`` of ``<out_dir>/<name>.yaml`` under FSDP2, recording how many meta parameters each call of
    ``fill_from_checkpoint`` in ``stage_module`` (the stage's module file) still had to read; writes them to
    ``<name>_cli_rank<r>.json`` and returns the CLI."""
    original, fills = stage_module.fill_from_checkpoint, []

    def fill(lm, files):
        fills.append(sum(p.is_meta for p in lm.parameters()))  # meta parameters left to read
        return original(lm, files)

    stage_module.fill_from_checkpoint = fill
    try:
        cli = _cli_fit(str(out / f"{name}.yaml"), out / f"{name}_cli", strategy)
    finally:
        stage_module.fill_from_checkpoint = original
    S.write_json(out / f"{name}_cli_rank{S.rank()}.json", {"fills": fills})
    return cli


def _run_summary(cli, out: Path, name: str) -> dict:
    return {
        "world_size": cli.trainer.world_size,
        "finished": cli.trainer.state.finished,
        "export": sorted(os.listdir(out / f"{name}_cli" / "hf")),
    }


def sft_cli_sharded(out: Path, strategy: str) -> None:
    """``rlhf-lit fit`` of ``<out_dir>/sft.yaml`` (SFT on the saved base in ``<out_dir>/base``) under FSDP2: the
    CLI builds the module with its weights deferred, each rank fills its shards in ``configure_model``."""
    import rlhf_lit.modules.sft as sft_mod

    cli = _cli_fit_counting_fills(sft_mod, "sft", out, strategy)
    if S.rank() == 0:
        S.write_json(
            out / "sft_cli.json", {"global_step": cli.trainer.global_step, **_run_summary(cli, out, "sft")}
        )


def ppo_cli_sharded(out: Path, strategy: str) -> None:
    """``rlhf-lit fit`` of ``<out_dir>/ppo.yaml`` (PPO with packing, the policy and a separate reward model on the
    saved base in ``<out_dir>/base``) under FSDP2: both are built with their weights deferred and each rank fills
    its shards of both in ``configure_model``."""
    import rlhf_lit.modules.ppo as ppo_mod

    cli = _cli_fit_counting_fills(ppo_mod, "ppo", out, strategy)
    if S.rank() == 0:
        summary = {"iteration": cli.model.iteration, "packing": cli.model.policy.packing}
        S.write_json(out / "ppo_cli.json", {**summary, **_run_summary(cli, out, "ppo")})


def equality(out: Path, strategy: str) -> None:
    S.run_equality(out / "equality", strategy, world_size=2)


def dpo_equality(out: Path, strategy: str) -> None:
    S.run_dpo_equality(out / "dpo_equality", strategy, world_size=2)


def resume(out: Path, strategy: str) -> None:
    """Exact resume through sharded and full FSDP2 checkpoints (save_distributed_checkpoint True / False)."""
    from rlhf_lit.rl.settings import KLConfig, PPOConfig, RewardShapingConfig
    from tests.ppo.helpers import make_data, make_module, make_trainer

    def module():
        torch.manual_seed(0)
        return make_module(
            ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=2),
            kl=KLConfig(kl_coef=0.05, adaptive=True, target_kl=0.01, horizon=100),
            reward=RewardShapingConfig(normalize=True, clip=3.0),
        )

    def fit(name, strategy_name, ckpt_path=None, **kwargs):
        torch.manual_seed(123)  # the run's seed, on both ranks and in every run (rank 1 then draws apart)
        m = module()
        trainer = make_trainer(out / name, devices=2, strategy=S.strategy_for(strategy_name), **kwargs)
        trainer.fit(m, datamodule=make_data(m, batch_size=4), ckpt_path=ckpt_path)
        return m, trainer

    straight, _ = fit("straight", "fsdp2")
    results = {"straight": S.trainable_state(straight), "straight_kl": straight.kl_ctl.value}
    for kind in ("fsdp2", "fsdp2_full"):
        _, trainer = fit(f"{kind}_first", kind, max_steps=2)  # 1 iteration = 2 optimizer steps
        ckpt = out / f"{kind}.ckpt"
        trainer.save_checkpoint(ckpt)
        resumed, _ = fit(f"{kind}_resumed", kind, ckpt_path=str(ckpt))
        results[kind] = S.trainable_state(resumed)
        results[f"{kind}_kl"] = resumed.kl_ctl.value
        results[f"{kind}_iteration"] = resumed.iteration
        results[f"{kind}_is_dir"] = ckpt.is_dir()
    if S.rank() == 0:
        out.mkdir(parents=True, exist_ok=True)
        torch.save(results, out / "resume.pt")


def sample_apart(out: Path, strategy: str) -> None:
    """One tiny PPO iteration and one validation pass with every prompt the same on both ranks, from the same
    seed: each rank records the response tokens it sampled in each (``sample_apart_rank<r>.json``)."""
    from rlhf_lit.data import PromptDataModule
    from rlhf_lit.rl.settings import PPOConfig
    from tests.ppo.helpers import make_module, make_trainer

    folder = out / "sample_apart"
    folder.mkdir(parents=True, exist_ok=True)
    prompts = folder / f"prompts_rank{S.rank()}.jsonl"  # the same rows, one file per rank (no shared writer)
    prompts.write_text("".join(json.dumps({"prompt": "Say something"}) + "\n" for _ in range(8)))
    torch.manual_seed(5)  # as seed_everything: the same seed on both ranks
    module = make_module(ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1))
    sampler = module.collector.sampler
    draw, responses = sampler.sample, {"train": [], "validation": []}

    def recording(*args, **kwargs):
        response_ids, response_mask, has_stop = draw(*args, **kwargs)
        phase = "validation" if module.trainer.validating else "train"
        responses[phase] += [ids[m.bool()].tolist() for ids, m in zip(response_ids, response_mask)]
        return response_ids, response_mask, has_stop

    sampler.sample = recording
    data = PromptDataModule(
        train_files=[str(prompts)], val_files=[str(prompts)], batch_size=4, tokenizer=module.tokenizer
    )
    trainer = make_trainer(folder / "run", devices=2, strategy=S.strategy_for(strategy))
    trainer.fit(module, datamodule=data)
    trainer.validate(module, datamodule=data)
    S.write_json(out / f"sample_apart_rank{S.rank()}.json", responses)


def equality_grpo(out: Path, strategy: str) -> None:
    S.run_equality(out / "equality_grpo", strategy, world_size=2, group=True)


SCENARIOS = {
    "reward_tiny": reward_tiny,
    "dpo_tiny": dpo_tiny,
    "ppo_tiny": ppo_tiny,
    "equality": equality,
    "equality_grpo": equality_grpo,
    "dpo_equality": dpo_equality,
    "resume": resume,
    "sample_apart": sample_apart,
    "sharded_sft": sharded_sft,
    "sharded_dpo": sharded_dpo,
    "sharded_ppo": sharded_ppo,
    "ppo_cli_sharded": ppo_cli_sharded,
    "sft_cli_sharded": sft_cli_sharded,
    "sharded_vllm": sharded_vllm,
}


def main(argv: list[str]) -> None:
    strategy, out, names = argv[0], Path(argv[1]), argv[2:]
    os.chdir(REPO_ROOT)  # configs name their data as ../shared/data/...
    torch.set_num_threads(1)
    for name in names:
        start = time.perf_counter()
        SCENARIOS[name](out, strategy)
        if S.rank() == 0:
            S.write_json(out / f"{name}.time.json", {"seconds": time.perf_counter() - start})


if __name__ == "__main__":
    main(sys.argv[1:])
