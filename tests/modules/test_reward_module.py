"""RewardModule on tiny models: training, logged metrics, calibration, the loss terms and the HF export.

Two runs are shared by the tests (each a few optimizer steps, then validation, calibration and export):

* ``lora_run``: RewardModule + PreferenceDataModule built directly, a 2-layer 32-dim GPT-2 with LoRA,
  explicit prompt/chosen/rejected rows written to a tmp file;
* the ``configs/reward/tiny.yaml`` run through the CLI (full fine-tuning, real HH-RLHF pairs), 2 steps.
"""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import TensorBoardLogger

from rlhf_lit import metrics as M
from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.models import BackboneConfig, LoraSettings, load_backbone, load_reward_model
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.tiny_runs import one_thread, read_scalars, run_tiny

PAD = 1  # the byte tokenizer's pad id (EOS is 0)
LOGGED = (
    M.REWARD_ACCURACY,
    M.REWARD_MARGIN,
    M.REWARD_CHOSEN_MEAN,
    M.REWARD_REJECTED_MEAN,
    M.REWARD_ECE,
    M.REWARD_TEMPERATURE,
    M.REWARD_LENGTH_RULE_ACCURACY,
    M.REWARD_VS_LENGTH_RULE_SE,
    M.REWARD_LENGTH_MATCHED_FRACTION,
    M.REWARD_SCORE_LENGTH_SPEARMAN,
    M.TRAIN_LOSS,
    M.VAL_LOSS,
)


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (see ``tests.tiny_runs.one_thread``); overrides the conftest's two."""
    with one_thread():
        yield


