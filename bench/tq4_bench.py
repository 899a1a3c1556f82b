"""TQ4 attention over packed pages (serving_core.kv_pages) against plain paged KV, on CPU.

1. Decode, batches 8 / 32 / 53, one layer of Falcon-H1-7B attention (12 query heads, 2 KV
   heads of 128), 512-token pages, `--context` cached tokens per sequence: TQ4 page-native
   decode (page by page, rotated basis) versus the executor's plain path (gather every page
   of the batch, grouped-query attention over the dense cache), median milliseconds, and the
   KV bytes each reads.
2. Prefill reconstruction: a 512-token chunk after `--prefix` packed tokens, K/V rebuilt for
   1 KV head at a time versus all (2) at once: peak bytes of the rebuilt operands and time.

Numbers only (torch reference implementation on this CPU; no fused kernel).
"""

from __future__ import annotations

import argparse
import math

import torch

from bench.timing import median_ms as _median_ms
from serving_core import kv_pages
from serving_core.kv_codec import TQ4Codec

HQ, HKV, D, BLOCK = 12, 2, 128, 512


def _plain_decode(q, pool, table, lengths):
    """The plain paged path: gather the batch's pages, dense GQA attention, length mask."""
    b = q.shape[0]
    kv = pool[table.reshape(-1)].view(b, -1, 2, HKV, D)
    k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, hkv, T, d)
    k = k.repeat_interleave(HQ // HKV, 1).float()
    v = v.repeat_interleave(HQ // HKV, 1).float()
    mask = torch.arange(k.shape[2])[None, :] < lengths[:, None]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], k, v, attn_mask=mask[:, None, None, :])[:, :, 0]


def decode_row(batch: int, context: int, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    codec = TQ4Codec(D)
    pages = math.ceil(context / BLOCK)
    table = torch.arange(batch * pages).view(batch, pages)
    lengths = torch.full((batch,), context)
    packed = kv_pages.page_view(codec, batch * pages, BLOCK, HKV)
    plain = torch.randn(batch * pages, BLOCK, 2, HKV, D, generator=gen).to(torch.bfloat16)
    for u in range(batch * pages):
        packed[u] = codec.encode_packed(plain[u])
    q = torch.randn(batch, HQ, D, generator=gen)
    tq4 = _median_ms(lambda: kv_pages.decode_attention(q, packed, codec, table, lengths), repeats)
    bf16 = _median_ms(lambda: _plain_decode(q, plain, table, lengths), repeats)
    return {"batch": batch, "context": context, "tq4_ms": tq4, "bf16_ms": bf16,
            "ratio": tq4 / bf16, "tq4_kv_bytes": packed.numel(),
            "bf16_kv_bytes": plain.numel() * plain.element_size()}


def prefill_rows(prefix: int, chunk: int, repeats: int) -> list[dict]:
    gen = torch.Generator().manual_seed(7)
    codec = TQ4Codec(D)
    pages = math.ceil(prefix / BLOCK)
    view = kv_pages.page_view(codec, pages, BLOCK, HKV)
    for u in range(pages):
        view[u] = codec.encode_packed(torch.randn(BLOCK, 2, HKV, D, generator=gen))
    units = torch.arange(pages)
    q = torch.randn(chunk, HQ, D, generator=gen)
    k_new, v_new = torch.randn(chunk, HKV, D, generator=gen), torch.randn(chunk, HKV, D)
    rows = []
    for group in (1, 2, None):
        peak = kv_pages.prefill_attention(q, k_new, v_new, view, codec, units, prefix, group)[1]
        ms = _median_ms(lambda g=group: kv_pages.prefill_attention(
            q, k_new, v_new, view, codec, units, prefix, g), repeats)
        rows.append({"group": "all" if group is None else group, "peak_bytes": peak, "ms": ms})
    return rows


def run(context: int = 2048, prefix: int = 8192, repeats: int = 3) -> dict:
    """Print both tables; return their rows (bench/results/kernels.json's "tq4")."""
    print(f"TQ4 decode vs plain paged decode, one layer, {HQ} q / {HKV} kv heads x {D}, "
          f"{BLOCK}-token pages, context {context}, {torch.get_num_threads()} threads")
    print(f"{'batch':>5} {'tq4 ms':>8} {'bf16 ms':>8} {'ratio':>6} {'tq4 KV B':>12} "
          f"{'bf16 KV B':>12}")
    decode = []
    for batch in (8, 32, 53):
        r = decode_row(batch, context, repeats)
        decode.append(r)
        print(f"{r['batch']:>5} {r['tq4_ms']:>8.2f} {r['bf16_ms']:>8.2f} {r['ratio']:>6.2f} "
              f"{r['tq4_kv_bytes']:>12,} {r['bf16_kv_bytes']:>12,}")
    print(f"prefill reconstruction: chunk 512 after {prefix} packed tokens "
          "(peak = the group's float32 K/V operands + one page's decoded temporary)")
    print(f"{'group':>5} {'peak temp B':>12} {'ms':>8}")
    prefill = prefill_rows(prefix, 512, max(1, repeats // 2))
    for r in prefill:
        print(f"{r['group']:>5} {r['peak_bytes']:>12,} {r['ms']:>8.1f}")
    return {"context": context, "prefix": prefix, "decode": decode, "prefill": prefill}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tq4_bench", description=__doc__)
    parser.add_argument("--context", type=int, default=2048, help="cached tokens per sequence")
    parser.add_argument("--prefix", type=int, default=8192, help="packed prefix of the prefill")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    run(args.context, args.prefix, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
