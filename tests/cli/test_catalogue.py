"""The catalogue of outputs and late errors, through the real ``rlhf-lit`` console script (a subprocess each):
two runs on one folder, a reused export folder, a full disk at export and at the first checkpoint, errors
raised while the modules are built, an export of the wrong kind either way, NaN / inf in each data field, YAML
syntax errors in ``fit`` and ``plan``, a hub id offline, and the mistakes a new user found (issue 37): a key in
the wrong section, an export_dir where no folder can be made, ``validate`` without a validation split.

One assertion, :func:`assert_outcome`, judges every case: exit code 2, at most 3 non-empty lines on stderr, the
first ``rlhf-lit: error: ...`` (a case that trains first may print its progress before them), the message
holding the words the case names (file, row, field or config key), no ``Traceback`` in stdout or stderr, and --
for a case with an earlier output -- that output byte for byte as it was, nothing of the refused run beside it.

Rows with a NaN or inf rank, score or margin are skipped and counted (``preference_formats``): a file holding
only such rows is refused (exit 2, the count named), and a file holding some trains on the rest, exit 0, with
the count on stderr (the ``slow`` cases). A non-finite label is refused with file, row and field.

Some behaviours that are not errors run here too, exit 0 and judged by a line on stderr plus their own check
(``Prepared.after``): one validation pair is validated, a prompt template typed with ``\\n`` gives the prompts of
YAML double quotes, an export_dir that is a symbolic link is written through it.

Each case costs ~13 s of CPU for the console script's imports (torch, Lightning, transformers), so the cases run
two at a time as soon as the first of them is reached. Those that train (full disk, two real runs, the counted
skips, the symbolic link) and three that repeat another case's code path are marked ``slow``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.cli.helpers import SFT, console_script, digest, run_cli, sft_args
from tests.tiny_runs import REPO_ROOT, run_tiny

PPO = "configs/ppo/tiny.yaml"
DPO = "configs/dpo/tiny.yaml"
REWARD = "configs/reward/tiny.yaml"
NAN, INF = float("nan"), float("inf")
STARTED = "2026-12-02T00:00:00+00:00"


@dataclass
class Ctx:
    """What a case builds its arguments from: its own empty ``folder``, the shared bad ``files`` and the
    earlier ``export`` (a real tiny SFT export; copy it, never write into it; ``reward_export`` likewise)."""

    folder: Path
    files: dict[str, str]
    export: Path
    reward_export: Path | None = None  # a real tiny reward export, for the cases that ask for one


@dataclass
class Prepared:
    """What a case set up before the run: words the message must also hold (a pid, known only now), folders
    that must come out byte for byte as they were, and a check of what the run left behind (it runs before
    the prepared state is torn down)."""

    expect: list[str] = field(default_factory=list)
    keep: list[Path] = field(default_factory=list)
    after: Callable[[subprocess.CompletedProcess], None] | None = None


@dataclass(frozen=True)
class Case:
    """One mistake or fault: ``args(ctx)`` for ``rlhf-lit``, the words its message must hold, the exit code it
    must give (2, or 0 for a documented skip whose count line must appear), and ``prepare(ctx)``, a context
    manager setting up the earlier output (yields :class:`Prepared`)."""

    id: str
    args: Callable[[Ctx], list[str]]
    expect: tuple[str, ...]
    exit_code: int = 2
    prepare: Callable[[Ctx], object] | None = None
    file_size_limit: Callable[[Ctx], int] | None = None
    trains: bool = False  # it trains before it fails, so its progress lines may come before the message
    slow: bool = False
    reward_export: bool = False  # it needs ctx.reward_export (a tiny reward run, trained once if selected)


def _rows(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))  # json writes NaN / Infinity as JS does
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Every bad input, written once: name -> path."""
    root = tmp_path_factory.mktemp("catalogue_files")
    paths: dict[str, str] = {}

    def export(name: str, kind: str) -> None:  # what check_export_kind reads; no model loads before the check
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        meta = {"format": "rlhf_lit", "version": 1, "weights": "merged", "kind": kind}
        (root / name / "rlhf_lit.json").write_text(json.dumps(meta))
        paths[name] = str(root / name)

    def config(name: str, base: str, edit: Callable[[dict], None]) -> None:
        spec = yaml.safe_load((REPO_ROOT / base).read_text())
        edit(spec["model"]["init_args"])
        (root / name).write_text(yaml.safe_dump(spec))
        paths[name] = str(root / name)

    export("sft_export", "policy")
    export("reward_export", "reward_model")
    config("ppo_rm_is_sft.yaml", PPO, lambda m: m.update(reward_model={"path": paths["sft_export"]}))
    config(
        "ppo_base_is_rm.yaml",
        PPO,
        lambda m: m.update(backbone={"name_or_path": paths["reward_export"], "lora": m["backbone"]["lora"]}),
    )
    config(
        "sft_hub_model.yaml", SFT, lambda m: m.update(backbone={"name_or_path": "no-such-org/no-such-model"})
    )
    (root / "unclosed.yaml").write_text("model:\n  init_args: {optimizer: {lr: 0.001}\n")
    (root / "tabs.yaml").write_text("trainer:\n\tmax_epochs: 1\n")
    paths["unclosed.yaml"], paths["tabs.yaml"] = str(root / "unclosed.yaml"), str(root / "tabs.yaml")

    def pair(i: int, **extra) -> dict:
        return {"prompt": f"Q{i}:", "chosen": f" a{i}", "rejected": f" b{i}", **extra}

    def ranked(i: int, ranks: list, **extra) -> dict:
        return {"prompt": f"Q{i}:", "responses": [f" a{i}", f" b{i}"][: len(ranks)], "ranks": ranks, **extra}

    paths["ranks_all_bad"] = _rows(root / "ranks_all_bad.jsonl", [ranked(0, [1, NAN]), ranked(1, [INF, 2])])
    paths["ranks_some_bad"] = _rows(root / "ranks_some_bad.jsonl", [ranked(0, [1, NAN]), ranked(1, [2, 1])])
    paths["scores_all_bad"] = _rows(
        root / "scores_all_bad.jsonl",
        [ranked(0, [1, 2], scores=[0.5, NAN]), ranked(1, [1, 2], scores=[INF, 1])],
    )
    paths["scores_some_bad"] = _rows(
        root / "scores_some_bad.jsonl",
        [ranked(0, [1, 2], scores=[0.5, NAN]), ranked(1, [1, 2], scores=[3, 1])],
    )
    paths["margins_all_bad"] = _rows(
        root / "margins_all_bad.jsonl", [pair(0, margin=NAN), pair(1, margin=-INF)]
    )
    paths["margins_some_bad"] = _rows(
        root / "margins_some_bad.jsonl", [pair(0, margin=NAN), pair(1, margin=1.5)]
    )
    paths["labels"] = _rows(
        root / "labels.jsonl",
        [
            {"prompt": "Q:", "completion": " a", "label": True},
            {"prompt": "Q:", "completion": " b", "label": NAN},
            {"prompt": "Q:", "completion": " c", "label": False},
        ],
    )
    # -- issue-37 mistakes, part B
    (root / "empty.yaml").write_text("# settings to come\n\n")
    paths["empty.yaml"] = str(root / "empty.yaml")
    paths["pairs"] = _rows(root / "pairs.jsonl", [pair(0), pair(1), pair(2)])
    config(  # a stack ending with both: the tiny config's reward backbone and a path
        "ppo_rm_path_and_backbone.yaml",
        PPO,
        lambda m: m["reward_model"].update(path=paths["reward_export"]),
    )
    return paths


