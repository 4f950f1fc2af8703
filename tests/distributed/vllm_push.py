"""The vLLM weight-push scenario (``worker.py <fsdp2|ddp> <out> sharded_vllm``): two PPO iterations under FSDP2
(or DDP) with ``sampling.backend: vllm``, the policy built on meta (DDP: loaded whole) from the saved tiny Llama in
``<out>/base``, every rank
sampling through the one server whose address the test wrote to ``<out>/vllm_url`` (a transformers stand-in of
the engine behind the real server code, in the test's process).

Around every ``sync`` each rank records :class:`~tests.distributed.sharded_load.HeldBytes`' peak (the storages the
push created and still alive, plus the gathered parameters registered, its shards not counted) and the digest it
expects the engine to report. After the fit every rank takes part in a merged export of the policy (streamed one
unit at a time) to ``<out>/vllm_policy``, which the test compares with the engine's weights; then one more
``sync`` against an address where no server listens (``failure``: each rank's error message), and a colocated
sampler's ``sync`` (``colocated_refusal``: refused under two processes).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import scenarios as S
from tests.distributed import sharded_load as SL


def measured_sampler(sampling, stop_ids, pad_token_id):
    """A ``VLLMSampler`` recording, per ``sync``, the peak bytes held (``peaks``) and the digest pushed."""
    from rlhf_lit.rl.vllm_sampler import VLLMSampler

    class Measured(VLLMSampler):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            self.peaks: list[int] = []
            self.digests: list[str] = []

        def sync(self, policy) -> None:
            with SL.HeldBytes(policy, ignore=SL.local_tensors(policy)) as held:
                super().sync(policy)
            self.peaks.append(held.peak)
            self.digests.append(self.pushed[0])

    return Measured(sampling, stop_ids, pad_token_id)


def sharded_vllm(out: Path, strategy: str) -> None:
    """Two PPO iterations sampling through the vLLM protocol server, then a merged export (worker scenario)."""
    from rlhf_lit.models import BackboneConfig
    from rlhf_lit.models.export import save_causal_lm
    from rlhf_lit.models.tokenizer import load_tokenizer
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.settings import PPOConfig
    from tests.ppo.helpers import make_data, make_trainer

    url = (out / "vllm_url").read_text()
    sampling = SamplingConfig(
        max_new_tokens=4,
        temperature=1.0,
        strict_sync=True,  # a stale engine stops the fit
        backend="vllm",
        vllm={"url": url, "weights_dir": str(out / "vllm_weights")},
    )
    trainer = make_trainer(out / "vllm_run", devices=2, strategy=S.strategy_for(strategy))
    ppo = PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=2)
    empty_init = strategy == "fsdp2"  # built on meta; under DDP every rank holds the whole policy
    module = SL.ppo_module(out / "base", empty_init, trainer, sampling=sampling, sampler=measured_sampler, ppo=ppo)
    torch.manual_seed(1)
    trainer.fit(module, datamodule=make_data(module, batch_size=2, n=8))
    sampler = module.sampler
    lm = module.policy.lm
    backbone = BackboneConfig(name_or_path=str(out / "base"), tokenizer="byte")
    save_causal_lm(lm, load_tokenizer("byte"), str(out / "vllm_policy"), backbone, "merged", "actor",
                   writer=S.rank() == 0)
    # an engine that cannot be reached: rank 0's push fails, and every rank raises at the same sync
    from rlhf_lit.errors import SamplerEngineError
    from rlhf_lit.rl.vllm_client import VLLMClient

    sampler.client = VLLMClient("http://127.0.0.1:9", timeout_s=5)  # port 9 (discard): nothing listens
    try:
        sampler.sync(module.policy)
        failure = None
    except SamplerEngineError as err:
        failure = str(err)
    # colocated: one engine in one training process, refused on each rank before any engine starts
    from rlhf_lit.errors import ConfigError
    from rlhf_lit.rl.vllm_sampler import VLLMSampler

    colocated = VLLMSampler(SamplingConfig(backend="vllm", vllm={"mode": "colocated"}), [], 0)
    try:
        colocated.sync(module.policy)
        refusal = None
    except ConfigError as err:
        refusal = str(err)
    result = {
        "failure": failure,
        "colocated_refusal": refusal,
        **SL.probe_result(module, trainer),
        "history": module.history,
        "iteration": module.iteration,
        "push_peaks": sampler.peaks,
        "digests": sampler.digests,
        "record_fingerprint": sampler.last_record.fingerprint,
    }
    torch.save(result, out / f"sharded_vllm_rank{S.rank()}.pt")
