"""The tokenizer of a model's files: loaded as transformers does, checked for what training needs
(a chat template, a pad token, ids the model embeds)."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sft.config import ModelConfig
from sft.models.architecture import text_config
from sft.models.build import ModelError, missing_local_dir, model_config


def load_tokenizer(cfg: ModelConfig) -> PreTrainedTokenizerBase:
    key, source = ("model.tokenizer", cfg.tokenizer) if cfg.tokenizer else ("model.name_or_path", cfg.name_or_path)
    missing = missing_local_dir(key, source)
    if missing:
        raise missing
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=cfg.trust_remote_code)
    except Exception as e:
        raise ModelError(f"{key}={source!r}: could not load a tokenizer: {e}") from None
    if not tokenizer.chat_template:
        raise ModelError(f"{key}={source!r} has no chat template; use an instruct model's "
                         "tokenizer or add chat_template to its tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        # Pads are never attended to by real tokens nor trained, so any id will do.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_vocabulary(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase) -> None:
    """Training: a tokenizer other than the model's own must not give ids beyond the model's
    embeddings (only its config.json is read: before the data, which it would tokenise for nothing).
    `python -m sft.data` shows data with any tokenizer."""
    if cfg.tokenizer:
        vocab = text_config(model_config(cfg)).vocab_size
        if len(tokenizer) > vocab:
            raise ModelError(f"model.tokenizer={cfg.tokenizer!r} has {len(tokenizer)} tokens, but "
                             f"model.name_or_path={cfg.name_or_path!r} embeds {vocab}: use the model's own "
                             "tokenizer (remove model.tokenizer) or one of its vocabulary")
