"""``python -m tests.ppo.vllm_sharded_push <url> <folder>``: push an FSDP2-sharded policy (one gloo process, so
``fully_shard`` applies and every unit is gathered as on several ranks) to the vLLM server at ``<url>`` (serving
``test_vllm_engine.LLAMA``), sample two rows, and print as JSON the files pushed, whether the engine's digest was
the one pushed, and the largest gap between the engine's log-probs and the merged policy's (and the base's).
Run in its own process by ``test_vllm_engine.py`` so its process group touches no other test."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main(url: str, folder: Path) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from rlhf_lit.models.adapters import AdaptedLM
    from rlhf_lit.models.backbone import BackboneConfig, LoraSettings, load_backbone
    from rlhf_lit.models.inference_copy import merged_weights
    from rlhf_lit.models.tokenizer import load_tokenizer
    from rlhf_lit.parallel import shard_lm
    from rlhf_lit.rl.generation import SamplingConfig
    from rlhf_lit.rl.vllm_sampler import VLLMSampler
    from tests.ppo.test_vllm_engine import LLAMA

    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=0, world_size=1)
    backbone = BackboneConfig(tiny=LLAMA, tokenizer="byte")

    def policy_lm() -> AdaptedLM:
        torch.manual_seed(0)
        lora = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
        lm = AdaptedLM(load_backbone(backbone, load_tokenizer("byte")), {"actor": lora})
        with torch.no_grad():
            for name, p in lm.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)  # an actor far from the base
        return lm

    plain, sharded = policy_lm(), policy_lm()
    shard_lm(sharded, init_device_mesh("cpu", (1,)))

    class Policy:
        lm = sharded

        def actor_parameters(self):
            return sharded.adapter_parameters("actor")

    sampling = SamplingConfig(
        max_new_tokens=8, temperature=0.7, backend="vllm", vllm={"url": url, "weights_dir": str(folder / "w")}
    )
    sampler = VLLMSampler(sampling, [], 0)
    ids = torch.tensor([[0, 0, 70, 71, 72, 73], [60, 61, 62, 63, 64, 65]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    torch.manual_seed(0)
    response, _, _ = sampler.sample(Policy(), ids, mask)
    record = sampler.last_record

    def logprobs(weights: dict[str, torch.Tensor]) -> torch.Tensor:
        """The drawn tokens' log-probs at the temperature under a plain model holding ``weights``."""
        model = load_backbone(backbone, load_tokenizer("byte"))
        model.load_state_dict(weights, strict=False)
        rows = []
        for row, row_mask, drawn in zip(ids, mask, response):
            prompt = row[row_mask.bool()]
            with torch.no_grad():
                logits = model(torch.cat([prompt, drawn])[None]).logits[0, len(prompt) - 1 : -1] / 0.7
            rows.append(logits.log_softmax(-1).gather(-1, drawn[:, None])[:, 0])
        return torch.stack(rows)

    return {
        "files": sorted(os.listdir(folder / "w" / "weights-1")),
        "digest_matched": not record.fingerprint.startswith("engine:"),
        "gap": float((record.logprobs - logprobs(merged_weights(plain, "actor"))).abs().max()),
        "base_gap": float((record.logprobs - logprobs(merged_weights(plain, None))).abs().max()),
    }


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
