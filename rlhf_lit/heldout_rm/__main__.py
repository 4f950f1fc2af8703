"""``python -m rlhf_lit.heldout_rm``: the held-out-RM experiment (``rlhf_lit.heldout_rm.experiment.main``)."""

from rlhf_lit.heldout_rm.experiment import main

if __name__ == "__main__":
    main()