# ---- earlier outputs ----------------------------------------------------------------------------------------


def _live_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def _lock(folder: Path, pid: int) -> Path:
    """The lock file a run holding ``folder`` writes (see ``rlhf_lit.outputs.FolderLock``)."""
    lock = folder.parent / f".{folder.name}.rlhf_lit.lock"
    lock.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": STARTED}))
    return lock


def _hidden(folder: Path) -> list[str]:
    return sorted(e for e in os.listdir(folder) if e.startswith("."))


def _nothing_hidden_but(folder: Path, *names: str) -> Callable[[subprocess.CompletedProcess], None]:
    def check(_result) -> None:
        assert _hidden(folder) == sorted(names)  # no staging folder, no lock of the refused run

    return check


@contextmanager
def earlier_export(ctx: Ctx) -> Iterator[Prepared]:
    """``folder/hf`` holds the earlier run's export."""
    shutil.copytree(ctx.export, ctx.folder / "hf")
    yield Prepared(
        expect=[f"{ctx.folder}/hf"], keep=[ctx.folder / "hf"], after=_nothing_hidden_but(ctx.folder)
    )


def locked_by_a_live_run(target: str, with_export: bool = True):
    """``folder/<target>`` is locked by a live process (the other run); ``folder/hf`` holds its export."""

    @contextmanager
    def prepare(ctx: Ctx) -> Iterator[Prepared]:
        if with_export:
            shutil.copytree(ctx.export, ctx.folder / "hf")
        other = _live_process()
        try:
            lock = _lock(ctx.folder / target, other.pid)
            keep = [ctx.folder / "hf"] if with_export else []
            after = _nothing_hidden_but(ctx.folder, lock.name)
            lock_text = lock.read_text()

            def after_all(result) -> None:
                after(result)
                assert lock.read_text() == lock_text  # the other run's lock, untouched
                if not with_export:
                    assert not (ctx.folder / "hf").exists()  # nothing written by the refused run

            yield Prepared(
                expect=[f"{ctx.folder}/{target}", f"pid {other.pid}", STARTED], keep=keep, after=after_all
            )
        finally:
            other.kill()
            other.wait()

    return prepare


