"""The front door's tokenizer: a request's prompt as the token ids vLLM will compute for it.

:class:`PromptTokenizer` reads the model directory vLLM serves (``tokenizer.json`` with the
``tokenizers`` library, ``tokenizer_config.json`` for the special tokens and the Jinja
``chat_template``), so the router sees the same ids as the engine without importing vLLM or
transformers:

* a completion's text prompt: encoded with the tokenizer's post-processor
  (``add_special_tokens``, true unless the request says otherwise, as vLLM's ``/v1/completions``);
* a completion's token-id prompt: taken as it is;
* chat messages: rendered with the chat template the way Hugging Face's ``apply_chat_template``
  renders it (a sandboxed Jinja environment with ``trim_blocks``, ``lstrip_blocks`` and
  ``loopcontrols``; the special tokens and ``add_generation_prompt`` as variables), then
  encoded without special tokens (vLLM's default for chat: the template writes them).
  A message's content is a string or a list of ``{"type": "text", "text": ...}`` parts, joined
  with newlines (what vLLM does for a template that reads ``content`` as a string).

Malformed input raises :class:`~kvstore.errors.InvalidArgument` with a message for the client.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import ConfigError, InvalidArgument

__all__ = ["PromptTokenizer"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token",
                 "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token in tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True)
class _Template:
    source: str
    compiled: Any


class PromptTokenizer:
    """See the module docstring. :meth:`from_model_dir` loads one; side-effect free."""

    def __init__(self, tokenizer: Any, config: dict[str, Any]) -> None:
        self._tokenizer = tokenizer
        self._config = config
        self.special_tokens: dict[str, str] = {}
        for key in _SPECIAL_KEYS:
            text = _token_text(config.get(key))
            if text is not None:
                self.special_tokens[key] = text
        source = config.get("chat_template")
        self._template: _Template | None = None
        if isinstance(source, str):
            self._template = _Template(source, _compile(source))

    @classmethod
    def from_model_dir(cls, model_dir: Path) -> PromptTokenizer:
        """ConfigError when the directory has no ``tokenizer.json`` or an unreadable config."""
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no tokenizer.json (the front door tokenizes "
                              f"prompts with the model directory's tokenizer)")
        config_path = Path(model_dir) / "tokenizer_config.json"
        try:
            config = json.loads(config_path.read_text()) if config_path.is_file() else {}
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # OSError, JSON errors; tokenizers raises plain Exception
            raise ConfigError(f"{model_dir}: cannot load the tokenizer: {exc}") from exc
        if not isinstance(config, dict):
            raise ConfigError(f"{config_path}: not a JSON object")
        return cls(tokenizer, config)

    @property
    def vocab_size(self) -> int:
        return int(self._tokenizer.get_vocab_size())

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def completion_ids(self, body: dict[str, Any]) -> list[int]:
        """The token ids of a ``/v1/completions`` request's one prompt."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and \
                isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise InvalidArgument("add_special_tokens must be a boolean")
        if isinstance(prompt, str):
            return self.encode(prompt, add_special_tokens=add_special)
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument(f"prompt token ids out of range [0, {self.vocab_size}): "
                                      f"{bad[:5]}")
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) > 1 and \
                all(isinstance(p, str | list) for p in prompt):
            raise InvalidArgument("the front door routes one prompt per request; send a "
                                  "batch as separate requests")
        raise InvalidArgument("prompt must be a string or a non-empty list of token ids")

    def render_chat(self, messages: Any, *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> str:
        """The chat template applied to ``messages`` (the text vLLM then tokenizes)."""
        if self._template is None:
            raise InvalidArgument("this model's tokenizer has no chat template")
        conversation = _messages(messages)
        from jinja2 import TemplateError

        try:
            text = str(self._template.compiled.render(
                messages=conversation, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=None, documents=None,
                **self.special_tokens))
        except TemplateError as exc:
            raise InvalidArgument(f"the chat template rejected the messages: {exc}") from exc
        if continue_final_message:
            final = conversation[-1]["content"]
            if isinstance(final, str) and final.strip() and final in text:
                text = text[: text.rindex(final) + len(final)]
        return text

    def chat_ids(self, body: dict[str, Any]) -> list[int]:
        """The token ids of a ``/v1/chat/completions`` request's rendered messages."""
        flags = {}
        for name, default in (("add_generation_prompt", True), ("continue_final_message", False),
                              ("add_special_tokens", False)):
            value = body.get(name, default)
            if not isinstance(value, bool):
                raise InvalidArgument(f"{name} must be a boolean")
            flags[name] = value
        text = self.render_chat(body.get("messages"),
                                add_generation_prompt=flags["add_generation_prompt"],
                                continue_final_message=flags["continue_final_message"])
        return self.encode(text, add_special_tokens=flags["add_special_tokens"])


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("messages must be a non-empty list")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise InvalidArgument(f"messages[{i}] must be an object with a string role")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or \
                        not isinstance(part.get("text"), str):
                    raise InvalidArgument(f"messages[{i}]: only text content parts are "
                                          f"supported")
                parts.append(part["text"])
            content = "\n".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidArgument(f"messages[{i}].content must be a string or text parts")
        out.append({**message, "content": content})
    return out


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _compile(source: str) -> Any:
    """Hugging Face's chat-template environment (transformers' ``_compile_jinja_template``)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)

