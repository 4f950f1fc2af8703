"""``python -m experiments.heldout_rm``: the held-out-RM experiment (``experiments.heldout_rm.experiment.main``)."""

from experiments.heldout_rm.experiment import main

if __name__ == "__main__":
    main()
