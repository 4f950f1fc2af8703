"""Building tiny PPO runs for the PPO tests (tiny GPT-2 policy, tiny random reward model, demo prompts)."""

from __future__ import annotations

import copy

import lightning as L

from rlhf_lit.data import PromptDataModule
from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig
from rlhf_lit.modules import PPOModule
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import CriticConfig, KLConfig, PPOConfig, RewardShapingConfig
from tests.conftest import TINY_GPT2

LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])


def make_module(tokenizer: str = "byte", **overrides) -> PPOModule:
    """A tiny PPO module; ``overrides`` replace whole constructor arguments."""
    kwargs = dict(
        backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer=tokenizer, lora=copy.deepcopy(LORA)),
        reward_model=RewardModelConfig(backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer=tokenizer, seed=1)),
        sampling=SamplingConfig(max_new_tokens=8, temperature=0.7),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1),
        kl=KLConfig(kl_coef=0.05),
        reward=RewardShapingConfig(),
        critic=CriticConfig(lora=copy.deepcopy(LORA)),
        log_samples_every=0,
    )
    kwargs.update(overrides)
    return PPOModule(**kwargs)


def make_data(module: PPOModule, batch_size: int = 4, n: int = 32) -> PromptDataModule:
    return PromptDataModule(
        train_files=[f"demo:prompts?n={n}&seed=0&split=train"],
        val_size=0,
        batch_size=batch_size,
        tokenizer=module.tokenizer,
    )


def make_trainer(tmp_path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)


class RecordingUpdater:
    """Stands in for ``module.updater``: records every ``UpdateBatch`` it is given (``calls``), then delegates
    to the real updater. Install with ``module.updater = RecordingUpdater(module.updater)``."""

    _OWN = ("inner", "calls", "on_update")

    def __init__(self, updater, on_update=None) -> None:
        self.inner, self.calls, self.on_update = updater, [], on_update

    def __setattr__(self, name, value):  # what a test sets on the updater (its ptx_stream, ...) reaches it
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def update(self, batch, iteration: int = 0):
        self.calls.append(batch)
        if self.on_update is not None:
            self.on_update(batch)
        return self.inner.update(batch, iteration)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def update_fields(batch) -> list:
    """The fields of an ``UpdateBatch`` as the update receives them, tensors cloned, in its field order
    (input_ids, attention_mask, prompt_len, mask, old_logprobs, old_values, advantages, returns, [ref_logprobs,
    kl_coef] when the KL is in the loss)."""
    fields = [
        batch.input_ids,
        batch.attention_mask,
        batch.prompt_len,
        batch.mask,
        batch.old_logprobs,
        batch.old_values,
        batch.advantages,
        batch.returns,
    ]
    if batch.ref_logprobs is not None:
        fields += [batch.ref_logprobs, batch.kl_coef]
    return [a.clone() if hasattr(a, "clone") else a for a in fields]


class RecordingReward:
    """Stands in for the collector's reward function: ``score`` returns ``replace(scores)`` (default: the real
    scores) and keeps each result in ``calls``. Install with ``module.collector.reward_fn =
    RecordingReward(module.collector.reward_fn)``."""

    def __init__(self, inner, replace=None) -> None:
        self.inner, self.replace, self.calls = inner, replace, []

    def score(self, *args, **kwargs):
        scores = self.inner.score(*args, **kwargs)
        if self.replace is not None:
            scores = self.replace(scores)
        self.calls.append(scores.clone())
        return scores

    def __getattr__(self, name):
        return getattr(self.inner, name)


def uneven_sampler(record: dict | None = None, rows=((1, 2), (2, 4))):
    """A sampler factory for ``PPOModule(sampler=...)``: ``HFSampler`` whose responses ``row`` end with the
    stop token at position ``stop_at`` (uneven lengths whatever was sampled); ``record["sample"]`` keeps the
    last ``(prompt_ids, prompt_mask, response_ids, response_mask)``."""
    from rlhf_lit.rl.sampler import HFSampler

    class Uneven(HFSampler):
        def sample(self, policy, prompt_ids, prompt_mask, **kwargs):
            ids, mask, stop = (t.clone() for t in super().sample(policy, prompt_ids, prompt_mask, **kwargs))
            for row, stop_at in rows:
                if mask[row].sum() > stop_at + 1:
                    ids[row, stop_at] = self.stop_ids[0]
                    ids[row, stop_at + 1 :] = self.pad_token_id
                    mask[row, stop_at + 1 :] = False
                    stop[row] = True
            if record is not None:
                record["sample"] = [t.clone() for t in (prompt_ids, prompt_mask, ids, mask)]
            return ids, mask, stop

    return Uneven
