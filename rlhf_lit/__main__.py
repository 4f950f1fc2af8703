"""``python -m rlhf_lit <fit | validate | test | predict | demo | plan> ...``: the ``rlhf-lit`` command
(:func:`rlhf_lit.cli.main` dispatches the subcommands)."""

import sys

from rlhf_lit.cli import main

if __name__ == "__main__":
    sys.argv[0] = "rlhf-lit"  # usage lines name the command, not __main__.py
    main()
