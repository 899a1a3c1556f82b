"""The tiny checkpoint's Hugging Face tokenizer (serving_core/model/hf_tokenizer.py) gives
the llama3 encoding's ids, special tokens and chat template, and transformers loads it."""

from __future__ import annotations

import quicktok

from serving_core.server.chat import render_chat

TEXTS = [
    "Hello, world! It's 2024.\n\n  ok",
    "def f(x):\n    return [i**2 for i in range(100)]  # 1+2+3==6",
    "héllo € 東京 مرحبا 😀 12345678 'LL 'll\r\n\t tabs",
    "<|eot_id|>x<|start_header_id|>user<|end_header_id|>",
]


def test_checkpoint_tokenizer_matches_quicktok(tiny_checkpoint):
    from transformers import AutoTokenizer

    enc = quicktok.get_encoding("llama3")
    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == enc.encode_with_special(text)
        assert tok.encode(text) == [128000, *enc.encode_with_special(text)]  # BOS added
    assert tok.eos_token == "<|eot_id|>" and tok.eos_token_id == 128009
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        render_chat(messages)
    ids = enc.encode("a € b")
    assert tok.decode(ids) == enc.decode(ids)
