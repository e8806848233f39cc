"""sft: full-parameter supervised fine-tuning of Hugging Face causal LMs with FSDP2."""

import logging

# transformers imports torchao whenever it is installed (float8 on or off), and torchao 0.18 then
# logs, on every rank of every launch, that two C extensions we never use (MXFP8, CUTLASS sm90a
# kernels) do not load under this torch, and torch warns about its pytree registrations. Both are
# harmless; only these exact messages are dropped, everything else those loggers say still shows.
_KNOWN_HARMLESS = {
    "torchao": ("Failed to load ", ("_C_mxfp8", "_C_cutlass_90a")),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported by torch.compile", ("",)),
}


def _harmless(record: logging.LogRecord, text: str, names: tuple[str, ...]) -> bool:
    message = record.getMessage()
    return text in message and any(name in message for name in names)


for _logger, (_text, _names) in _KNOWN_HARMLESS.items():
    logging.getLogger(_logger).addFilter(lambda record, text=_text, names=_names: not _harmless(record, text, names))
