"""The front door's tokenization against Hugging Face's (pure logic, no vLLM): the tokenizer
trained here (kvstore/cluster/tiny_tokenizer.py) loaded by ``transformers.AutoTokenizer`` and by
:class:`~kvstore.frontdoor.PromptTokenizer` gives the same ids for text and for chat messages
rendered with the chat template; the build is deterministic; every id decodes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from kvstore.cluster.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, write_tokenizer
from kvstore.errors import ConfigError, InvalidArgument
from kvstore.frontdoor import PromptTokenizer

VOCAB = 1024

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."},
     {"role": "user", "content": "Tell me a story about the key value cache in 2027."}],
    [{"role": "user", "content": "What is a prefix?"},
     {"role": "assistant", "content": "A block of tokens."},
     {"role": "user", "content": "ünïcödé, émoji 🚀 and\nnewlines\ttabs"}],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out, VOCAB, 2048)
    return out


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


def test_two_builds_write_the_same_files(model_dir: Path, tmp_path: Path) -> None:
    write_tokenizer(tmp_path, VOCAB, 2048)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert hashlib.sha256((tmp_path / name).read_bytes()).hexdigest() == \
            hashlib.sha256((model_dir / name).read_bytes()).hexdigest(), name


def test_vocabulary_special_tokens_and_template(model_dir: Path, hf: Any) -> None:
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    assert (config["bos_token"], config["eos_token"], config["pad_token"]) == \
        ("<s>", "</s>", "<pad>")
    assert len(hf) == VOCAB
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    assert [hf.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(6))
    # a random-weight model may generate any id below vocab_size: each one decodes
    for i in range(VOCAB):
        assert isinstance(hf.decode([i]), str)


@pytest.mark.parametrize("text", ["Hello, world.", " leading space", "", "1234 56",
                                  "ünïcödé 🚀", "<s> literal specials <|user|>"])
def test_text_ids_equal_hugging_face(model_dir: Path, hf: Any, text: str) -> None:
    ours = PromptTokenizer.from_model_dir(model_dir)
    assert ours.completion_ids({"prompt": text}) == hf(text).input_ids
    assert ours.completion_ids({"prompt": text, "add_special_tokens": False}) == \
        hf(text, add_special_tokens=False).input_ids
    assert ours.completion_ids({"prompt": text})[0] == 1  # <s>, as Llama's


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_hugging_face_apply_chat_template(
        model_dir: Path, hf: Any, conversation: list[dict[str, Any]],
        add_generation_prompt: bool) -> None:
    ours = PromptTokenizer.from_model_dir(model_dir)
    text = hf.apply_chat_template(conversation, tokenize=False,
                                  add_generation_prompt=add_generation_prompt)
    assert ours.render_chat(conversation, add_generation_prompt=add_generation_prompt) == text
    assert ours.chat_ids({"messages": conversation,
                          "add_generation_prompt": add_generation_prompt}) == \
        hf(text, add_special_tokens=False).input_ids


def test_chat_rendering_exactly(model_dir: Path) -> None:
    ours = PromptTokenizer.from_model_dir(model_dir)
    assert ours.render_chat([{"role": "system", "content": "S"},
                             {"role": "user", "content": "U"}]) == \
        "<s><|system|>\nS</s>\n<|user|>\nU</s>\n<|assistant|>\n"
    ids = ours.chat_ids({"messages": [{"role": "user", "content": "Hi"}]})
    assert ids[:3] == [1, 4, ours.encode("\n", add_special_tokens=False)[0]]
    assert ids[-2:] == [5, ours.encode("\n", add_special_tokens=False)[0]]


def test_text_parts_are_joined_with_newlines(model_dir: Path) -> None:
    ours = PromptTokenizer.from_model_dir(model_dir)
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}]}]
    assert ours.render_chat(parts) == ours.render_chat([{"role": "user", "content": "a\nb"}])


def test_token_id_prompts_pass_unchanged(model_dir: Path) -> None:
    ours = PromptTokenizer.from_model_dir(model_dir)
    assert ours.completion_ids({"prompt": [5, 7, 1023]}) == [5, 7, 1023]
    assert ours.completion_ids({"prompt": [[5, 7]]}) == [5, 7]
    assert ours.completion_ids({"prompt": ["hi"]}) == ours.completion_ids({"prompt": "hi"})


@pytest.mark.parametrize(("body", "message"), [
    ({}, "prompt must be"),
    ({"prompt": []}, "prompt must be"),
    ({"prompt": 5}, "prompt must be"),
    ({"prompt": [1, "a"]}, "prompt must be"),
    ({"prompt": [1, VOCAB]}, "out of range"),
    ({"prompt": [True, 2]}, "prompt must be"),
    ({"prompt": ["a", "b"]}, "one prompt per request"),
    ({"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
])
def test_bad_completion_prompts(model_dir: Path, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        PromptTokenizer.from_model_dir(model_dir).completion_ids(body)


@pytest.mark.parametrize(("body", "message"), [
    ({}, "messages must be"),
    ({"messages": []}, "messages must be"),
    ({"messages": "hi"}, "messages must be"),
    ({"messages": [{"content": "x"}]}, "string role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content must be"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "text content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "unknown role tool"),
    ({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 1},
     "add_generation_prompt"),
])
def test_bad_chat_messages(model_dir: Path, body: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        PromptTokenizer.from_model_dir(model_dir).chat_ids(body)


def test_a_directory_without_a_tokenizer_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        PromptTokenizer.from_model_dir(tmp_path)
