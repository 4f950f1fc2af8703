"""PPO with SmolLM2-135M-Instruct against RM-A, judged before and after on held-out prompts by RM-B.

    python scripts/heldout_rm_ppo.py --rm-a checkpoints/reward/minilm_hh_a/hf \
        --rm-b checkpoints/reward/minilm_hh_b/hf [--out checkpoints/heldout_rm] [-- rlhf-lit fit overrides]

A thin launcher of ``rlhf_lit.heldout_rm.main`` (see that module for what is run and reported); the same as
``python -m rlhf_lit.heldout_rm``. Run from the repository root.
"""

from rlhf_lit.heldout_rm import main

if __name__ == "__main__":
    main()
