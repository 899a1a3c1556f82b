"""The Llama-3 chat template over the llama3 tokenizer (POST /v1/chat/completions).

`LLAMA3_CHAT_TEMPLATE` is Llama-3's Jinja template as its tokenizer_config.json carries it
(BOS, then per message `<|start_header_id|>ROLE<|end_header_id|>\\n\\n` + trimmed content +
`<|eot_id|>`, then the assistant header when a generation prompt is asked for);
`render_chat` is that template in Python (Jinja's `trim` is str.strip), and the server
tokenizes its text with special tokens parsed and no BOS added, as vLLM does for chat.
`continue_final_message` leaves the last message open (no `<|eot_id|>`, no new header).
The same template is written next to the tiny checkpoint's tokenizer
(serving_core/model/hf_tokenizer.py), so vLLM renders the same prompt.
"""

from __future__ import annotations

from serving_core.server.protocol import BadRequest

LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
EOT = "<|eot_id|>"
BOS = "<|begin_of_text|>"
ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(message, i: int) -> tuple[str, str]:
    """(role, content text) of one message; content is a string, null or a list of text
    parts ({"type": "text", "text": ...})."""
    if not isinstance(message, dict):
        raise BadRequest(f"messages[{i}]: expected an object with role and content",
                         "messages")
    role = message.get("role")
    if role not in ROLES:
        raise BadRequest(f"messages[{i}].role={role!r}: allowed values are {list(ROLES)}",
                         "messages")
    content = message.get("content")
    if content is None:
        return role, ""
    if isinstance(content, str):
        return role, content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"messages[{i}].content[{j}]: only text parts "
                                 '({"type": "text", "text": ...}) are supported', "messages")
            texts.append(part["text"])
        return role, "\n".join(texts)
    raise BadRequest(f"messages[{i}].content: expected a string or a list of text parts",
                     "messages")


def render_chat(messages, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False) -> str:
    """The prompt text of `messages` under LLAMA3_CHAT_TEMPLATE."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of messages", "messages")
    if continue_final_message and add_generation_prompt:
        raise BadRequest("continue_final_message=true needs add_generation_prompt=false "
                         "(allowed: one of them)", "continue_final_message")
    parts = [BOS]
    last = len(messages) - 1
    for i, message in enumerate(messages):
        role, content = message_text(message, i)
        text = f"<|start_header_id|>{role}<|end_header_id|>\n\n{content.strip()}"
        if not (continue_final_message and i == last):
            text += EOT
        parts.append(text)
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
