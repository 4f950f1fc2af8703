"""A BERT-style WordPiece tokenizer trained in milliseconds, for tiny encoder reward models in tests."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast


def wordpiece_folder(folder: Path, corpus: list[str], vocab_size: int = 300) -> str:
    """Train a lower-cased WordPiece vocabulary on ``corpus`` and save it as a plain transformers folder with
    [PAD] [UNK] [CLS] [SEP] [MASK] (ids 0-4), BERT's ``[CLS] text [SEP]`` template and no BOS / EOS, as BERT
    and all-MiniLM-L6-v2 ship. Returns the folder."""
    from tokenizers import BertWordPieceTokenizer, processors

    core = BertWordPieceTokenizer(lowercase=True)
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    core.train_from_iterator(corpus, vocab_size=vocab_size, special_tokens=specials)
    core._tokenizer.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core._tokenizer,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=128,
    )
    tok.save_pretrained(folder)
    return str(folder)
