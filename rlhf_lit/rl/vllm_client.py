"""The trainer's side of the vLLM rollout engine's protocol (``rlhf_lit.vllm_server``), standard library only.

:class:`VLLMClient` sends JSON to the server over HTTP (``urllib``) and turns every failure into one
:class:`~rlhf_lit.errors.SamplerEngineError` line: the server not reachable (not started, or died mid-run), a
refused request, an engine failure, a reply that breaks the protocol. The command prints it and exits 2; a
PPO run stopped that way keeps its last checkpoint (the error comes before the iteration's checkpoint is
written, and checkpoints are written atomically).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from rlhf_lit.errors import SamplerEngineError
from rlhf_lit.vllm_protocol import PROTOCOL

__all__ = ["START_HINT", "LocalVLLMClient", "VLLMClient"]

#: How to start the server the client looks for.
START_HINT = (
    "start it with `rlhf-lit vllm-serve --python <vLLM venv>/bin/python --model <policy model folder> "
    "--port <port>` and set sampling.vllm.url to http://127.0.0.1:<port> (docs/ppo.md: vLLM)"
)


class VLLMClient:
    """Requests to one vLLM server.

    Args:
        url: ``sampling.vllm.url``.
        timeout_s: the longest wait for one reply, seconds.
    """

    def __init__(self, url: str, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.name = f"the server at {self.url}"  # who answers, in error messages

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
                payload = reply.read()
        except urllib.error.HTTPError as err:
            try:
                message = json.loads(err.read()).get("error", "")
            except (ValueError, AttributeError):
                message = ""
            raise SamplerEngineError(
                f"the vLLM server at {self.url} refused {method} {path} (HTTP {err.code}): "
                f"{message or err.reason}"
            ) from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise SamplerEngineError(
                f"the vLLM server at {self.url} (sampling.vllm.url) is not reachable ({reason}) during "
                f"{method} {path}: {START_HINT}"
            ) from None
        try:
            out = json.loads(payload)
        except ValueError:
            out = None
        if not isinstance(out, dict):
            raise SamplerEngineError(f"{self.name} answered {method} {path} with no JSON object")
        return out

    def health(self) -> dict:
        """``GET /health``; checks the protocol version.

        Raises:
            SamplerEngineError: not reachable, or a server of another protocol.
        """
        out = self._call("GET", "/health")
        if out.get("protocol") != PROTOCOL:
            raise SamplerEngineError(
                f"{self.name} speaks protocol {out.get('protocol')!r}, this trainer {PROTOCOL}: "
                "start rlhf_lit.vllm_server from this repository"
            )
        return out

    def generate(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_new_tokens: int,
        min_new_tokens: int,
        stop_token_ids: list[int],
        seed: int,
        lora: bool = False,
    ) -> dict:
        """``POST /generate``: ``{"tokens", "logprobs", "weights"}``, checked: one response per prompt, each
        at most ``max_new_tokens`` tokens with one log-prob per token; ``lora``: drawn with the loaded adapter.

        Raises:
            SamplerEngineError: as :meth:`_call`, or a reply that breaks the protocol.
        """
        out = self._call(
            "POST",
            "/generate",
            {
                "prompts": prompts,
                "temperature": temperature,
                "max_new_tokens": max_new_tokens,
                "min_new_tokens": min_new_tokens,
                "stop_token_ids": stop_token_ids,
                "seed": seed,
                "lora": lora,
            },
        )
        tokens, logprobs = out.get("tokens"), out.get("logprobs")
        ok = (
            isinstance(tokens, list)
            and isinstance(logprobs, list)
            and len(tokens) == len(prompts) == len(logprobs)
            and all(isinstance(t, list) and isinstance(lp, list) and len(t) == len(lp) for t, lp in zip(tokens, logprobs))
            and all(1 <= len(t) <= max_new_tokens for t in tokens)
            and isinstance(out.get("weights"), str)
        )
        if not ok:
            raise SamplerEngineError(
                f"{self.name} answered /generate for {len(prompts)} prompts with no valid "
                f"{{tokens, logprobs, weights}} (one list of 1..{max_new_tokens} tokens and as many log-probs "
                "per prompt)"
            )
        return out

    def load_weights(self, path: str) -> dict:
        """``POST /load_weights``: ``{"weights": digest, "load_s": seconds}``.

        Raises:
            SamplerEngineError: as :meth:`_call`.
        """
        return self._load("/load_weights", path, "weights", "weights digest")

    def load_lora(self, path: str) -> dict:
        """``POST /load_lora``: ``{"lora": digest, "load_s": seconds}``.

        Raises:
            SamplerEngineError: as :meth:`_call`.
        """
        return self._load("/load_lora", path, "lora", "adapter digest")

    def _load(self, endpoint: str, path: str, key: str, what: str) -> dict:
        out = self._call("POST", endpoint, {"path": path})
        if not isinstance(out.get(key), str):
            raise SamplerEngineError(f"{self.name} answered {endpoint} with no {what}")
        return out


class LocalVLLMClient(VLLMClient):
    """The same requests answered in this process (``sampling.vllm.mode: colocated``): the replies of
    ``rlhf_lit.vllm_protocol.EngineService`` on an engine built here, checked as :class:`VLLMClient` checks the
    server's, without HTTP or JSON.

    Args:
        service: the ``EngineService`` of the in-process engine.
    """

    def __init__(self, service) -> None:
        self.service, self.url, self.timeout_s = service, "in-process", None
        self.name = "the in-process vLLM engine (sampling.vllm.mode: colocated)"

    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        status, out = self.service.handle(method, path, body)
        if status != 200:
            raise SamplerEngineError(f"{self.name} refused {method} {path}: {out.get('error', '')}")
        return out
