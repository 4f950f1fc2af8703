"""The catalogue of user mistakes: each prints ``rlhf-lit: error: ...`` (at most 3 stderr lines, naming the
file / row / field or config key), exits with status 2, and shows no traceback unless ``--debug`` or
``RLHF_LIT_DEBUG=1`` asks for it. Internal errors keep their traceback.

Every case runs through ``rlhf_lit.cli.main`` in-process (the console script's entry point; milliseconds to
seconds each); a representative set also runs through the real ``rlhf-lit`` console script in subprocesses,
where all of stderr is counted.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import lightning.pytorch  # noqa: F401 - Lightning gives its loggers a handler on the stderr of the moment it is
import pytest  # imported: import it here, not inside a test whose captured stderr is closed afterwards

from rlhf_lit.cli import main
from tests.cli.helpers import run_cli, stderr_lines
from tests.tiny_runs import REPO_ROOT, in_repo_root, one_thread

SFT = "configs/sft/tiny.yaml"
PPO = "configs/ppo/tiny.yaml"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Bad data files, written once: name -> path."""
    root = tmp_path_factory.mktemp("bad_data")
    paths = {}

    def write(name, text):
        (root / name).write_text(text)
        paths[name] = str(root / name)

    write(
        "bad_json.jsonl",
        '{"prompt": "a", "response": " b"}\n{"prompt": "c", "response": " d"}\n{"prompt": "e",\n',
    )
    write("empty.jsonl", "\n\n")
    write("jsonl_named.csv", '{"prompt": "a", "response": " b"}\n')
    write("wrong_columns.csv", "question,reply\nQ,A\n")
    write(
        "first_row_type.jsonl",
        "".join(
            json.dumps(r) + "\n"
            for r in [
                {"prompt": ["a"], "response": " x"},
                {"prompt": "b", "response": " y"},
                {"prompt": "c", "response": " z"},
            ]
        ),
    )
    write(
        "kto.jsonl",
        "".join(
            json.dumps({"prompt": f"Q{i}", "completion": " A", "label": i % 2 == 0}) + "\n" for i in range(4)
        ),
    )
    write("a_file", "x")
    write(
        "boring.yaml",
        "model:\n  class_path: lightning.pytorch.demos.boring_classes.BoringModel\n"
        "data:\n  class_path: lightning.pytorch.demos.boring_classes.BoringDataModule\n",
    )
    (root / "a_folder").mkdir()
    paths["a_folder"] = str(root / "a_folder")
    paths["root"] = str(root)
    return paths


def _outputs(root: str) -> list[str]:
    return [
        f"--trainer.default_root_dir={root}/run",
        f"--trainer.logger.init_args.save_dir={root}/run",
        f"--model.init_args.export_dir={root}/run/hf",
    ]


def _with_outputs(args: list[str], root: str) -> list[str]:
    """Outputs into tmp, right after ``fit --config X`` so that a case's own later arguments win."""
    if args[:1] in (["fit"], ["validate"]) and args[1:2] == ["--config"]:
        return args[:3] + _outputs(root) + args[3:]
    return args


def _sft_data(path: str, *extra: str) -> list[str]:
    return [
        "fit",
        "--config",
        SFT,
        f"--data.init_args.train_files=[{path}]",
        "--data.init_args.format=auto",
        "--data.init_args.val_size=0",
        *extra,
    ]


