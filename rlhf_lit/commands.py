"""The ``rlhf-lit`` command's subcommands and description, read by :mod:`rlhf_lit.cli` (which dispatches them) and
:mod:`rlhf_lit.lightning_cli` (LightningCLI's help text). Imports nothing."""

from __future__ import annotations

__all__ = ["DESCRIPTION", "EXTRA_SUBCOMMANDS", "SUBCOMMANDS"]

SUBCOMMANDS = ("fit", "validate", "test", "predict")  # LightningCLI's
#: Subcommands that ``main`` runs itself: name -> ``"module:function"``; the function takes the arguments after
#: the subcommand's name. Add an entry to add a subcommand.
EXTRA_SUBCOMMANDS: dict[str, str] = {
    "demo": "rlhf_lit.demo:main",
    "plan": "rlhf_lit.planner.report:main",
    "evaluate": "rlhf_lit.evaluation:main",
    "vllm-serve": "rlhf_lit.vllm_server:serve_command",
}
DESCRIPTION = (
    "RLHF (SFT -> calibrated reward model -> PPO) on PyTorch Lightning. Subcommands: fit, validate, test, "
    "predict (LightningCLI: rlhf-lit fit --config configs/<stage>/<name>.yaml); demo (the whole pipeline on "
    "the offline demo task: rlhf-lit demo [--fast]; rlhf-lit demo --help); plan (peak-memory estimate of a "
    "config, loads no weights: rlhf-lit plan --config <file>; rlhf-lit plan --help); evaluate (score a reward-model export on preference files: rlhf-lit evaluate --model <export> --data <file>; rlhf-lit evaluate --help); vllm-serve (the vLLM rollout engine's server for sampling.backend: vllm, run with the vLLM environment's python: rlhf-lit vllm-serve --python <venv>/bin/python --model <folder>). Add --debug (or set "
    "RLHF_LIT_DEBUG=1) to see the traceback of an error, --verbose (or RLHF_LIT_VERBOSE=1) to see Lightning's "
    "and the libraries' informational lines."
)
