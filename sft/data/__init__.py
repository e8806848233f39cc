"""Chat data: load rows with `datasets`, normalise the three formats, tokenise with labels, batch.

Formats (detected from the columns):
* OpenAI `messages`: [{role, content, tool_calls?}], roles system/user/assistant/tool, optional
  `tools` column (list of JSON schemas, or a JSON string of one).
* ShareGPT `conversations`: [{from, value}] with from in system/human/gpt/tool (and the aliases
  below).
* `prompt` / `completion`: strings (one user turn, one assistant turn), or lists of messages.
* `input_ids` / `labels`: already tokenised (labels unshifted, -100 = not trained), used as is
  (benchmarks, or data prepared elsewhere).

A conversation becomes one training row, or several when its chat template rewrites history
(masking.py); the rows keep their conversation's file row, and shuffling, `max_samples` and the
eval split act on conversations before tokenisation, so a conversation's rows stay on one side.

Tokenisation runs through `datasets.map`, so it is cached on disk and a rerun starts at once.
Rank 0 loads and tokenises first (so bad data is one error, reported once); the other ranks then
read its cache.
The floor above the inputs: `sources` reads the rows of a file or hub dataset, `rows` turns a
conversation into training rows (through `masking`, the chat template's own rendering), `prepare`
tokenises a split with `datasets.map` and reports what it kept, dropped and cut, `batches` samples
and collates each step's micro-batches (`collate`). `python -m sft.data` shows what is trained.
"""