def _write_pairs(path: Path, n: int) -> str:
    """HH-like pairs: a polite, longer chosen answer and a short rude rejected one."""
    rows = []
    for i in range(n):
        rows.append(
            {
                "prompt": f"\n\nHuman: Can you help me with task number {i}?\n\nAssistant:",
                "chosen": f" Of course, happy to help with task {i}. Here is how.",
                "rejected": " No." if i % 2 else " Go away.",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp("reward_lora")
    L.seed_everything(0, verbose=False)
    module = RewardModule(
        BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=LoraSettings(r=4, alpha=8)),
        optimizer=OptimizerConfig(lr=1e-2),
        export_dir=str(root / "hf"),
    )
    data = PreferenceDataModule(
        train_files=_write_pairs(root / "pairs.jsonl", 24),
        format="explicit",
        val_size=8,
        max_length=96,
        batch_size=4,
        tokenizer=module.tokenizer,
    )
    before = _snapshot(module)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        log_every_n_steps=1,
        logger=TensorBoardLogger(str(root), name="tb"),
        default_root_dir=str(root),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with one_thread():
        trainer.fit(module, datamodule=data)
    module.eval()
    return SimpleNamespace(
        module=module, before=before, datamodule=data, export_dir=root / "hf", log_dir=trainer.logger.log_dir
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> SimpleNamespace:
    run = run_tiny("configs/reward/tiny.yaml", tmp_path_factory)
    run.cli.model.eval()
    return SimpleNamespace(
        module=run.cli.model, datamodule=run.cli.datamodule, export_dir=run.export_dir, log_dir=run.log_dir
    )


RUNS = ["lora_run", "full_run"]


def _padded_probe(tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Three sequences: right-padded, unpadded, left-padded (B=3, T); mask 1 = real token."""
    texts = [
        "\n\nHuman: hi\n\nAssistant: Hello there!",
        "\n\nHuman: and you?\n\nAssistant: Fine, thank you.",
        "ok",
    ]
    seqs = [tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for t in texts]
    width = max(len(s) for s in seqs)
    ids = torch.full((3, width), PAD)
    mask = torch.zeros((3, width), dtype=torch.long)
    ids[0, : len(seqs[0])], mask[0, : len(seqs[0])] = torch.tensor(seqs[0]), 1
    ids[1, : len(seqs[1])], mask[1, : len(seqs[1])] = torch.tensor(seqs[1]), 1
    ids[2, width - len(seqs[2]) :], mask[2, width - len(seqs[2]) :] = torch.tensor(seqs[2]), 1
    return ids, mask


# -- what trains ------------------------------------------------------------------------------------------
def test_lora_run_trains_head_and_adapter_only(lora_run):
    module = lora_run.module
    named = dict(module.named_parameters())
    lora = {n for n in named if "lora_" in n}
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert lora and trainable == lora | {"head.linear.weight", "head.linear.bias"}
    moved = {n for n in named if not torch.equal(named[n].detach(), lora_run.before[n])}
    # every base weight is bit-identical (after the merged export too); the adapter and the head weight moved.
    # The head bias may or may not: the pairwise loss only sees r_chosen - r_rejected, so its gradient is 0
    # up to rounding.
    assert moved <= trainable
    assert lora | {"head.linear.weight"} <= moved


def test_full_run_changes_every_trunk_parameter_but_the_shift(full_run):
    module = full_run.module
    init = load_backbone(module.backbone_cfg, module.tokenizer)
    init_params = dict(init.named_parameters())
    trunk = dict(module.lm.model.named_parameters())
    assert all(p.requires_grad for p in module.parameters())
    unchanged = {n for n, p in trunk.items() if torch.equal(p.detach(), init_params[n].detach())}
    # The final LayerNorm's bias only adds the same w . b to every reward, and the pairwise loss sees only
    # r_chosen - r_rejected: its gradient is 0 (the only trunk parameter allowed to stay put).
    assert unchanged <= {"transformer.ln_f.bias"}


# -- what is logged ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_name", RUNS)
def test_reward_metrics_are_logged(run_name, request):
    run = request.getfixturevalue(run_name)
    scalars = read_scalars(run.log_dir)
    missing = [name for name in LOGGED if name not in scalars]
    assert missing == []
    for name in LOGGED:
        assert all(math.isfinite(v) for _, v in scalars[name]), name
    assert 0.0 <= scalars[M.REWARD_ACCURACY][-1][1] <= 1.0
    assert scalars[M.REWARD_TEMPERATURE][-1][1] == pytest.approx(float(run.module.temperature), rel=1e-6)
    # one accuracy per input file among the pairs calibration scored (limit_val_batches of them), named after it
    per_file = json.loads((run.export_dir / "eval_results.json").read_text())["per_file"]
    assert per_file and set(per_file) <= set(run.datamodule.source_names)
    for name in per_file:
        assert f"{M.REWARD_ACCURACY}/{name}" in scalars


# -- the export -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("run_name", RUNS)
def test_export_folder_holds_every_file(run_name, request):
    run = request.getfixturevalue(run_name)
    out = run.export_dir
    for name in (
        "config.json",
        "model.safetensors",
        "reward_head.safetensors",
        "rlhf_lit.json",
        "eval_results.json",
        "reliability.png",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (out / name).is_file(), name
    assert (out / "reliability.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    results = json.loads((out / "eval_results.json").read_text())
    # calibration scored the validation pairs of the first limit_val_batches batches (all of them by default)
    loader = run.datamodule.val_dataloader()
    batches = run.module._calibration_batches(loader)
    assert batches >= 1
    assert results["pairs"] == sum(b["source"].numel() for b in itertools.islice(loader, batches))
    assert results["temperature"] == pytest.approx(float(run.module.temperature), rel=1e-6)
    assert {M.REWARD_ACCURACY, M.REWARD_ECE, M.REWARD_MARGIN} <= results["metrics"].keys()


@pytest.mark.parametrize("run_name", RUNS)
def test_meta_temperature_equals_the_module_buffer(run_name, request):
    run = request.getfixturevalue(run_name)
    meta = json.loads((run.export_dir / "rlhf_lit.json").read_text())
    assert meta["kind"] == "reward_model"
    assert meta["hidden_size"] == run.module.backbone_cfg.tiny["n_embd"]
    assert meta["temperature"] == float(run.module.temperature)
    assert meta["temperature"] != 1.0  # calibration ran and was stored


@pytest.mark.parametrize("run_name", RUNS)
def test_export_scores_with_transformers_and_safetensors_alone(run_name, request):
    """What a user without rlhf_lit does: trunk hidden state at the last real token, then the head."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    run = request.getfixturevalue(run_name)
    module = run.module
    ids, mask = _padded_probe(module.tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(run.export_dir)).eval()
    head = load_file(str(run.export_dir / "reward_head.safetensors"))
    assert head["weight"].shape == (1, model.config.hidden_size) and head["bias"].shape == (1,)
    with torch.no_grad():
        position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
        hidden = model.base_model(
            input_ids=ids, attention_mask=mask, position_ids=position_ids
        ).last_hidden_state
        last = torch.tensor([int(row.nonzero().max()) for row in mask])
        by_hand = hidden[torch.arange(3), last] @ head["weight"][0] + head["bias"][0]
        expected = module.score(ids, mask)
        scorer = load_reward_model(str(run.export_dir))
        loaded = scorer.score(ids, mask, calibrated=False)
        calibrated = scorer.score(ids, mask)
    torch.testing.assert_close(by_hand, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(loaded, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(calibrated, expected / float(module.temperature), atol=1e-5, rtol=1e-6)


def test_adapter_only_export_loads_through_load_reward_model(lora_run, tmp_path, monkeypatch):
    """``export_mode='adapter'``: no merged weights; ``load_reward_model`` rebuilds the base and adds the adapter."""
    module = lora_run.module
    monkeypatch.setitem(module.hparams, "export_mode", "adapter")
    module.export(str(tmp_path))
    assert not (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    ids, mask = _padded_probe(module.tokenizer)
    with torch.no_grad():
        got = load_reward_model(str(tmp_path)).score(ids, mask, calibrated=False)
        expected = module.score(ids, mask)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_fit_without_a_validation_split_skips_calibration_and_still_exports(tmp_path):
    """val_size=0 is allowed; the end of fit used to crash in calibration (torch.cat of no batches),
    before the export was written."""
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), export_dir=str(tmp_path / "hf"))
    data = PreferenceDataModule(
        train_files=_write_pairs(tmp_path / "pairs.jsonl", 8),
        format="explicit",
        val_size=0,
        batch_size=4,
        tokenizer=module.tokenizer,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    assert float(module.temperature) == 1.0
    assert (tmp_path / "hf" / "reward_head.safetensors").is_file()
    assert json.loads((tmp_path / "hf" / "rlhf_lit.json").read_text())["temperature"] == 1.0
    assert not (tmp_path / "hf" / "eval_results.json").exists()


# -- calibration ------------------------------------------------------------------------------------------
def _bt_pairs(true_temperature: float, n: int, seed: int = 0) -> torch.Tensor:
    """Margins of pairs labelled by P(chosen wins) = sigmoid(z / T): the model's margin is z if the
    first response was chosen, -z otherwise. The MLE of the temperature is then T (up to sampling noise)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, generator=g) * 3.0
    first_wins = torch.rand(n, generator=g) < torch.sigmoid(z / true_temperature)
    return torch.where(first_wins, z, -z)


@pytest.mark.parametrize("true_temperature", [2.5, 0.5])
def test_calibrate_temperature_recovers_a_known_temperature(true_temperature, monkeypatch):
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    margins = _bt_pairs(true_temperature, 20000)
    n = margins.numel()
    stats = (margins, torch.zeros(n), torch.zeros(n, dtype=torch.long), torch.full((n,), 5), torch.full((n,), 3))
    monkeypatch.setattr(module, "collect_scores", lambda loader, max_batches=None: stats)
    results = module.calibrate_temperature(None)
    assert results["temperature_at_bound"] is False
    fitted = results["temperature"]
    assert fitted == pytest.approx(true_temperature, rel=0.05)
    assert float(module.temperature) == pytest.approx(fitted, rel=1e-6)
    m = results["metrics"]
    assert m[M.REWARD_ECE_CALIBRATED] <= m[M.REWARD_ECE]
    assert m[M.REWARD_ECE_CALIBRATED] < 0.02 < m[M.REWARD_ECE]  # the miscalibration was real and is gone
    assert m[M.REWARD_ACCURACY] == pytest.approx(float((margins > 0).float().mean()))
    assert m[M.REWARD_LENGTH_RULE_ACCURACY] == 1.0  # chosen is always the longer one here


def test_a_temperature_at_the_search_bound_is_reported_as_unreliable(monkeypatch, caplog):
    # margins [1, -1, 1, -1] carry no information about the labels: d loss / d(1/T) at T = 100 is
    # mean(z * (sigmoid(z / 100) - 1)) = (1 * -0.4975 + -1 * -0.5025) / 2 = +0.0025 >= 0, so the NLL still falls
    # as T grows and the fit stops at the upper bound of its interval
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    margins = torch.tensor([1.0, -1.0, 1.0, -1.0])
    stats = (margins, torch.zeros(4), torch.zeros(4, dtype=torch.long), torch.full((4,), 5), torch.full((4,), 3))
    monkeypatch.setattr(module, "collect_scores", lambda loader, max_batches=None: stats)
    with caplog.at_level("WARNING", logger="rlhf_lit"):
        results = module.calibrate_temperature(None)
    assert results["temperature"] == 100.0 and results["temperature_at_bound"] is True
    assert "at a bound of its search interval" in caplog.text and "T=100" in caplog.text


@pytest.mark.parametrize("limit, expected", [(1.0, 10), (0.25, 2), (3, 3), (50, 10), (0, 0), (0.0, 0)])
def test_calibration_follows_limit_val_batches(limit, expected, monkeypatch):
    """An int limit is a batch count, a float a fraction of the loader (as Lightning reads limit_val_batches)."""
    module = RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"))
    module._trainer = SimpleNamespace(limit_val_batches=limit, is_global_zero=True)
    loader = [{"source": torch.zeros(2, dtype=torch.long)} for _ in range(10)]
    assert module._calibration_batches(loader) == expected
    if expected == 0:  # on_fit_end skips calibration then (with a warning)
        return
    scored = []

    def score_pairs(batch):
        scored.append(batch)
        return torch.ones(2), torch.zeros(2), None

    monkeypatch.setattr(module, "_score_pairs", score_pairs)
    for batch in loader:
        batch["chosen_response_len"] = batch["rejected_response_len"] = torch.ones(2)
    margins = module.collect_margins(loader, module._calibration_batches(loader))[0]
    assert len(scored) == expected and margins.numel() == 2 * expected


# -- the loss ---------------------------------------------------------------------------------------------
def _pair_batch() -> dict[str, torch.Tensor]:
    """3 pairs, prompt [40, 41, 42], right-padded with PAD to T = 7; responses end with EOS (0)."""
    prompt = [40, 41, 42]
    chosen = [[50, 51, 0], [52, 0], [53, 54, 55, 0]]
    rejected = [[60, 0], [61, 62, 63, 0], [64, 65, 0]]
    width = 7

    def pad(seqs):
        ids = torch.full((3, width), PAD)
        mask = torch.zeros((3, width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask

    c_ids, c_mask = pad([prompt + r for r in chosen])
    r_ids, r_mask = pad([prompt + r for r in rejected])
    labels = torch.where(c_mask.bool(), c_ids, torch.full_like(c_ids, -100))
    labels[:, : len(prompt)] = -100
    return {
        "chosen_input_ids": c_ids,
        "chosen_attention_mask": c_mask,
        "rejected_input_ids": r_ids,
        "rejected_attention_mask": r_mask,
        "chosen_labels": labels,
        "margin": torch.tensor([0.0, 0.5, 1.0]),
        "source": torch.zeros(3, dtype=torch.long),
        "chosen_response_len": torch.tensor([len(r) for r in chosen]),
        "rejected_response_len": torch.tensor([len(r) for r in rejected]),
    }


@pytest.fixture(scope="module")
def rm() -> RewardModule:
    torch.manual_seed(0)
    # a wide head makes the rewards differ by O(1), so every term is far from its value at d = 0; padded, so
    # the length_groups tests run length groups (packing's equality: tests/modules/test_packing.py)
    return RewardModule(BackboneConfig(tiny=TINY_GPT2, tokenizer="byte"), head_init_std=1.0, packing=False)


def _expected_loss(rm: RewardModule, batch: dict, eps: float, beta: float, center: float) -> torch.Tensor:
    with torch.no_grad():
        r_c = rm.score(batch["chosen_input_ids"], batch["chosen_attention_mask"]).double()
        r_r = rm.score(batch["rejected_input_ids"], batch["rejected_attention_mask"]).double()
        d = r_c - r_r - batch["margin"].double()
        # -(1 - eps) log sigmoid(d) - eps log sigmoid(-d), mean over pairs
        loss = (-(1 - eps) * F.logsigmoid(d) - eps * F.logsigmoid(-d)).mean()
        loss = loss + center * ((r_c + r_r) ** 2).mean()
        # NLL of the chosen response tokens (labels != -100), per token over the batch, by hand
        logits = rm.lm.model(
            input_ids=batch["chosen_input_ids"], attention_mask=batch["chosen_attention_mask"]
        ).logits.double()
        logprobs = torch.log_softmax(logits, dim=-1)
        labels = batch["chosen_labels"]
        terms = [
            -logprobs[b, t - 1, labels[b, t]]
            for b in range(labels.shape[0])
            for t in range(1, labels.shape[1])
            if labels[b, t] != -100
        ]
        assert len(terms) == 3 + 2 + 4
        return loss + beta * torch.stack(terms).mean()


@pytest.mark.parametrize(
    "eps, beta, center",
    [(0.0, 0.0, 0.0), (0.1, 0.0, 0.0), (0.0, 0.5, 0.0), (0.0, 0.0, 0.3), (0.2, 0.5, 0.3)],
    ids=["plain", "label_smoothing", "beta_rm", "center_rewards_coef", "all"],
)
def test_training_loss_matches_a_hand_computation(rm, eps, beta, center, monkeypatch):
    batch = _pair_batch()
    monkeypatch.setitem(rm.hparams, "label_smoothing", eps)
    monkeypatch.setitem(rm.hparams, "beta_rm", beta)
    monkeypatch.setitem(rm.hparams, "center_rewards_coef", center)
    monkeypatch.setattr(rm, "log", lambda *a, **k: None)
    with torch.no_grad():
        loss = rm.training_step(batch, 0)
    torch.testing.assert_close(
        loss.double(), _expected_loss(rm, batch, eps, beta, center), atol=1e-5, rtol=1e-5
    )


def test_each_option_changes_the_loss_by_its_own_term(rm, monkeypatch):
    """label_smoothing adds eps * mean(d) (softplus(-d) + eps * d); the others add their non-negative terms."""
    batch = _pair_batch()
    monkeypatch.setattr(rm, "log", lambda *a, **k: None)

    def loss_with(**options):
        for key in ("label_smoothing", "beta_rm", "center_rewards_coef"):
            monkeypatch.setitem(rm.hparams, key, options.get(key, 0.0))
        with torch.no_grad():
            return float(rm.training_step(batch, 0))

    with torch.no_grad():
        r_c = rm.score(batch["chosen_input_ids"], batch["chosen_attention_mask"])
        r_r = rm.score(batch["rejected_input_ids"], batch["rejected_attention_mask"])
    d = r_c - r_r - batch["margin"]
    base = loss_with()
    assert loss_with(label_smoothing=0.1) - base == pytest.approx(0.1 * float(d.mean()), abs=1e-5)
    assert loss_with(center_rewards_coef=0.3) - base == pytest.approx(
        0.3 * float(((r_c + r_r) ** 2).mean()), abs=1e-5
    )
    assert loss_with(beta_rm=0.5) - base > 0.5 * math.log(2)  # an untrained LM: NLL near ln(V) >> ln 2


def test_ties_count_as_wrong(rm, monkeypatch):
    """Equal rewards -> accuracy 0 (not 0.5, not 1), in training and in validation.

    The tie is made exact by patching the scorer: the same sequence scored at two rows of one batch can
    differ in the last bit (BLAS blocks rows), so real identical inputs do not give a reliable tie.
    """
    logged: dict[str, float] = {}
    monkeypatch.setattr(
        rm, "log", lambda name, value, **k: logged.__setitem__(name, float(torch.as_tensor(value).detach()))
    )
    rewards = torch.tensor([0.3, -1.0, 2.0], requires_grad=True)
    monkeypatch.setattr(rm, "_score_pairs", lambda batch, need_hidden=False: (rewards, rewards.detach().clone(), None))
    batch = _pair_batch()
    rm.training_step(batch, 0)
    assert logged[M.TRAIN_ACCURACY] == 0.0
    assert logged[M.TRAIN_LOSS] == pytest.approx(float((-F.logsigmoid(-batch["margin"])).mean()))
    with torch.no_grad():
        rm.validation_step(batch, 0)
        rm.on_validation_epoch_end()
    assert logged[M.REWARD_ACCURACY] == 0.0
    assert logged[M.REWARD_MARGIN] == 0.0
    # margins [+1, 0, -1, 0]: one right, one wrong and two ties -> 1/4
    results = rm._evaluate(
        torch.tensor([1.0, 0.0, -1.0, 0.0]), torch.zeros(4), torch.zeros(4), torch.ones(4), torch.ones(4), 1.0
    )
    assert results["metrics"][M.REWARD_ACCURACY] == 0.25
    assert results["metrics"][M.REWARD_LENGTH_RULE_ACCURACY] == 0.5  # equal lengths: a coin flip


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("groups", [2, 3, 4])
def test_length_groups_give_the_scores_and_gradients_of_one_padded_forward(rm, side, groups, monkeypatch):
    """Padding is inert (causal attention, position ids from the mask): cutting each length group to its
    own real columns must not change the rewards or the gradients."""
    lengths = [3, 11, 7, 1, 16, 5, 9, 2]  # 4 pairs: chosen rows 0-3, rejected rows 4-7
    ids = torch.randint(3, 200, (8, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(8, 16, dtype=torch.long)
    for row, n in enumerate(lengths):
        if side == "right":
            mask[row, :n] = 1
        else:
            mask[row, 16 - n :] = 1
    ids = ids * mask  # pad id 0
    batch = {
        "chosen_input_ids": ids[:4],
        "chosen_attention_mask": mask[:4],
        "rejected_input_ids": ids[4:],
        "rejected_attention_mask": mask[4:],
    }
    results = {}
    for g in (1, groups):
        monkeypatch.setitem(rm.hparams, "length_groups", g)
        rm.zero_grad()
        chosen, rejected, _ = rm._score_pairs(batch)
        (chosen.sum() - 2 * rejected.sum()).backward()
        grads = {n: p.grad.clone() for n, p in rm.named_parameters() if p.grad is not None}
        results[g] = (torch.cat([chosen, rejected]).detach(), grads)
    assert results[1][0].std() > 0.1  # distinct rewards, so a mix-up of rows would show
    torch.testing.assert_close(results[groups][0], results[1][0], atol=1e-5, rtol=1e-5)
    assert results[groups][1].keys() == results[1][1].keys()
    for name, grad in results[1][1].items():
        torch.testing.assert_close(results[groups][1][name], grad, atol=1e-5, rtol=1e-4)
    rm.zero_grad()


def test_pair_weights_give_each_ranked_prompt_the_same_total_weight(rm, monkeypatch):
    """weight_ranked_pairs: loss = sum(w * loss_i) / sum(w), by hand.

    Pairs: rewards (chosen, rejected) = (2, 0) with w = 1/3 (a pair of a 3-response list) and (0, 0) with
    w = 1 (a plain pair): loss_1 = softplus(-2) = ln(1 + e^-2) = 0.126928, loss_2 = ln 2 = 0.693147;
    weighted = (0.126928 / 3 + 0.693147) / (1/3 + 1) = 0.735456 / 1.333333 = 0.551592 (unweighted: 0.410038).
    """
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    monkeypatch.setattr(rm, "_score_pairs", lambda batch, need_hidden=False: (chosen, rejected, None))
    monkeypatch.setattr(rm, "log", lambda *a, **k: None)
    monkeypatch.setitem(rm.hparams, "label_smoothing", 0.0)
    monkeypatch.setitem(rm.hparams, "beta_rm", 0.0)
    monkeypatch.setitem(rm.hparams, "center_rewards_coef", 0.0)
    weighted = rm.training_step({"margin": torch.zeros(2), "pair_weight": torch.tensor([1 / 3, 1.0])}, 0)
    torch.testing.assert_close(weighted, torch.tensor(0.551592), atol=1e-6, rtol=0)
    plain = rm.training_step({"margin": torch.zeros(2)}, 0)
    torch.testing.assert_close(plain, torch.tensor(0.410038), atol=1e-6, rtol=0)
    equal = rm.training_step({"margin": torch.zeros(2), "pair_weight": torch.tensor([0.5, 0.5])}, 0)
    torch.testing.assert_close(equal, plain)  # equal weights are the plain mean


# -- length-bias diagnostics ------------------------------------------------------------------------------
def test_one_validation_pair_is_evaluated(rm, monkeypatch):
    """A validation split of one pair (val_size=1 on one file): torchmetrics' CatMetric returns one value as
    a 0-d tensor, which the length diagnostics could not concatenate (a RuntimeError in the sanity check).
    Margin 0.5 - 1.5 = -1 (wrong); lengths 12 vs 12: matched, the rule's coin flip 0.5."""
    chosen, rejected = torch.tensor([0.5]), torch.tensor([1.5])
    batch = {
        "source": torch.tensor([0]),
        "chosen_response_len": torch.tensor([12]),
        "rejected_response_len": torch.tensor([12]),
        "margin": None,
    }
    logged: dict[str, float] = {}
    monkeypatch.setattr(rm, "log", lambda name, value, **k: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(rm, "_score_pairs", lambda batch, need_hidden=False: (chosen, rejected, None))
    monkeypatch.setattr(rm, "_source_names", lambda: ["a"])
    with torch.no_grad():
        rm.validation_step(batch, 0)
        rm.on_validation_epoch_end()
    assert rm.results["pairs"] == 1
    assert logged[M.REWARD_ACCURACY] == 0.0 and logged[M.REWARD_MARGIN] == -1.0
    assert logged[M.REWARD_LENGTH_RULE_ACCURACY] == 0.5 and logged[M.REWARD_LENGTH_MATCHED_FRACTION] == 1.0
    assert math.isnan(logged[M.REWARD_VS_LENGTH_RULE_SE])  # a paired SE needs two pairs


def test_validation_logs_the_length_diagnostics_pooled_and_per_file(rm, monkeypatch):
    """Six pairs over two files, scores patched in; every logged value worked out by hand.

    Lengths (chosen, rejected) and r_chosen - r_rejected:
      file a: (10, 11) +0.5, (20, 8) -1.0, (30, 30) +2.0      file b: (5, 6) +0.3, (8, 8) -0.2, (40, 25) +1.0
    correct [1, 0, 1, 1, 0, 1] -> 4/6; longer wins [0, 1, .5, 0, .5, 1] -> 1/2; paired z = (1/6) / (1/3) = 0.5
    (tests/unit/test_length_bias.py); matched pairs (within 10%) 0, 2, 4: accuracy 2/3, the rule 1/3.
    """
    chosen = torch.tensor([0.5, -1.0, 2.0, 0.3, -0.2, 1.0])
    rejected = torch.zeros(6)
    batch = {
        "source": torch.tensor([0, 0, 0, 1, 1, 1]),
        "chosen_response_len": torch.tensor([10, 20, 30, 5, 8, 40]),
        "rejected_response_len": torch.tensor([11, 8, 30, 6, 8, 25]),
        "margin": None,
    }
    logged: dict[str, float] = {}
    monkeypatch.setattr(rm, "log", lambda name, value, **k: logged.__setitem__(name, float(value)))
    monkeypatch.setattr(rm, "_score_pairs", lambda batch, need_hidden=False: (chosen, rejected, None))
    monkeypatch.setattr(rm, "_source_names", lambda: ["a", "b"])
    with torch.no_grad():
        rm.validation_step(batch, 0)
        rm.on_validation_epoch_end()
    assert logged[M.REWARD_ACCURACY] == pytest.approx(4 / 6)
    assert logged[M.REWARD_LENGTH_RULE_ACCURACY] == pytest.approx(0.5)
    assert logged[M.REWARD_VS_LENGTH_RULE_SE] == pytest.approx(0.5)
    assert logged[M.REWARD_LENGTH_MATCHED_ACCURACY] == pytest.approx(2 / 3)
    assert logged[M.REWARD_LENGTH_MATCHED_LENGTH_RULE] == pytest.approx(1 / 3)
    assert logged[M.REWARD_LENGTH_MATCHED_FRACTION] == pytest.approx(0.5)
    assert logged[M.REWARD_ACCURACY_BY_LENGTH_DIFF.format(bucket="50-100pct")] == 0.0  # pair 1
    assert logged[M.REWARD_LENGTH_RULE_BY_LENGTH_DIFF.format(bucket="50-100pct")] == 1.0
    # 12 responses: scores [.5, -1, 2, .3, -.2, 1, 0 x 6] against lengths [10, 20, 30, 5, 8, 40, 11, 8, 30, 6, 8, 25]
    assert -1.0 <= logged[M.REWARD_SCORE_LENGTH_SPEARMAN] <= 1.0
    # per file: a = pairs 0-2 (correct 2/3, rule 1/2), b = pairs 3-5 (correct 2/3, rule 1/2)
    assert logged[f"{M.REWARD_ACCURACY}/a"] == pytest.approx(2 / 3)
    assert logged[f"{M.REWARD_LENGTH_RULE_ACCURACY}/b"] == pytest.approx(0.5)
    per_file = rm.results["per_file"]
    assert per_file["a"]["length_matched"]["pairs"] == 2 and per_file["b"]["length_matched"]["pairs"] == 1
    assert per_file["a"]["length_matched"]["accuracy"] == 1.0 and per_file["b"]["length_matched"]["accuracy"] == 0.0
    assert rm.results["length_bias"]["vs_length_rule"]["se"] == pytest.approx(1 / 3)
