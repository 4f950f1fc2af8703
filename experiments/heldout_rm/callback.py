"""``HeldOutRewardCallback``: RM-B's view of a PPO run, before, during and after (package docstring)."""

from __future__ import annotations

import logging
import os
import time

import lightning as L
import torch

from experiments.heldout_rm.report import FIELDS, record_batch, summarize, write_report
from rlhf_lit import metrics as M
from rlhf_lit.functional.sequence import trim_left_padding
from rlhf_lit.functional.summary import mean_se
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.rl.generation import sample_responses

log = logging.getLogger("rlhf_lit")


NUM_SAMPLES = 6  # prompts whose responses (before and after) the report shows


class HeldOutRewardCallback(L.Callback):
    """Scores a PPO run with a held-out reward model (module docstring).

    Args:
        reward_model: RM-B's export folder (any reward model ``RewardSource`` can load).
        eval_prompts: a prompt file (any ``PromptDataModule`` format) of held-out prompts; read with the
            training data module's settings (format, chat template, prompt length).
        num_eval_prompts: how many of them to evaluate (the first ones; rounded down to whole batches).
        eval_batch_size: prompts per sampling batch.
        report_dir: where the report goes (default: the trainer's ``default_root_dir``).
        seed: sampling seed of the evaluation batches (the same before and after).
    """

    def __init__(
        self,
        reward_model: str,
        eval_prompts: str,
        num_eval_prompts: int = 96,
        eval_batch_size: int = 16,
        report_dir: str | None = None,
        seed: int = 1234,
    ) -> None:
        if num_eval_prompts < eval_batch_size:
            raise ValueError(
                f"num_eval_prompts ({num_eval_prompts}) must be >= eval_batch_size ({eval_batch_size})"
            )
        self.reward_model = reward_model
        self.eval_prompts = eval_prompts
        self.num_eval_prompts = num_eval_prompts
        self.eval_batch_size = eval_batch_size
        self.report_dir = report_dir
        self.seed = seed
        self.source: RewardSource | None = None
        self.evaluations: dict[str, dict[str, list[float]]] = {}
        self.timings: dict[str, float] = {}
        self._rollout_scores: torch.Tensor | None = None
        self._observed = None

    # ------------------------------------------------------------------ set-up
    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.source is None:
            self.source = RewardSource(RewardModelConfig(path=self.reward_model), pl_module.tokenizer)
        self.source.to(pl_module.device)
        rm_a = pl_module.reward_source
        if self._observed is None:
            original = rm_a.score

            def score_and_observe(*args, **kwargs):
                scores = original(*args, **kwargs)
                self._rollout_scores = self.source.score(*args, **kwargs)
                return scores

            self._observed = original
            rm_a.score = score_and_observe  # an instance attribute: the PPO module calls this one

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self._observed is not None:
            del pl_module.reward_source.score  # back to the class's method
            self._observed = None

    def _eval_loader(self, trainer, pl_module):
        from rlhf_lit.data import PromptDataModule

        dm = trainer.datamodule
        data = PromptDataModule(
            train_files=self.eval_prompts,
            format=getattr(dm, "format", "auto"),
            hh_first_turn_only=getattr(dm, "hh_first_turn_only", False),
            chat_template=getattr(dm, "chat_template", False),
            max_prompt_length=getattr(dm, "max_prompt_length", None),
            val_size=0,
            batch_size=self.eval_batch_size,
            shuffle=False,
            tokenizer=pl_module.tokenizer,
        )
        data.setup("fit")
        return data.train_dataloader()

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self, trainer, pl_module) -> dict[str, list[float]]:
        """One response per evaluation prompt from the current actor, and what is recorded about it."""
        out = {k: [] for k in FIELDS}
        out["prompt"], out["response"] = [], []
        batches = self.num_eval_prompts // self.eval_batch_size
        policy, T = pl_module.policy, pl_module.sampling.temperature
        for index, batch in enumerate(self._eval_loader(trainer, pl_module)):
            if index >= batches:
                break
            batch = {k: v.to(pl_module.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            ids, mask, _ = trim_left_padding(
                batch["input_ids"], batch["attention_mask"], batch["input_ids"].shape[1]
            )
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed + index)
                with policy.lm.adapter("actor"):
                    response_ids, response_mask, has_stop = sample_responses(
                        policy.lm,
                        ids,
                        mask,
                        pl_module.sampling,
                        pl_module.stop_ids,
                        pl_module.tokenizer.pad_token_id,
                    )
            full = torch.cat([ids, response_ids], 1)
            full_mask = torch.cat([mask.long(), response_mask.long()], 1)
            P = ids.shape[1]
            logprobs = policy(full, full_mask, P, T, want_values=False).logprobs
            ref = policy.reference_logprobs(full, full_mask, P, T)
            args = (ids, mask, response_ids, response_mask, has_stop, batch.get("prompt"))
            rm_a = self._observed if self._observed is not None else pl_module.reward_source.score
            scores = {"rm_a": rm_a(*args), "rm_b": self.source.score(*args)}
            sample = (ids, response_ids, response_mask, has_stop)
            record_batch(out, scores, logprobs, ref, batch, sample, pl_module.tokenizer)
        return out

    def on_train_start(self, trainer, pl_module) -> None:
        if "before" not in self.evaluations:
            t0 = time.perf_counter()
            self.evaluations["before"] = self.evaluate(trainer, pl_module)
            self.timings["eval_before_s"] = time.perf_counter() - t0
            self._log_summary("before")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        history = getattr(pl_module, "history", None)
        if self._rollout_scores is None or not history:
            return
        value = float(self._rollout_scores.float().mean())
        self._rollout_scores = None
        history[-1][M.HELDOUT_RM_SCORE] = value
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics({M.HELDOUT_RM_SCORE: value}, step=pl_module.iteration)

    def on_train_end(self, trainer, pl_module) -> None:
        t0 = time.perf_counter()
        self.evaluations["after"] = self.evaluate(trainer, pl_module)
        self.timings["eval_after_s"] = time.perf_counter() - t0
        self._log_summary("after")
        if trainer.is_global_zero:
            report = self.report(pl_module)
            folder = self.report_dir or trainer.default_root_dir
            write_report(report, folder)
            log.info("held-out RM: %s (report in %s)", report["verdict"], os.path.abspath(folder))

    def _log_summary(self, when: str) -> None:
        ev = self.evaluations[when]
        log.info(
            "held-out RM, %s PPO: %d prompts, RM-A %.3f, RM-B %.3f, KL(k3) %.3f nats, length %.1f tokens",
            when,
            len(ev["rm_b"]),
            *(mean_se(torch.tensor(ev[k]))[0] for k in ("rm_a", "rm_b", "kl_k3", "length")),
        )

    # ------------------------------------------------------------------ report
    def report(self, pl_module) -> dict:
        """The numbers of the report (see ``summarize``), with the run's history and settings."""
        before, after = self.evaluations["before"], self.evaluations["after"]
        report = summarize(before, after)
        report["samples"] = [
            {
                "prompt": before["prompt"][i][-300:],
                "before": {
                    "response": before["response"][i],
                    "rm_a": before["rm_a"][i],
                    "rm_b": before["rm_b"][i],
                },
                "after": {
                    "response": after["response"][i],
                    "rm_a": after["rm_a"][i],
                    "rm_b": after["rm_b"][i],
                },
            }
            for i in range(min(NUM_SAMPLES, report["prompts"]))
        ]
        history = getattr(pl_module, "history", [])
        report["iterations"] = len(history)
        report["history"] = [
            {
                "iteration": int(h.get(M.PPO_ITERATION, i + 1)),
                "rm_a": h.get(M.ROLLOUT_SCORE_MEAN),
                "rm_b": h.get(M.HELDOUT_RM_SCORE),
                "kl": h.get(M.ROLLOUT_KL_REF),
                "response_len": h.get(M.ROLLOUT_RESPONSE_LEN),
                "overoptimization": bool(h.get(M.MONITOR_OVEROPTIMIZATION)),
            }
            for i, h in enumerate(history)
        ]
        report["monitor_flagged_iterations"] = sum(r["overoptimization"] for r in report["history"])
        report["reward_models"] = {"rm_a": _rm_path(pl_module), "rm_b": os.path.abspath(self.reward_model)}
        report["timings"] = dict(self.timings)
        return report


def _rm_path(pl_module) -> str | None:
    path = getattr(pl_module.reward_model_cfg, "path", None)
    return os.path.abspath(path) if path else None