CATALOGUE = [
    # (id, args built from the files fixture, substrings the message must hold)
    (
        "missing_data_file",
        lambda f: _sft_data(f["root"] + "/nope.jsonl"),
        ["data.init_args.train_files[0]: data file not found:", "nope.jsonl"],
    ),
    ("folder_as_file", lambda f: _sft_data(f["a_folder"]), ["train_files[0]:", "a_folder is a folder"]),
    ("malformed_row", lambda f: _sft_data(f["bad_json.jsonl"]), ["bad_json.jsonl: line 3: invalid JSON"]),
    ("empty_file", lambda f: _sft_data(f["empty.jsonl"]), ["empty.jsonl is empty"]),
    (
        "jsonl_named_csv",
        lambda f: _sft_data(f["jsonl_named.csv"]),
        ["jsonl_named.csv holds JSON", "rename it to .jsonl"],
    ),
    (
        "wrong_columns",
        lambda f: _sft_data(f["wrong_columns.csv"], "--data.init_args.format=explicit"),
        ["wrong_columns.csv: format 'explicit' needs the field(s) prompt", "['question', 'reply']"],
    ),
    (
        "first_row_type",
        lambda f: _sft_data(f["first_row_type.jsonl"]),
        ["first_row_type.jsonl: line 1: field 'prompt' is a list, but it is a string in 2 of 3 rows"],
    ),
    (
        "kto_file_to_sft",
        lambda f: _sft_data(f["kto.jsonl"]),
        ["kto.jsonl has a 'label' column", "keep_label: true"],
    ),
    (
        "misspelled_key",
        lambda f: ["fit", "--config", PPO, "--model.init_args.kl.kl_coeff=0.1"],
        ["unknown key model.init_args.kl.kl_coeff (did you mean 'kl_coef'?)"],
    ),
    (  # the constructor's Python-only collaborators (a sampler factory, a schedule) are not config keys
        "python_only_argument",
        lambda f: ["fit", "--config", PPO, "--model.init_args.schedule=rlhf_lit.rl.schedule.epoch_schedule"],
        ["unknown key model.init_args.schedule"],
    ),
    (
        "abbreviated_option",
        lambda f: ["fit", "--config", PPO, "--trainer.max_step=5"],
        [
            "unknown option --trainer.max_step (did you mean '--trainer.max_steps'? abbreviations are not accepted)"
        ],
    ),
    (
        "lr_zero",
        lambda f: ["fit", "--config", SFT, "--model.init_args.optimizer.lr=0"],
        ["model.init_args.optimizer.lr must be a number > 0, got 0.0"],
    ),
    (
        "ppo_epochs_zero",
        lambda f: ["fit", "--config", PPO, "--model.init_args.ppo.ppo_epochs=0"],
        ["model.init_args.ppo.ppo_epochs must be a whole number >= 1, got 0"],
    ),
    (
        "negative_target_kl",
        lambda f: ["fit", "--config", PPO, "--model.init_args.kl.target_kl=-1"],
        ["model.init_args.kl.target_kl must be a number > 0 (or null), got -1.0"],
    ),
    (
        "negative_clip_range",
        lambda f: ["fit", "--config", PPO, "--model.init_args.ppo.clip_range=-0.5"],
        ["model.init_args.ppo.clip_range must be a number > 0, got -0.5"],
    ),
    (
        "max_length_beyond_positions",
        lambda f: ["fit", "--config", SFT, "--data.init_args.max_length=600"],
        ["data.init_args.max_length (600) exceeds the model's 512 positions"],
    ),
    (
        "unwritable_export_dir",
        lambda f: ["fit", "--config", SFT, f"--model.init_args.export_dir={f['a_file']}/hf"],
        ["model.init_args.export_dir: cannot write to", "a_file is a file, not a folder"],
    ),
    (
        "ppo_max_steps",
        lambda f: ["fit", "--config", PPO, "--trainer.max_steps=10"],
        ["trainer.max_steps=10 would stop PPO inside an iteration", "ppo.total_iterations"],
    ),
    (
        "missing_checkpoint",
        lambda f: ["fit", "--config", PPO, "--ckpt_path", f["root"] + "/last.ckpt"],
        ["ckpt_path:", "last.ckpt does not exist"],
    ),
    (
        "unknown_subcommand",
        lambda f: ["fitt", "--config", SFT],
        ["unknown subcommand 'fitt' (did you mean 'fit'?)"],
    ),
    (
        "no_subcommand",
        lambda f: [],
        ["give a subcommand: fit, validate, test, predict, demo, plan, evaluate"],
    ),
    (
        "fit_without_a_config",
        lambda f: ["fit"],
        ["no data and no model given: name them in a config, e.g. rlhf-lit fit --config configs/sft/tiny.yaml"],
    ),
    (
        "plan_model_folder_without_config",
        lambda f: ["plan", "--config", "configs/dpo/smollm2_lora.yaml", f"--model.init_args.backbone.name_or_path={f['root']}"],
        ["no model config in", "a folder of GGUF files needs backbone.gguf_file"],
    ),
    (
        "plan_missing_config",
        lambda f: ["plan", "--config", "configs/ppo/nope.yaml"],
        ["plan: --config configs/ppo/nope.yaml: no such config file"],
    ),
    # errors raised while building the modules, YAML syntax, wrong export kinds, a hub id offline: in
    # tests/cli/test_catalogue.py, through the console script
    (
        "plan_unknown_stage",
        lambda f: ["plan", "--config", f["boring.yaml"]],
        [
            "model.class_path: lightning.pytorch.demos.boring_classes.BoringModel is not an rlhf_lit stage module"
        ],
    ),
    (
        "bad_accelerator",
        lambda f: ["fit", "--config", SFT, "--trainer.accelerator=tpuu"],
        ["trainer: You selected an invalid accelerator name"],
    ),
]
if not (REPO_ROOT / "checkpoints/sft/smollm2_lora/hf/config.json").exists():
    CATALOGUE.append(
        (
            "ppo_before_its_exports",
            lambda f: ["fit", "--config", "configs/ppo/smollm2_lora.yaml"],
            [
                "checkpoints/sft/smollm2_lora/hf holds no model yet",
                "SFT stage",
                "rlhf-lit fit --config configs/sft/smollm2_lora.yaml",
                "configs/reward/smollm2_lora.yaml",
            ],
        )
    )


