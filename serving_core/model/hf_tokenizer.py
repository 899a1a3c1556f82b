"""The llama3 encoding (quicktok) as a Hugging Face tokenizer folder, offline.

Clients that tokenize on their side (vLLM's `vllm bench serve`, guidellm) and vLLM's server
serving text need the checkpoint's tokenizer files; the tiny checkpoint has random weights
over Llama-3's 128,256-token vocabulary, so its tokenizer is Llama-3's, rebuilt here from
quicktok's bundled ranks (no download): byte-level BPE whose merges are read off the ranks
(every split of a token into two tokens, ordered by the token's rank, then the pieces':
how Hugging Face's TikTokenConverter reads a tiktoken file), Llama-3's pre-tokenizer
pattern, its 256 special tokens, a BOS post-processor, `<|eot_id|>` as eos_token (the
chat template ends each turn with it) and the chat template of serving_core/server/chat.py.
tests/test_hf_tokenizer.py checks that both give the same ids on ordinary text. They can
differ on rare text: quicktok's llama3 encodes " лабораторcaret" as 4 tokens where
tiktoken (Llama-3's own BPE) and this tokenizer give 7.
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in of every byte (Hugging Face's ByteLevel alphabet)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def _ranks(enc) -> dict[bytes, int]:
    n = enc.n_vocab - len(enc.special_tokens_set)
    return {enc.decode_single_token_bytes(i): i for i in range(n)}


def _merges(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    merges = []
    get = ranks.get
    for token, rank in ranks.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            a, b = get(left), get(right)
            if a is not None and b is not None:
                merges.append((rank, a, b, left, right))
    merges.sort()
    return [(left, right) for _, _, _, left, right in merges]


def build_tokenizer(enc):
    """A `tokenizers.Tokenizer` equal to quicktok encoding `enc` (llama3)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.processors import TemplateProcessing

    # byte x -> chr(x) (latin-1) -> its ByteLevel stand-in, in C (a Python join per token
    # was most of the tiny checkpoint's build)
    show = str.maketrans({chr(x): c for x, c in _byte_to_unicode().items()})

    def text(b: bytes) -> str:
        return b.decode("latin-1").translate(show)

    ranks = _ranks(enc)
    vocab = {text(b): i for b, i in ranks.items()}
    merges = [(text(a), text(b)) for a, b in _merges(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                               byte_fallback=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = sorted((int(enc.encode_single_token(s)), s) for s in enc.special_tokens_set)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for _, s in specials])
    got = {s: tok.token_to_id(s) for _, s in specials}
    assert all(got[s] == i for i, s in specials), "special token ids moved"
    bos = "<|begin_of_text|>"
    tok.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                            special_tokens=[(bos, got[bos])])
    return tok


def write_tokenizer(out: str | Path, encoding: str = "llama3") -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `out`."""
    import quicktok

    from serving_core.server.chat import LLAMA3_CHAT_TEMPLATE

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(quicktok.get_encoding(encoding)).save(str(out / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 131072,
              "clean_up_tokenization_spaces": True, "chat_template": LLAMA3_CHAT_TEMPLATE,
              **special}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=1))
    return out
