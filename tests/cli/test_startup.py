"""Lazy start-up (not timed; ``bench/startup.py`` measures): ``import rlhf_lit`` and the light ``--help`` paths
import no data library, Lightning, torch or transformers; Lightning's advert and device lines are dropped unless
``--verbose``."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

from rlhf_lit import quiet
from tests.tiny_runs import REPO_ROOT

HEAVY = ("datasets", "pandas", "pyarrow", "lightning", "torch", "transformers", "peft")


def _imported_after(code: str) -> list[str]:
    """The heavy top-level packages in ``sys.modules`` after running ``code`` in a fresh interpreter."""
    probe = (
        f"import sys\n{code}\n"
        f"import json; print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=300
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_rlhf_lit_imports_no_data_library_or_framework():
    assert _imported_after("import rlhf_lit, rlhf_lit.cli, rlhf_lit.stages, rlhf_lit.errors") == []


@pytest.mark.parametrize(
    "args", [["--help"], ["plan", "--help"], ["demo", "--help"], ["plan", "--config", "nope.yaml"]]
)
def test_light_commands_import_nothing_heavy(args):
    code = (
        "from rlhf_lit.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit as exit:\n"
        "    assert exit.code in (0, 2), exit.code\n"
    )
    assert _imported_after(code) == []


def test_a_refused_config_imports_the_stage_modules_without_peft():
    # a misspelled key is refused once jsonargparse has read the stage module's signature: that needs torch,
    # Lightning and the module, but peft (and transformers' trainer utilities that import it, ~1.5 s on 2
    # cores) only load when a model is wrapped, so a user mistake exits about 1 s after the Lightning import
    code = (
        "from rlhf_lit.cli import main\n"
        "try:\n"
        "    main(['fit', '--config', 'configs/sft/tiny.yaml', '--model.init_args.optimizer.lrr=1e-4'])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 2, exit.code\n"
        "import rlhf_lit.modules.sft, rlhf_lit.modules.reward, rlhf_lit.modules.ppo, rlhf_lit.modules.dpo\n"
    )
    imported = _imported_after(code)
    assert "lightning" in imported and "peft" not in imported, imported


def test_top_level_help_names_every_subcommand(capsys):
    from rlhf_lit.cli import EXTRA_SUBCOMMANDS, SUBCOMMANDS, main

    with pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    for name in (*SUBCOMMANDS, *EXTRA_SUBCOMMANDS, "--verbose", "--debug"):
        assert name in out


def _record(message: str) -> logging.LogRecord:
    return logging.LogRecord(
        "lightning.pytorch.utilities.rank_zero", logging.INFO, __file__, 1, message, (), None
    )


def test_lightning_adverts_and_device_lines_are_dropped_unless_verbose():
    logger = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    try:
        quiet.quiet_third_party(False)
        assert not logger.filter(_record("💡 Tip: For seamless cloud logging, try installing [litlogger]"))
        assert not logger.filter(_record("GPU available: False, used: False"))
        assert logger.filter(_record("`Trainer.fit` stopped: `max_steps=4` reached."))  # a useful line stays
        quiet.quiet_third_party(True)
        assert logger.filter(_record("💡 Tip: For seamless cloud logging, try installing [litlogger]"))
        assert logger.filter(_record("TPU available: False, using: 0 TPU cores"))
    finally:
        quiet.quiet_third_party(False)


def test_verbose_is_read_from_the_flag_or_the_environment(monkeypatch):
    monkeypatch.delenv("RLHF_LIT_VERBOSE", raising=False)
    assert quiet.verbose_requested(["fit", "--verbose"]) and not quiet.verbose_requested(["fit"])
    monkeypatch.setenv("RLHF_LIT_VERBOSE", "1")
    assert quiet.verbose_requested(["fit"])


def test_a_lightning_line_is_printed_once():
    # Lightning's "lightning" logger has its own stream handler; the root handler rlhf_lit installs must not
    # print its records a second time (each "INFO: ..." line came with an "INFO lightning....: ..." twin)
    code = (
        "from rlhf_lit.quiet import quiet_third_party\n"
        "quiet_third_party(False)\n"
        "import logging, lightning.pytorch\n"
        "logging.getLogger('lightning.pytorch.utilities.rank_zero').info('a lightning line')\n"
        "logging.getLogger('rlhf_lit').info('an rlhf_lit line')\n"
    )
    err = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=300
    ).stderr
    assert err.count("a lightning line") == 1, err
    assert err.count("an rlhf_lit line") == 1, err


def test_python_dash_m_usage_names_the_command():
    """``python -m rlhf_lit`` is the ``rlhf-lit`` command: its usage line says so, not ``__main__.py``."""
    out = subprocess.run(
        [sys.executable, "-m", "rlhf_lit", "plan", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    ).stdout
    assert out.startswith("usage: rlhf-lit plan"), out[:200]


def test_rlhf_lit_asks_torch_for_huge_pages_before_torch_is_imported(monkeypatch):
    """``main`` puts ``THP_MEM_ALLOC_ENABLE=1`` in the environment first and keeps a user's own value; torch then
    page-aligns every block of 2 MiB or more (without it: 64 bytes), which it does only for huge pages."""
    from rlhf_lit.cli import THP_ENV, main

    monkeypatch.delenv(THP_ENV, raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ[THP_ENV] == "1"
    monkeypatch.setenv(THP_ENV, "0")
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ[THP_ENV] == "0"

    probe = (
        "import os, sys\n"
        "os.environ.pop('THP_MEM_ALLOC_ENABLE', None)\n"
        "if sys.argv[1] == 'cli':\n"
        "    from rlhf_lit.cli import allocator_defaults; allocator_defaults(os.environ)\n"
        "import torch\n"
        "blocks = [torch.empty(2**19 + 1000 * i) for i in range(8)]  # 2 MiB and more each\n"
        "print(sum(b.data_ptr() % 4096 == 0 for b in blocks))"
    )
    counts = {
        how: subprocess.run(
            [sys.executable, "-c", probe, how], cwd=REPO_ROOT, capture_output=True, text=True, check=True, timeout=300
        ).stdout.split()[-1]
        for how in ("cli", "plain")
    }
    assert counts["cli"] == "8" and int(counts["plain"]) < 8  # plain: 0 on glibc (mmapped blocks sit 64 bytes in)
