"""``python -m rlhf_lit <fit | validate | test | predict | demo | plan> ...``: the ``rlhf-lit`` command
(:func:`rlhf_lit.cli.main` dispatches the subcommands)."""

from rlhf_lit.cli import main

if __name__ == "__main__":
    main()
