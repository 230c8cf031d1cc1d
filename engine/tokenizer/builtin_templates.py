"""Chat templates for model families whose GGUF carries none, keyed by
`general.architecture`.

Each follows the family's published format (the same strings llama.cpp's built-in
templates produce), written with whitespace control so that jinja's trim options do not
matter. Messages reach a template already validated: `role` and `content` are strings.
Templates that start with `bos_token` expect the prompt to be tokenized without adding
another BOS.
"""

from __future__ import annotations

# Gemma (2, 3): no system turn; the system text becomes a prefix of the first turn,
# separated by a blank line, as Gemma 3's own template does. "assistant" is "model".
# Unlike Gemma's template this one does not insist on strictly alternating roles.
GEMMA = r"""{{- bos_token -}}
{%- if messages[0].role == 'system' and messages | length > 1 -%}
    {%- set first_prefix = messages[0].content + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_prefix = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- set role = 'model' if message.role == 'assistant' else message.role -%}
    {{- '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') -}}
    {{- message.content | trim -}}
    {{- '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}"""

# Llama 3.x header format (Meta's Llama 3 template).
LLAMA3 = r"""{{- bos_token -}}
{%- for message in messages -%}
    {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' -}}
    {{- message.content | trim -}}
    {{- '<|eot_id|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{%- endif -%}"""

# ChatML (Qwen 2/2.5/3 and the fallback for families without a known format).
CHATML = r"""{%- for message in messages -%}
    {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}"""

BUILTIN_TEMPLATES: dict[str, str] = {
    "gemma": GEMMA,
    "gemma2": GEMMA,
    "gemma3": GEMMA,
    "llama": LLAMA3,
    "qwen2": CHATML,
    "qwen3": CHATML,
    "qwen3moe": CHATML,
}


def builtin_template(architecture: str) -> str:
    """The built-in template of a family; ChatML for families without one."""
    return BUILTIN_TEMPLATES.get(architecture, CHATML)
