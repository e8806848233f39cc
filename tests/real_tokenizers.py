"""Real tokenizers for tests and benchmarks, without the Hugging Face Hub.

llama.cpp keeps vocabulary-only GGUF files of real models for its own tokenizer tests, and the
llama-cpp-python source distribution on PyPI ships them (vendor/llama.cpp/models/). We download
that sdist once (pinned, 76 MB), convert the GGUF vocabularies with transformers (`gguf_file=`, needs the
`gguf` package of the test extra) and keep the result under ~/.cache/sft-tests/ (CACHE), so later runs load
a tokenizer.json in about a second. The conversion matches llama.cpp's own expected token ids
for the Qwen2 vocabulary on all 47 of its test strings (checked when this file was written).

* qwen2: Qwen2/Qwen2.5's 151k byte-level BPE, which merges whitespace ("\\n\\n", "  ", "\\n  ").
* llama3: Llama-3's 128k byte-level BPE with the header special tokens
  (<|start_header_id|>, <|end_header_id|>, <|eot_id|>).

The chat templates below are the models' own (Qwen2.5's verbatim; Llama-3.1's without the
date/tool-prompt options we do not exercise), because templates are where turns meet, plus our own
template with the history rule of Qwen3's (QWEN3_STYLE_TEMPLATE).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenizers import normalizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

SDIST = "llama-cpp-python==0.3.36"
# Outside the clone, like pip's cache: a fresh clone on a machine that ran the tests before does not
# download and convert the sdist again (about a minute).
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sft-tests" / SDIST.replace("==", "-")
GGUF = {"qwen2": "ggml-vocab-qwen2.gguf", "llama3": "ggml-vocab-llama-bpe.gguf"}

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: 26 Jul 2024\\n\\n" }}
{%- if tools is not none %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

# Our own template with the history rule of Qwen3's published one (for the Qwen2/Qwen3 vocabulary):
# an assistant turn after the last user query (a user message that is not a wrapped tool response) is
# rendered with "<think>\n{reasoning}\n</think>\n\n" before its content, an empty block if it has no
# reasoning; earlier assistant turns render their content only. Reasoning is `reasoning_content`, else
# split off inline "<think>...</think>" in content. enable_thinking=false closes an empty think block
# in the generation prompt.
QWEN3_STYLE_TEMPLATE = """{%- set ns = namespace(last_query=-1) -%}
{%- for m in messages -%}
    {%- if m.role == 'user' and not (m.content.startswith('<tool_response>') and m.content.endswith('</tool_response>')) -%}
        {%- set ns.last_query = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
    {{- '# Tools\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools><|im_end|>\n' -}}
{%- elif messages[0].role == 'system' -%}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- for m in messages -%}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) -%}
        {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
    {%- elif m.role == 'assistant' -%}
        {%- set content = m.content or '' -%}
        {%- set reasoning = '' -%}
        {%- if m.reasoning_content is string -%}
            {%- set reasoning = m.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1].lstrip('\n') -%}
        {%- endif -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query -%}
            {{- '<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- for call in m.tool_calls or [] -%}
            {{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- elif m.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}"""

TEMPLATES = {"qwen2": QWEN25_TEMPLATE, "llama3": LLAMA31_TEMPLATE}
END_OF_TURN = {"qwen2": "<|im_end|>", "llama3": "<|eot_id|>"}


def _convert_all() -> None:
    """Download the pinned sdist once and save each GGUF vocabulary as a tokenizer.json under CACHE."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # pip, the ordinary client of the index, so proxies and mirrors configured for pip apply.
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", tmp, SDIST], check=True)
        (sdist,) = Path(tmp).glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                if member.name.rpartition("/")[2] in GGUF.values() and "/vendor/llama.cpp/models/" in member.name:
                    (Path(tmp) / member.name.rpartition("/")[2]).write_bytes(tar.extractfile(member).read())
        for name, gguf_file in GGUF.items():
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=gguf_file)
            if name == "qwen2":  # Qwen2's own tokenizer.json normalises to NFC; the GGUF has no normalizer
                tok.backend_tokenizer.normalizer = normalizers.NFC()
            staging = Path(tempfile.mkdtemp(dir=CACHE))
            tok.save_pretrained(staging)
            shutil.rmtree(CACHE / name, ignore_errors=True)
            os.replace(staging, CACHE / name)  # a half-written tokenizer is never loaded


def real_tokenizer(name: str) -> PreTrainedTokenizerBase:
    """The real `name` vocabulary ("qwen2" or "llama3") with its model's chat template."""
    if not (CACHE / name / "tokenizer.json").is_file():
        _convert_all()
    tok = AutoTokenizer.from_pretrained(CACHE / name)
    tok.chat_template = TEMPLATES[name]
    return tok
