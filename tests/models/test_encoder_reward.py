"""Reward models on encoder backbones (BERT-style, tiny, built from config) and on causal LMs, side by side.

What is checked:

* which backbones are encoders, and how they are loaded (no LM head) and pooled (literal tensors);
* the encoder's input is ``[CLS] prompt response [SEP]`` (``[CLS] response [SEP]`` for a reward model trained on
  responses alone), built by the data module's own rules from a BERT-style tokenizer that has no BOS / EOS;
* full fine-tuning and LoRA train; ``freeze_layers`` freezes exactly the embeddings and the lower layers;
* acceptance: an encoder and a causal reward model, each exported at the end of fit, score the validation
  pairs -- tokenized from their TEXT with plain transformers, pooled and put through the saved head by hand --
  exactly as the validation pass scored them in training; ``load_reward_model`` does the same;
* PPO's cross-tokenizer path feeds an encoder reward model exactly the ids reward training built.

The tokenizer is a WordPiece vocabulary trained here in milliseconds (``tests.models.encoders``), a plain
transformers folder with CLS/SEP/PAD/UNK/MASK and no BOS/EOS, as BERT and all-MiniLM-L6-v2 ship.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer

from rlhf_lit.data import PreferenceDataModule
from rlhf_lit.data.records import parse_hh_messages
from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig, RewardSource, load_reward_model
from rlhf_lit.models.backbone import backbone_is_encoder, load_backbone, load_backbone_tokenizer
from rlhf_lit.models.heads import pool_hidden
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.models.trunk import is_encoder_config, trunk_hidden_states
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.models.encoders import wordpiece_folder
from tests.tiny_runs import one_thread

TINY_BERT = {
    "model_type": "bert",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
}
PROMPTS = [
    "\n\nHuman: How do I bake bread at home?\n\nAssistant:",
    "\n\nHuman: What is a good name for a cat?\n\nAssistant:",
    "\n\nHuman: Can you help me write a letter to my landlord?\n\nAssistant:",
    "\n\nHuman: Why is the sky blue?\n\nAssistant:",
]
GOOD = [
    " Mix flour, water, yeast and salt, let it rise, then bake it hot.",
    " Whiskers is a classic; Luna and Milo are popular too.",
    " Sure. Start with the date, then say what needs fixing and by when.",
    " Sunlight scatters off air molecules, and blue light scatters the most.",
]
BAD = [" No.", " I do not know.", " Write it yourself.", " It just is."]


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def wordpiece(tmp_path_factory) -> str:
    return wordpiece_folder(
        tmp_path_factory.mktemp("wordpiece"), PROMPTS + GOOD + BAD + ["human assistant"] * 3
    )


def _pairs_file(path: Path, n: int) -> str:
    rows = [
        {"prompt": PROMPTS[i % 4], "chosen": GOOD[i % 4], "rejected": BAD[(i + i // 4) % 4]} for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _rows(path: str) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


# -- which backbones are encoders -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "model_type, expected",
    [
        ("bert", True),
        ("roberta", True),
        ("deberta-v2", True),
        ("distilbert", True),
        ("electra", True),
        ("gpt2", False),
        ("llama", False),
        ("bart", False),  # an encoder-decoder
    ],
)
def test_encoders_are_the_masked_lm_types_that_are_not_encoder_decoders(model_type, expected):
    assert is_encoder_config(AutoConfig.for_model(model_type)) is expected


def test_an_encoder_backbone_is_the_bare_trunk_with_cls_and_sep_as_bos_and_eos(wordpiece):
    cfg = BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece)
    assert backbone_is_encoder(cfg) and not backbone_is_encoder(BackboneConfig(tiny=TINY_GPT2))
    tok = load_backbone_tokenizer(cfg)
    assert (tok.bos_token, tok.eos_token) == ("[CLS]", "[SEP]")
    assert (
        tok("why is the sky blue")["input_ids"]
        == AutoTokenizer.from_pretrained(wordpiece)("why is the sky blue")["input_ids"]
    )  # plain tokenization is unchanged
    model = load_backbone(cfg, tok)
    assert type(model).__name__ == "BertModel" and model.get_output_embeddings() is None
    assert model.config.vocab_size == len(tok) and model.config.pad_token_id == tok.pad_token_id


def test_an_encoder_refuses_left_padded_rows(wordpiece):
    cfg = BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece)
    model = load_backbone(cfg)
    ids = torch.tensor([[7, 8, 9, 0], [0, 7, 8, 9]])
    with pytest.raises(ValueError, match="right-padded"):
        trunk_hidden_states(model, ids, torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]))
    assert trunk_hidden_states(model, ids[:1], torch.tensor([[1, 1, 1, 0]])).shape == (1, 4, 32)


def test_pooling_on_literal_states():
    hidden = torch.tensor(
        [[[1.0, 2], [3, 4], [5, 6], [7, 8]], [[0.0, 0], [2, 2], [4, 6], [6, 10]]]
    )  # (B=2, T=4, H=2)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]])  # right padded, left padded
    torch.testing.assert_close(pool_hidden(hidden, mask, "last"), torch.tensor([[5.0, 6], [6, 10]]))
    torch.testing.assert_close(pool_hidden(hidden, mask, "first"), torch.tensor([[1.0, 2], [2, 2]]))
    # (1 + 3 + 5) / 3 = 3, (2 + 4 + 6) / 3 = 4; (2 + 4 + 6) / 3 = 4, (2 + 6 + 10) / 3 = 6
    torch.testing.assert_close(pool_hidden(hidden, mask, "mean"), torch.tensor([[3.0, 4], [4, 6]]))
    with pytest.raises(ValueError, match="pooling"):
        pool_hidden(hidden, mask, "max")


# -- the input the encoder sees ---------------------------------------------------------------------------
@pytest.mark.parametrize("max_prompt_length", [None, 1])
def test_encoder_sequences_are_cls_prompt_response_sep(wordpiece, tmp_path, max_prompt_length):
    tok = load_backbone_tokenizer(BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece))
    plain = AutoTokenizer.from_pretrained(wordpiece)
    path = _pairs_file(tmp_path / "pairs.jsonl", 4)
    data = PreferenceDataModule(
        train_files=path, format="explicit", val_size=0, max_prompt_length=max_prompt_length, tokenizer=tok
    )
    data.setup("fit")
    for example, row in zip(data.train_dataset.examples, _rows(path)):
        chosen = example["prompt_ids"] + example["chosen_ids"]
        if max_prompt_length == 1:  # the response alone: exactly what plain tokenization gives
            assert chosen == plain(row["chosen"])["input_ids"]
        else:
            words = plain(row["prompt"], add_special_tokens=False)["input_ids"]
            words += plain(row["chosen"], add_special_tokens=False)["input_ids"]
            assert chosen == [plain.cls_token_id] + words + [plain.sep_token_id]


# -- training: full fine-tuning, LoRA, frozen layers -------------------------------------------------------
def _fit(module: RewardModule, path: str, root: Path, max_prompt_length: int | None, steps: int = 3):
    data = PreferenceDataModule(
        train_files=path,
        format="explicit",
        val_size=8,
        max_prompt_length=max_prompt_length,
        batch_size=4,
        val_batch_size=3,  # other batch shapes than training's
        tokenizer=module.tokenizer,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        default_root_dir=str(root),  # where a reliability diagram goes without an export folder
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        val_check_interval=steps,
    )
    trainer.fit(module, datamodule=data)
    return data


@pytest.fixture(scope="module", params=["encoder_full_mean", "encoder_lora_first", "causal_full_last"])
def trained(request, wordpiece, tmp_path_factory) -> SimpleNamespace:
    root = tmp_path_factory.mktemp(request.param)
    kind, training, pooling = request.param.split("_")
    L.seed_everything(0, verbose=False)
    lora = LoraSettings(r=4, alpha=8) if training == "lora" else None
    if kind == "encoder":
        backbone = BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece, lora=lora)
        max_prompt_length = 1 if pooling == "mean" else None  # response only / prompt + response
    else:
        backbone = BackboneConfig(tiny={**TINY_GPT2, "n_positions": 256}, tokenizer="byte", lora=lora)
        max_prompt_length = None
    module = RewardModule(
        backbone, optimizer=OptimizerConfig(lr=1e-3), pooling=pooling, export_dir=str(root / "hf")
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    path = _pairs_file(root / "pairs.jsonl", 24)
    data = _fit(module, path, root, max_prompt_length)
    module.eval()
    return SimpleNamespace(
        module=module,
        before=before,
        data=data,
        rows=_rows(path),
        export=root / "hf",
        kind=kind,
        pooling=pooling,
        max_prompt_length=max_prompt_length,
    )


def test_what_trains(trained):
    module = trained.module
    named = dict(module.named_parameters())
    moved = {n for n, p in named.items() if not torch.equal(p.detach(), trained.before[n])}
    assert "head.linear.weight" in moved
    if trained.module.backbone_cfg.lora is not None:
        lora = {n for n in named if "lora_" in n}
        assert lora and {n for n, p in named.items() if p.requires_grad} == lora | {
            "head.linear.weight",
            "head.linear.bias",
        }
        assert lora & moved and moved <= lora | {"head.linear.weight", "head.linear.bias"}
    else:  # full fine-tuning: the trunk's layers move too
        assert any(".layer.1." in n or ".h.1." in n for n in moved)


def test_the_export_records_architecture_pooling_and_input(trained):
    meta = json.loads((trained.export / "rlhf_lit.json").read_text())
    assert meta["architecture"] == trained.kind and meta["pooling"] == trained.pooling
    assert meta["input_format"]["max_prompt_length"] == trained.max_prompt_length
    assert meta["input_format"]["append_eos"] is True
    config = json.loads((trained.export / "config.json").read_text())
    assert config["architectures"] == (["BertModel"] if trained.kind == "encoder" else ["GPT2LMHeadModel"])


def _plain_ids(tok, prompt: str, response: str, encoder: bool, response_only: bool) -> list[int]:
    """What a user writes with transformers alone, from docs/exports.md: an encoder gets ``[CLS] prompt response
    [SEP]`` (``tok(response)`` when it was trained on responses alone); a causal LM prompt + response + EOS."""
    words = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if encoder and response_only:
        return tok(response)["input_ids"]
    if encoder:
        return [tok.cls_token_id] + words(prompt) + words(response) + [tok.sep_token_id]
    return words(prompt) + words(response) + [tok.eos_token_id]


def _pool_by_hand(hidden: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    if pooling == "mean":
        return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    if pooling == "first":
        return hidden[:, 0]
    return hidden[torch.arange(hidden.shape[0]), mask.sum(1) - 1]


def test_the_export_scores_the_validation_pairs_as_training_did_with_plain_transformers(trained):
    """Acceptance: from the pairs' text, plain transformers + the saved head give the validation pass's scores."""
    module, export = trained.module, str(trained.export)
    step, chosen_scores, rejected_scores = module._last_val_pass[:3]
    assert step == module.global_step  # the validation pass ran on the final weights
    tok = AutoTokenizer.from_pretrained(export)
    encoder = trained.kind == "encoder"
    val = trained.data.val_dataset.examples
    rows = [
        _plain_ids(
            tok,
            trained.rows[e["row"]]["prompt"],
            trained.rows[e["row"]][side],
            encoder,
            trained.max_prompt_length == 1,
        )
        for side in ("chosen", "rejected")
        for e in val
    ]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    head = load_file(str(trained.export / "reward_head.safetensors"))
    with torch.no_grad():
        if encoder:
            hidden = (
                AutoModel.from_pretrained(export).eval()(input_ids=ids, attention_mask=mask).last_hidden_state
            )
        else:
            model = AutoModelForCausalLM.from_pretrained(export).eval()
            hidden = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        by_hand = _pool_by_hand(hidden, mask, trained.pooling) @ head["weight"][0] + head["bias"][0]
        loaded = load_reward_model(export).score(ids, mask, calibrated=False)
    in_training = torch.cat([chosen_scores, rejected_scores])
    torch.testing.assert_close(by_hand, in_training, atol=1e-5, rtol=0)
    torch.testing.assert_close(loaded, in_training, atol=1e-5, rtol=0)
    assert len(set(in_training.round(decimals=4).tolist())) > 2  # the scores differ: the check has teeth


def test_freeze_layers_freezes_the_embeddings_and_the_lower_layers(wordpiece, tmp_path):
    module = RewardModule(
        BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece),
        optimizer=OptimizerConfig(lr=1e-3),
        freeze_layers=1,
    )
    frozen = {n for n, p in module.named_parameters() if not p.requires_grad}
    assert frozen and all(".embeddings." in n or ".encoder.layer.0." in n for n in frozen)
    assert all(
        n in frozen for n, _ in module.named_parameters() if ".embeddings." in n or ".encoder.layer.0." in n
    )
    before = {n: p.detach().clone() for n, p in module.named_parameters()}
    _fit(module, _pairs_file(tmp_path / "pairs.jsonl", 24), tmp_path, None, steps=2)
    moved = {n for n, p in module.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert moved and not moved & frozen and any(".encoder.layer.1." in n for n in moved)


def test_settings_an_encoder_cannot_take_are_refused(wordpiece):
    with pytest.raises(ValueError, match="beta_rm"):
        RewardModule(BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece), beta_rm=0.1)
    with pytest.raises(ValueError, match="freeze_layers"):
        RewardModule(
            BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece, lora=LoraSettings(r=2)), freeze_layers=1
        )
    with pytest.raises(ValueError, match="pooling"):
        RewardModule(BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece), pooling="max")


# -- PPO's path -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("as_chat", [False, True], ids=["text_prompts", "chat_prompts"])
@pytest.mark.parametrize("max_prompt_length", [1, 6, None])
def test_ppo_feeds_an_encoder_reward_model_what_reward_training_built(
    wordpiece, tmp_path, max_prompt_length, as_chat
):
    """A byte-level policy, an encoder reward model exported by the reward stage: the ids PPO scores are the
    ids the reward stage's data module builds for the same (prompt, response), prompt cut as in training. A
    chat prompt (a chat policy's HH prompt, as messages) reaches the encoder as the HH text it was trained on."""
    module = RewardModule(
        BackboneConfig(tiny=TINY_BERT, tokenizer=wordpiece), export_dir=str(tmp_path / "rm")
    )
    data = PreferenceDataModule(
        train_files=_pairs_file(tmp_path / "pairs.jsonl", 4),
        format="explicit",
        val_size=0,
        max_prompt_length=max_prompt_length,
        tokenizer=module.tokenizer,
    )
    data.setup("fit")
    module._trainer = SimpleNamespace(datamodule=data)  # what export() reads the input format from
    module.export(str(tmp_path / "rm"))
    policy_tok = build_byte_tokenizer()
    source = RewardSource(RewardModelConfig(path=str(tmp_path / "rm")), policy_tok)
    assert source.is_encoder and not source.same_tokenizer

    prompts, responses, stopped = PROMPTS[:2], [GOOD[0], GOOD[1]], [True, False]
    enc = [policy_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, enc))
    prompt_ids = torch.tensor([[policy_tok.pad_token_id] * (width - len(e)) + e for e in enc])
    prompt_mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])
    res = [
        policy_tok(r, add_special_tokens=False)["input_ids"] + ([policy_tok.eos_token_id] if s else [])
        for r, s in zip(responses, stopped)
    ]
    R = max(map(len, res))
    response_ids = torch.tensor([r + [policy_tok.pad_token_id] * (R - len(r)) for r in res])
    response_mask = torch.tensor([[True] * len(r) + [False] * (R - len(r)) for r in res])
    seen = {}
    score = source.scorer.score

    def spy(ids, mask, calibrated=True):
        seen["rows"] = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        return score(ids, mask, calibrated)

    source.scorer.score = spy
    records = [parse_hh_messages(p) for p in prompts] if as_chat else prompts
    source.score(prompt_ids, prompt_mask, response_ids, response_mask, torch.tensor(stopped), records)
    trained_on = [e["prompt_ids"] + e["chosen_ids"] for e in data.train_dataset.examples]
    sep = module.tokenizer.sep_token_id
    assert seen["rows"][0] == trained_on[0]  # stopped: exactly the training sequence, [SEP] included
    assert seen["rows"][1] == trained_on[1][:-1] and seen["rows"][1][-1] != sep  # cut: no [SEP]
    assert seen["rows"][0][0] == module.tokenizer.cls_token_id