def _main(args: list[str], capsys) -> tuple[int, list[str]]:
    capsys.readouterr()
    with in_repo_root(), one_thread(), pytest.raises(SystemExit) as info:
        main(args)
    err = capsys.readouterr().err
    return info.value.code, [line for line in err.splitlines() if line.strip()]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_a_user_mistake_is_one_line_and_exit_2(case, files, capsys):
    _, make_args, expected = case
    code, lines = _main(_with_outputs(make_args(files), files["root"]), capsys)
    assert code == 2, lines
    assert 1 <= len(lines) <= 3 and not any("Traceback" in line for line in lines), lines
    message = lines[-1]
    assert message.startswith("rlhf-lit: error: ")
    for text in expected:
        assert text in message, message


def test_debug_shows_the_traceback_of_a_user_mistake(files, capsys, monkeypatch):
    args = ["fit", "--config", SFT, "--model.init_args.optimizer.lr=0", *_outputs(files["root"])]
    code, lines = _main([*args, "--debug"], capsys)
    assert code == 2 and lines[0].startswith("Traceback") and lines[-1].startswith("rlhf-lit: error: ")
    monkeypatch.setenv("RLHF_LIT_DEBUG", "1")
    code, lines = _main(args, capsys)
    assert code == 2 and lines[0].startswith("Traceback")


def test_an_internal_error_keeps_its_traceback(files, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug, not a user mistake")

    monkeypatch.setattr("rlhf_lit.checks.check_config", broken)
    with in_repo_root(), pytest.raises(RuntimeError, match="a bug"):
        main(["fit", "--config", SFT, *_outputs(files["root"])])


def test_help_lists_demo_and_plan(capsys):
    with in_repo_root(), pytest.raises(SystemExit) as info:
        main(["--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0
    assert "demo (the whole pipeline" in " ".join(out.split()) and "plan (peak-memory estimate" in " ".join(
        out.split()
    )


# one per phase: parse (unknown key), the checks before loading (an export not written yet; without it a
# value check), and the data read after the model is built (a malformed row)
SUBPROCESS_CASES = [
    "misspelled_key",
    "malformed_row",
    "ppo_before_its_exports"
    if any(c[0] == "ppo_before_its_exports" for c in CATALOGUE)
    else "negative_clip_range",
]


@pytest.mark.slow
def test_the_real_console_script_prints_one_line_and_exits_2(files):
    cases = [c for c in CATALOGUE if c[0] in SUBPROCESS_CASES]

    misspelled = next(c for c in cases if c[0] == "misspelled_key")

    def run(case, env=None):
        return case, run_cli(*_with_outputs(case[1](files), files["root"]), env=env)

    with ThreadPoolExecutor(max_workers=2) as pool:
        debug = pool.submit(run, misspelled, {"RLHF_LIT_DEBUG": "1"})
        results = list(pool.map(run, cases))
    for (name, _, expected), result in results:
        lines = stderr_lines(result)
        assert result.returncode == 2, (name, result.stderr[-2000:])
        assert len(lines) <= 3 and "Traceback" not in result.stderr, (name, lines)
        assert lines[-1].startswith("rlhf-lit: error: ") and all(t in lines[-1] for t in expected), (
            name,
            lines,
        )
        assert "LightningCLI's args parameter" not in result.stderr  # no warning on every command
    _, debug_result = debug.result()
    assert debug_result.returncode == 2 and "Traceback" in debug_result.stderr
    assert "did you mean 'kl_coef'" in debug_result.stderr
