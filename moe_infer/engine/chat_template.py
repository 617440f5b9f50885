"""Chat messages to prompt text through a tokenizer's chat template, for `LLM.chat` and the server's
/v1/chat/completions alike (the server imports the engine, never the reverse).

A message is {"role": str, "content": str} (optionally "name"); content may also be OpenAI's list of text
parts [{"type": "text", "text": str}, ...] (joined) or None for an empty turn. The template writes the
special tokens it wants, so its text is tokenized with add_special_tokens=False (as vLLM's chat does).
Every problem raises ChatTemplateError, a ValueError that says which message and what is wrong.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

_KEYS = ("role", "content", "name")


class ChatTemplateError(ValueError):
    pass


def _content(i: int, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, (list, tuple)):
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ChatTemplateError(f"messages[{i}].content: only text parts ({{'type': 'text', 'text': str}}) "
                                        f"are supported, got {part!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts, "
                            f"got {type(content).__name__}")


def check_messages(messages: Sequence[Any]) -> List[Dict[str, str]]:
    """One conversation as plain {"role", "content"[, "name"]} dicts of strings."""
    if isinstance(messages, (str, dict)) or not isinstance(messages, (list, tuple)):
        raise ChatTemplateError(f"a conversation is a list of {{'role': ..., 'content': ...}} messages, "
                                f"got {type(messages).__name__}")
    if not messages:
        raise ChatTemplateError("the conversation has no messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        unknown = sorted(str(k) for k in m if k not in _KEYS)
        if unknown:
            raise ChatTemplateError(f"messages[{i}] has unknown keys {unknown} (a message has {', '.join(_KEYS)})")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ChatTemplateError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "content" not in m:
            raise ChatTemplateError(f"messages[{i}] has no 'content'")
        msg = {"role": role, "content": _content(i, m["content"])}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise ChatTemplateError(f"messages[{i}].name must be a string, got {m['name']!r}")
            msg["name"] = m["name"]
        out.append(msg)
    return out


def render_chat(tokenizer, messages: Sequence[Any], chat_template: Optional[str] = None,
                add_generation_prompt: bool = True, **template_kwargs) -> str:
    """The prompt text of one conversation: the tokenizer's chat template, or `chat_template` (a Jinja string)."""
    conversation = check_messages(messages)
    if tokenizer is None:
        raise ChatTemplateError("chat needs a tokenizer, and this checkpoint has none")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError("this model's tokenizer has no chat template: pass chat_template= (a Jinja "
                                "template), or send a plain prompt (LLM.generate, /v1/completions)")
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=chat_template, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **template_kwargs)
    except Exception as err:  # the template rejected the conversation (its role order, a raise_exception call)
        raise ChatTemplateError(f"the chat template failed on these messages: {err}") from None
    if not isinstance(text, str):
        raise ChatTemplateError(f"the chat template returned {type(text).__name__}, not text")
    return text