@contextmanager
def a_real_run_holding_the_folders(ctx: Ctx) -> Iterator[Prepared]:
    """Two concurrent runs: the first, a real SFT run, is stopped (SIGSTOP) once it holds its locks, the second
    runs meanwhile, then the first goes on and must finish its export, whole and alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env.pop("RLHF_LIT_DEBUG", None)
    first = subprocess.Popen(
        [console_script(), *sft_args(ctx.folder)],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lock = ctx.folder / ".hf.rlhf_lit.lock"
    try:
        deadline = time.monotonic() + 300
        while (
            not (lock.exists() and lock.read_text()) and first.poll() is None and time.monotonic() < deadline
        ):
            time.sleep(0.05)
        assert first.poll() is None, "the first run ended before it was stopped"
        first.send_signal(signal.SIGSTOP)
        pid = json.loads(lock.read_text())["pid"]
        assert not (ctx.folder / "hf").exists()

        def after(_result) -> None:
            first.send_signal(signal.SIGCONT)
            _, err = first.communicate(timeout=600)
            assert first.returncode == 0, err[-3000:]
            files = set(os.listdir(ctx.folder / "hf"))
            assert "rlhf_lit.json" in files and "model.safetensors" in files  # the first run's export, whole
            assert _hidden(ctx.folder) == []  # its locks released, no staging folder left

        yield Prepared(expect=[f"pid {pid}"], after=after)
    finally:
        if first.poll() is None:
            first.send_signal(signal.SIGCONT)
            first.kill()
            first.wait()


@contextmanager
def no_checkpoint_left(ctx: Ctx) -> Iterator[Prepared]:
    def after(_result) -> None:
        assert not (ctx.folder / "hf").exists()  # the run failed: no export, no staging folder
        assert _hidden(ctx.folder) == []
        leftovers = [f for _, _, names in os.walk(ctx.folder / "run") for f in names if ".tmp-" in f]
        assert leftovers == []  # no half-written checkpoint

    yield Prepared(expect=[f"{ctx.folder}/run"], after=after)


def _half_the_weights(ctx: Ctx) -> int:
    return os.path.getsize(ctx.export / "model.safetensors") // 2


@contextmanager
def _metrics_on_stdout(**values: str) -> Iterator[Prepared]:
    """A case that succeeds: Lightning's table of metrics on stdout has a row for each metric of ``values``
    (``/`` written ``__``) holding its value as printed."""

    def after(result) -> None:
        rows = result.stdout.splitlines()
        for name, value in values.items():
            name = name.replace("__", "/")
            assert any(f" {name} " in row and f" {value} " in row for row in rows), (name, result.stdout[-3000:])

    yield Prepared(after=after)


@contextmanager
def export_dir_a_link_to_an_empty_folder(ctx: Ctx) -> Iterator[Prepared]:
    """``folder/hf`` is a symbolic link to ``folder/disk/exports``, an empty folder (a bigger disk, say): the
    export must land in the target, the link stay, nothing hidden be left on either side."""
    target = ctx.folder / "disk" / "exports"
    target.mkdir(parents=True)
    (ctx.folder / "hf").symlink_to(target)

    def after(_result) -> None:
        assert (ctx.folder / "hf").is_symlink() and os.readlink(ctx.folder / "hf") == str(target)
        assert {"rlhf_lit.json", "model.safetensors"} <= set(os.listdir(target))
        assert _hidden(ctx.folder) == [] and os.listdir(ctx.folder / "disk") == ["exports"]

    yield Prepared(after=after)


SELF_INSTRUCT = [
    "--data.init_args.train_files=[../shared/data/sft/self_instruct_seed_tasks.jsonl]",
    "--data.init_args.format=auto",
    "--data.init_args.response_field=instances.0.output",
    "--data.init_args.val_size=16",
]


@contextmanager
def _same_val_loss_as_yaml_double_quotes(ctx: Ctx) -> Iterator[Prepared]:
    """The template typed on the command line (a backslash and an n, as a shell passes it) validates to the
    val/loss of the same text in YAML double quotes (which YAML reads as newlines): the same prompts."""
    config = ctx.folder / "template.yaml"
    config.write_text('data:\n  init_args:\n    prompt_template: "{instruction}\\n\\n{instances.0.input}"\n')
    assert "\n\n{instances" in yaml.safe_load(config.read_text())["data"]["init_args"]["prompt_template"]

    def val_loss(stdout: str) -> str:
        found = [row.split("│")[2].strip() for row in stdout.splitlines() if " val/loss " in row]
        assert len(found) == 1, stdout[-3000:]
        return found[0]

    def after(result) -> None:
        quoted = run_cli("validate", "--config", SFT, "--config", str(config), *_outputs(ctx), *SELF_INSTRUCT)
        assert quoted.returncode == 0, quoted.stderr[-3000:]
        assert val_loss(result.stdout) == val_loss(quoted.stdout)

    yield Prepared(after=after)


@contextmanager
def a_small_disk(ctx: Ctx) -> Iterator[Prepared]:
    """``folder/small``: a 64 KiB tmpfs (a disk too small for the tiny export's ~584 KiB); skipped where this
    process may not mount one (not root, or a kernel that refuses)."""
    small = ctx.folder / "small"
    small.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")
    try:
        yield Prepared(after=lambda _result: _assert_empty(small))
    finally:
        subprocess.run(["umount", "-l", str(small)], capture_output=True)


def _assert_empty(folder: Path) -> None:
    assert os.listdir(folder) == [], os.listdir(folder)  # no staging folder, no lock left of the refused run


def a_reward_export_with(corrupt: Callable[[Path], None]):
    """``folder/rm``: a copy of the tiny reward export, ``corrupt`` applied to it (it must come out as it was)."""

    @contextmanager
    def prepare(ctx: Ctx) -> Iterator[Prepared]:
        shutil.copytree(ctx.reward_export, ctx.folder / "rm")
        corrupt(ctx.folder / "rm")
        yield Prepared(expect=[f"{ctx.folder}/rm"], keep=[ctx.folder / "rm"])

    return prepare


def a_file_at(name: str) -> Callable[[Ctx], object]:
    """``folder/<name>`` is a file (where a folder is wanted); it must come out as it was, nothing beside it."""

    @contextmanager
    def prepare(ctx: Ctx) -> Iterator[Prepared]:
        (ctx.folder / name).write_text("not a folder\n")

        def after(_result) -> None:
            assert (ctx.folder / name).read_text() == "not a folder\n"
            assert sorted(os.listdir(ctx.folder)) == [name]  # no export, no log folder, no lock, no cache

        yield Prepared(expect=[f"{ctx.folder}/{name}"], after=after)

    return prepare


def _edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    spec = json.loads(path.read_text())
    edit(spec)
    path.write_text(json.dumps(spec))


def _vocab_shifted_by_1000(rm: Path) -> None:
    """Every id of the byte tokenizer's 260 moved up by 1000: ids reach 1259, past the 260 embeddings."""
    def shift(tokenizer: dict) -> None:
        tokenizer["model"]["vocab"] = {token: i + 1000 for token, i in tokenizer["model"]["vocab"].items()}

    _edit_json(rm / "tokenizer.json", shift)


def _no_eos_token(rm: Path) -> None:
    _edit_json(rm / "tokenizer_config.json", lambda t: t.pop("eos_token"))


# ---- the cases ----------------------------------------------------------------------------------------------


def _outputs(ctx: Ctx) -> list[str]:
    return [
        f"--trainer.default_root_dir={ctx.folder}/run",
        f"--trainer.logger.init_args.save_dir={ctx.folder}/run",
        f"--model.init_args.export_dir={ctx.folder}/hf",
    ]


def _fit(config: str, *extra: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: ["fit", "--config", config, *_outputs(ctx), *extra]


def _fit_file(name: str, *extra: str) -> Callable[[Ctx], list[str]]:
    return lambda ctx: ["fit", "--config", ctx.files[name], *_outputs(ctx), *extra]


def _reward_data(name: str, data_format: str, *extra: str) -> Callable[[Ctx], list[str]]:
    """A 1-step tiny reward run on one file of ``files``."""
    return lambda ctx: [
        "fit",
        "--config",
        REWARD,
        *_outputs(ctx),
        f"--data.init_args.train_files=[{ctx.files[name]}]",
        f"--data.init_args.format={data_format}",
        "--data.init_args.val_size=0",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_checkpointing=false",
        *extra,
    ]


CASES = [
    # -- two runs on one folder, a reused folder, a full disk ---------------------------------------------------
    Case(
        "export_dir_locked_by_another_run",
        lambda ctx: sft_args(ctx.folder),
        ("export_dir",),
        prepare=locked_by_a_live_run("hf"),
    ),
    Case(
        "log_folder_locked_by_another_run",
        lambda ctx: sft_args(ctx.folder),
        (),
        prepare=locked_by_a_live_run("run", with_export=False),
        slow=True,  # the same lock as export_dir_locked_by_another_run, on the other folder
    ),
    Case(
        "overwrite_does_not_take_a_live_lock",
        lambda ctx: sft_args(ctx.folder, "--overwrite"),
        (),
        prepare=locked_by_a_live_run("hf"),
    ),
    Case("reused_export_dir", lambda ctx: sft_args(ctx.folder), ("--overwrite",), prepare=earlier_export),
    Case(
        "two_concurrent_runs",
        lambda ctx: sft_args(ctx.folder),
        ("is in use by",),  # the export or the log folder: the first run holds both
        prepare=a_real_run_holding_the_folders,
        slow=True,
    ),
    Case(
        "full_disk_at_export",
        lambda ctx: sft_args(ctx.folder, "--overwrite"),
        ("cannot write the export", "bytes"),
        prepare=earlier_export,
        file_size_limit=_half_the_weights,  # every file may grow to half the weights file
        trains=True,
        slow=True,
    ),
    Case(
        "full_disk_at_the_first_checkpoint",
        lambda ctx: [a for a in sft_args(ctx.folder) if a != "--trainer.enable_checkpointing=false"],
        ("cannot write the checkpoint", "bytes"),
        prepare=no_checkpoint_left,
        file_size_limit=_half_the_weights,  # the checkpoint (weights + optimizer state) cannot fit
        trains=True,
        slow=True,
    ),
    # -- errors raised while the modules are built; exports of the wrong kind ---------------------------------
    Case(
        "ppo_sampling_top_k",
        _fit(PPO, "--model.init_args.sampling.top_k=5"),
        ("PPO refuses sampling.top_k=5",),
    ),
    Case(
        "ppo_reward_model_is_an_sft_export",
        _fit_file("ppo_rm_is_sft.yaml"),
        ("model.init_args.reward_model.path:", "sft_export holds a 'policy' export", "not a 'reward_model'"),
    ),
    Case(
        "ppo_policy_base_is_a_reward_export",
        _fit_file("ppo_base_is_rm.yaml"),
        ("model.init_args.backbone.name_or_path:", "reward_export holds a 'reward_model' export", "'policy'"),
    ),
    Case(
        "hub_model_offline",
        _fit_file("sft_hub_model.yaml"),
        (
            "model.init_args.backbone.name_or_path: no-such-org/no-such-model is not a local folder",
            "HF_HUB_OFFLINE",
        ),
    ),
    # -- NaN / inf in each data field ---------------------------------------------------------------------------
    Case(
        "non_finite_ranks_only",
        _reward_data("ranks_all_bad", "ranked"),
        ("no training examples left", "ranks_all_bad.jsonl", "non_finite_rank=2"),
    ),
    Case(
        "non_finite_scores_only",
        _reward_data("scores_all_bad", "ranked", "--data.init_args.margin_field=scores"),
        ("no training examples left", "scores_all_bad.jsonl", "non_finite_margin=2"),
        slow=True,  # scores and margins share one check; a_non_finite_score_is_skipped_and_counted
    ),
    Case(
        "non_finite_margins_only",
        _reward_data("margins_all_bad", "explicit", "--data.init_args.margin_field=margin"),
        ("no training examples left", "margins_all_bad.jsonl", "non_finite_margin=2"),
    ),
    Case(
        "non_finite_label",
        _reward_data("labels", "unpaired", "--data.init_args.pair_unpaired=true"),
        ("labels.jsonl: line 2: field 'label'",),
    ),
    Case(
        "a_non_finite_rank_is_skipped_and_counted",
        _reward_data("ranks_some_bad", "ranked"),
        ("train: kept 1 of 2 rows from ranks_some_bad.jsonl; skipped 1: non_finite_rank=1",),
        exit_code=0,
        slow=True,
    ),
    Case(
        "a_non_finite_score_is_skipped_and_counted",
        _reward_data("scores_some_bad", "ranked", "--data.init_args.margin_field=scores"),
        ("train: kept 1 of 2 rows from scores_some_bad.jsonl; skipped 1: non_finite_margin=1",),
        exit_code=0,
        slow=True,
    ),
    Case(
        "a_non_finite_margin_is_skipped_and_counted",
        _reward_data("margins_some_bad", "explicit", "--data.init_args.margin_field=margin"),
        ("train: kept 1 of 2 rows from margins_some_bad.jsonl; skipped 1: non_finite_margin=1",),
        exit_code=0,
        slow=True,
    ),
    # -- YAML syntax, in fit and in plan ------------------------------------------------------------------------
    Case(
        "fit_yaml_unclosed_brace",
        lambda ctx: ["fit", "--config", SFT, "--config", ctx.files["unclosed.yaml"], *_outputs(ctx)],
        ("unclosed.yaml: line 3, column 1: invalid YAML: while parsing a flow mapping",),
    ),
    Case(
        "fit_yaml_tab_indentation",
        lambda ctx: ["fit", "--config", ctx.files["tabs.yaml"], *_outputs(ctx)],
        ("tabs.yaml: line 2, column 1: invalid YAML", "'\\t'"),
    ),
    Case(
        "plan_yaml_unclosed_brace",
        lambda ctx: ["plan", "--config", SFT, "--config", ctx.files["unclosed.yaml"]],
        ("unclosed.yaml: line 3, column 1: invalid YAML: while parsing a flow mapping",),
    ),
    Case(
        "plan_yaml_tab_indentation",
        lambda ctx: ["plan", "--config", ctx.files["tabs.yaml"]],
        ("tabs.yaml: line 2, column 1: invalid YAML", "'\\t'"),
        slow=True,  # plan reads YAML as fit does (plan_yaml_unclosed_brace, fit_yaml_tab_indentation)
    ),
    # -- keys in the wrong section, folders, one validation pair, validate, templates, links ------------------
    Case(
        "key_in_the_wrong_section",  # kl_coef lives in kl, not ppo (whose own closest name is vf_coef)
        _fit(PPO, "--model.init_args.ppo.kl_coeff=0.1"),
        ("unknown key model.init_args.ppo.kl_coeff (did you mean 'model.init_args.kl.kl_coef'?)",),
    ),
    Case(
        "export_dir_where_no_folder_can_be_made",  # /proc takes no new folder even from root
        _fit(SFT, "--model.init_args.export_dir=/proc/no_such_folder/hf"),
        ("model.init_args.export_dir: cannot write to /proc/no_such_folder/hf: /proc refuses new folders",),
    ),
    Case(
        "one_validation_pair",  # not a mistake: validated, the spreads that need two pairs NaN (docs/errors.md)
        lambda ctx: [
            "validate",
            "--config",
            REWARD,
            *_outputs(ctx),
            "--data.init_args.train_files=[../shared/data/preference/hh-rlhf_harmless-base_test.jsonl.gz]",
            "--data.init_args.max_train_samples_per_file=16",
            "--data.init_args.val_size=1",
        ],
        ("val: kept 1 of 1 rows from hh-rlhf_harmless-base_test.jsonl.gz",),
        exit_code=0,
        prepare=lambda ctx: _metrics_on_stdout(reward__accuracy_vs_length_rule_se="nan"),  # an SE of 1 pair
    ),
    Case(
        "validate_without_a_validation_split",  # PPO's prompts hold none by default: once, it exited 0 silently
        lambda ctx: ["validate", "--config", PPO, *_outputs(ctx)],
        ("validate: nothing to validate", "data.init_args.val_size is 0", "data.init_args.val_files"),
    ),
    Case(
        "prompt_template_typed_with_backslash_n",  # read as YAML double quotes read it (docs/data.md)
        lambda ctx: [
            "validate",
            "--config",
            SFT,
            *_outputs(ctx),
            *SELF_INSTRUCT,
            "--data.init_args.prompt_template={instruction}\\n\\n{instances.0.input}",
        ],
        ("val: kept 16 of 16 rows from self_instruct_seed_tasks.jsonl",),
        exit_code=0,
        prepare=_same_val_loss_as_yaml_double_quotes,
    ),
    Case(
        "export_dir_a_symbolic_link",  # written through the link (docs/errors.md, docs/resume.md)
        lambda ctx: sft_args(ctx.folder),
        ("train: kept 16 of", "gsm8k_train.jsonl"),
        exit_code=0,
        prepare=export_dir_a_link_to_an_empty_folder,
        slow=True,  # the export is written after training
    ),
    # -- a hub dataset id offline -------------------------------------------------------------------------------
    Case(
        "hub_dataset_offline",
        _fit(SFT, "--data.init_args.train_files=[no-such-org/no-such-dataset]"),
        # named by the checks before loading (with the key), not by datasets after its attempts
        (
            "data.init_args.train_files[0]: 'no-such-org/no-such-dataset' is not a local file and not in the "
            "Hugging Face cache, and HF_HUB_OFFLINE / HF_DATASETS_OFFLINE is set (offline)",
        ),
    ),
    # -- plan ranges and shapes, caches, evaluate, empty configs, resume ----------------------------------
    Case(
        "fit_empty_config",
        lambda ctx: ["fit", "--config", ctx.files["empty.yaml"], *_outputs(ctx)],
        ("empty.yaml: the config file is empty",),
    ),
    Case(
        "plan_empty_config",
        lambda ctx: ["plan", "--config", SFT, "--config", ctx.files["empty.yaml"]],
        ("empty.yaml: the config file is empty",),
    ),
    Case(
        "plan_negative_device_memory",
        lambda ctx: ["plan", "--config", SFT, "--device-memory-gb", "-5"],
        ("plan --device-memory-gb must be a number > 0, got -5.0",),
    ),
    Case(
        "plan_max_length_past_the_positions",
        lambda ctx: ["plan", "--config", SFT, "--data.init_args.max_length=100000000"],
        ("data.init_args.max_length (100000000) exceeds the model's 512 positions",),
    ),
    Case(
        "plan_reward_model_path_and_backbone",
        lambda ctx: ["plan", "--config", ctx.files["ppo_rm_path_and_backbone.yaml"]],
        ("model.init_args.reward_model: give exactly one of 'path'", "'backbone'"),
    ),
    Case(
        "evaluate_tokenizer_past_the_embeddings",
        lambda ctx: ["evaluate", "--model", f"{ctx.folder}/rm", "--data", ctx.files["pairs"]],
        ("its tokenizer does not match its model: token ids reach 1259, past the model's 260 embeddings",),
        prepare=a_reward_export_with(_vocab_shifted_by_1000),
        reward_export=True,
    ),
    Case(
        "evaluate_tokenizer_without_eos",
        lambda ctx: ["evaluate", "--model", f"{ctx.folder}/rm", "--data", ctx.files["pairs"]],
        ("its tokenizer has no EOS token", "append_eos"),
        prepare=a_reward_export_with(_no_eos_token),
        reward_export=True,
    ),
    Case(  # the config alone rules every stop token out: refused by the checks, before the tokenizer loads
        "mask_truncated_completions_without_a_stop_token",
        _fit(
            "configs/ppo/tiny_grpo.yaml",
            "--model.init_args.ppo.mask_truncated_completions=true",
            "--model.init_args.sampling.stop_at_eos=false",
        ),
        (
            "model.init_args.ppo.mask_truncated_completions needs a stop token",
            "model.init_args.sampling.stop_at_eos",
        ),
    ),
    Case(  # without a buffer the penalty would do nothing: refused before any model loads
        "overlong_penalty_without_a_buffer",
        _fit("configs/ppo/tiny_grpo.yaml", "--model.init_args.reward.overlong_penalty=0.5"),
        ("model.init_args.reward.overlong_penalty=0.5", "model.init_args.reward.overlong_buffer is not"),
    ),
    Case(  # plan reads no model either: the same check, the same line
        "plan_missing_eos_penalty_without_a_stop_token",
        lambda ctx: [
            "plan",
            "--config",
            "configs/ppo/tiny_grpo.yaml",
            "--model.init_args.reward.missing_eos_penalty=1.0",
            "--model.init_args.sampling.stop_at_eos=false",
        ],
        ("model.init_args.reward.missing_eos_penalty=1.0 needs a stop token", "sampling.stop_at_eos"),
    ),
    Case(
        "export_dir_on_a_disk_too_small",
        lambda ctx: [
            *_fit(SFT)(ctx),
            f"--model.init_args.export_dir={ctx.folder}/small/hf",
        ],
        ("small/hf: not enough free space for the export", "plus a 10% safety margin", "free"),
        prepare=a_small_disk,
    ),
    Case(
        "dpo_reference_cache_is_a_file",
        lambda ctx: [*_fit(DPO)(ctx), f"--model.init_args.reference_cache={ctx.folder}/cache"],
        ("model.init_args.reference_cache: cannot write to", "/cache: it is a file, not a folder"),
        prepare=a_file_at("cache"),
    ),
    Case(
        "dpo_reference_cache_under_a_file",
        lambda ctx: [*_fit(DPO)(ctx), f"--model.init_args.reference_cache={ctx.folder}/cache/dpo"],
        ("model.init_args.reference_cache: cannot write to", "/cache is a file, not a folder"),
        prepare=a_file_at("cache"),
        slow=True,  # the same check as dpo_reference_cache_is_a_file, one folder up
    ),
]


def assert_outcome(case: Case, result: subprocess.CompletedProcess, prepared: Prepared, before: dict) -> None:
    """The one judgement of every case (see the module docstring); ``prepared.after``, the case's own check of
    what the run left behind, ran in :func:`_run` while the prepared state still existed."""
    everything = result.stdout + result.stderr
    assert "Traceback" not in everything, result.stderr[-3000:]
    expected = [*case.expect, *prepared.expect]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == case.exit_code, result.stderr[-3000:]
    if case.exit_code == 0:  # a documented skip: the run goes on, and says what it skipped
        assert any(all(word in line for word in expected) for line in lines), (expected, lines)
    else:
        starts = [i for i, line in enumerate(lines) if line.startswith("rlhf-lit: error: ")]
        assert starts, lines
        message = lines[starts[0] :] if case.trains else lines  # else: no warning before it either
        assert 1 <= len(message) <= 3 and message[0].startswith("rlhf-lit: error: "), message
        for word in expected:
            assert word in "\n".join(message), (word, message)
    for folder, files in before.items():
        assert digest(folder) == files, folder  # the earlier output, byte for byte, and nothing added


# ---- running the cases: two at a time, each in its own folder -------------------------------------------------


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    prepared: Prepared
    before: dict[Path, dict[str, str]]
    after_error: AssertionError | None = None


def _run(case: Case, ctx: Ctx) -> Outcome:
    ctx.folder.mkdir(parents=True)
    with (case.prepare or _nothing)(ctx) as prepared:
        before = {folder: digest(folder) for folder in prepared.keep}
        for folder, files in before.items():
            assert "rlhf_lit.json" in files, folder  # an earlier export, whole
        limit = case.file_size_limit(ctx) if case.file_size_limit else None
        result = run_cli(*case.args(ctx), timeout=900, file_size_limit=limit)
        outcome = Outcome(result, prepared, before)
        if prepared.after is not None:  # while what was prepared (a stopped run, a live lock) still exists
            try:
                prepared.after(result)
            except AssertionError as err:
                outcome.after_error = err
    return outcome


@contextmanager
def _nothing(_ctx: Ctx) -> Iterator[Prepared]:
    yield Prepared()


@pytest.fixture(scope="module")
def outcomes(request, files, tmp_path_factory) -> Iterator[dict[str, Future]]:
    """Every selected case without a file-size limit, started two at a time when the first is reached
    (``preexec_fn``, which applies a limit, is not safe beside threads starting processes: those run alone, in
    their tests, once the others are done)."""
    export = run_tiny(SFT, tmp_path_factory).export_dir
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec") and "case" in item.callspec.params
    ]
    reward = run_tiny(REWARD, tmp_path_factory).export_dir if any(c.reward_export for c in selected) else None
    root = tmp_path_factory.mktemp("catalogue")
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {}
    for case in selected:
        ctx = Ctx(root / case.id, files, export, reward)
        if case.file_size_limit is None:
            futures[case.id] = pool.submit(_run, case, ctx)
        else:
            futures[case.id] = ctx
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize(
    "case", [pytest.param(c, id=c.id, marks=[pytest.mark.slow] if c.slow else []) for c in CASES]
)
def test_catalogue(case: Case, outcomes):
    pending = outcomes[case.id]
    if isinstance(pending, Future):
        outcome = pending.result()
    else:  # a file-size limit: once no other case is running (their results wait for their tests)
        wait([f for f in outcomes.values() if isinstance(f, Future)])
        outcome = _run(case, pending)
    assert_outcome(case, outcome.result, outcome.prepared, outcome.before)
    if outcome.after_error is not None:  # the case's own check of what the run left behind
        raise outcome.after_error
