"""Experiments run with rlhf_lit: code that produced a report under docs/experiments/, kept out of the
installed package (``pyproject.toml`` packages ``rlhf_lit`` only). Run from the repository root, e.g.
``python -m experiments.heldout_rm`` or ``python experiments/constraint_proof.py``."""
