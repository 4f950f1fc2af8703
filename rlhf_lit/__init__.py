"""rlhf_lit: the three-stage RLHF recipe (SFT, calibrated reward model, PPO) on PyTorch Lightning."""

__version__ = "0.1.0"
