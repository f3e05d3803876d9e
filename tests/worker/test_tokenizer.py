"""Our GGUF-built tokenizer and chat template against transformers' GGUF tokenizer.

Two documented differences in how we call the reference: transformers' GGUF conversion adds
<|im_start|> as a BOS on encode (we add no special tokens: the chat template carries them), and it
turns on clean_up_tokenization_spaces, which rewrites " ." to "." and the like (we return the text
the tokens stand for, as SmolLM2's own tokenizer_config does).
"""

from __future__ import annotations

import pytest
import tokenizers

from services.worker.model.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\nprint(fib(10))",
    "  leading and   internal    runs of spaces\t\ttabs\n\n\nnewlines   ",
    "Emoji: 🚀🔥👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "中文测试：你好，世界！日本語のテキスト、한국어 텍스트",
    "Accents: café, naïve, Ångström, Straße, São Paulo, Ελληνικά, Русский",
    "Mixed <|im_start|>user\nhi<|im_end|>\n and <file_sep> specials",
    "",
    "a" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 🐍 and 中文."}],
    [{"role": "system", "content": "  spaces  "}, {"role": "user", "content": "line1\nline2\n"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "{{ not a template }}"}],
]


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer) -> Tokenizer:
    return smollm2_tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(tok, hf_smollm2_tokenizer, text):
    ids = tok.encode(text)
    assert ids == hf_smollm2_tokenizer.encode(text, add_special_tokens=False)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_smollm2_tokenizer.decode(
            ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_every_token_decodes_as_transformers_and_token_bytes(tok, hf_smollm2_tokenizer):
    ids = [[i] for i in range(tok.vocab_size)]
    reference = hf_smollm2_tokenizer.batch_decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    assert [tok.token_text(i) for i in range(tok.vocab_size)] == reference
    assert b"".join(tok.token_bytes(i) for i in tok.encode("né 🚀")) == "né 🚀".encode()


def test_special_tokens(tok):
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.eos_token_ids == [2]
    assert [i for i in range(tok.vocab_size) if tok.is_special(i)] == list(range(17))
    assert tok.encode("<|im_end|>") == [2]
    assert tok.decode([1, 2, 28120], skip_special_tokens=True) == tok.decode([28120])
    # Ids beyond the vocabulary (random:<shape> models have bigger ones) stand for nothing.
    assert tok.token_bytes(tok.vocab_size + 10) == b""
    assert tok.decode([28120, tok.vocab_size + 10, 28120]) == tok.decode([28120, 28120])


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok, hf_smollm2_tokenizer, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    reference = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=add_generation_prompt)
    assert ours == reference
    assert ours.endswith("<|im_start|>assistant\n") == add_generation_prompt


def test_chat_template_rejects_bad_messages(tok):
    with pytest.raises(ValueError, match="chat template rejected"):
        tok.apply_chat_template([{"role": "user"}])  # no content
    with pytest.raises(ValueError, match="chat template rejected the messages: TypeError"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_chat_template_raise_exception_and_tojson(smollm2_tokenizer):
    backend = tokenizers.Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
    template = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be the user') }}"
                "{% endif %}{% for m in messages %}{{ m | tojson }}\n{% endfor %}{{ bos_token }}")
    tok = Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '{"role": "user", "content": "é"}\n<|im_start|>'
    with pytest.raises(ValueError, match="first message must be the user"):
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_missing_chat_template_and_unsupported_tokenizer(smollm2_tokenizer):
    backend = tokenizers.Tokenizer.from_str(smollm2_tokenizer.backend.to_str())
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None).apply_chat_template([])
    with pytest.raises(ValueError, match="invalid chat template"):
        Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template="{% for %}")
    backend.decoder = tokenizers.decoders.Metaspace()
    with pytest.raises(ValueError, match="byte-level"):
        Tokenizer(backend, bos_token_id=1, eos_token_ids=[2], chat_template=None)
