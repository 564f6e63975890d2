"""A tokenizer for the tiny local models, trained here with the ``tokenizers`` library: nothing
is downloaded.

:func:`write_tokenizer` trains a byte-level BPE on :func:`corpus` (sentences drawn by a seeded
``random.Random`` from a fixed word list: the same lines, so the same ``tokenizer.json``, on
every build) to exactly ``vocab_size`` tokens, and writes the Hugging Face files into a model
directory:

* ``tokenizer.json``: the BPE; ids 0-5 are the special tokens ``<pad>`` ``<s>`` ``</s>``
  (the model config's pad, bos and eos ids) and the chat roles ``<|system|>`` ``<|user|>``
  ``<|assistant|>``; a post-processor puts ``<s>`` before a text encoded with special tokens
  (as Llama's does);
* ``tokenizer_config.json``: ``PreTrainedTokenizerFast`` with those special tokens and
  :data:`CHAT_TEMPLATE` (Jinja, as Hugging Face stores it), so ``vllm serve DIR`` renders chat
  messages and ``transformers.AutoTokenizer.from_pretrained(DIR)`` loads it;
* ``special_tokens_map.json``.

Every id below ``vocab_size`` decodes to something (byte-level: all 256 bytes are in the
alphabet), so whatever a random-weight model generates can be detokenized.

:data:`TOKENIZER_VERSION` and the corpus are part of the checkpoint's key
(:meth:`~kvstore.cluster.vllm_instance.TinyLlama.key`): changing either makes new files, so a
new directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
from pathlib import Path

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "TOKENIZER_VERSION", "corpus", "corpus_digest",
           "write_tokenizer"]

TOKENIZER_VERSION = 1
"""Bump when the trainer's settings or the files written change (the corpus is hashed)."""

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
ROLES = ("system", "user", "assistant")
SPECIAL_TOKENS = (PAD, BOS, EOS, *(f"<|{role}|>" for role in ROLES))
"""In id order: 0 pad, 1 bos, 2 eos (the ids :func:`~kvstore.cluster.vllm_instance._build_model`
puts in the model config), then the three role markers."""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
"""``<s><|user|>\\nHello</s>\\n<|assistant|>\\n``: one line of Jinja, so Hugging Face's
``trim_blocks``/``lstrip_blocks`` change nothing; a role outside :data:`ROLES` raises."""

_WORDS = """
the of and to in is that for it as with was on be by at this are from or an have not which one
but all were they we there been has more when will would who so no if out about them can some
into other than then its only time two may these could first new also any after over most such
what your how much many where why yes hello please thank you write tell me story short long
answer question good great small large fast slow every day night world people word sentence
text chat cache prefix block token model request tier memory store daemon engine node client
conductor serve server route router door front back load save read disk network copy move keep
hit miss hash key value queue batch stream output input prompt reply user system assistant name
help know think make take give find use work call try ask need feel become leave put mean let
begin seem show hear play run live believe hold bring happen stand lose pay meet include
continue set learn change lead watch follow stop create speak spend grow open walk win offer
remember love consider appear buy wait die send expect build stay fall cut reach kill remain
suggest raise pass sell require report decide pull
""".split()  # noqa: SIM905 (a paragraph reads better than 240 quoted words)


def corpus(lines: int = 4000, seed: int = 0) -> list[str]:
    """The training text: ``lines`` sentences of 4-15 words (one in ten a number below 1000)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) if rng.random() < 0.9 else str(rng.randrange(1000))
                 for _ in range(rng.randrange(4, 16))]
        out.append(" ".join(words).capitalize() + rng.choice(".?!,:"))
    return out


@functools.cache
def corpus_digest() -> str:
    """A digest of the corpus and :data:`TOKENIZER_VERSION` (part of the checkpoint key)."""
    blob = json.dumps({"version": TOKENIZER_VERSION, "corpus": corpus()}).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def write_tokenizer(out: Path, vocab_size: int, model_max_length: int) -> None:
    """Train the BPE to exactly ``vocab_size`` tokens and write the files into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE reached {tokenizer.get_vocab_size()} tokens, not "
                           f"{vocab_size}: the corpus is too small for this vocabulary")
    for i, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != i:
            raise RuntimeError(f"special token {token!r} is not id {i}")
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    specials = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "additional_special_tokens": list(SPECIAL_TOKENS[3:]),
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(
        {**specials, "additional_special_tokens": list(SPECIAL_TOKENS[3:])}, indent=2) + "\n")
