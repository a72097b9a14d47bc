"""Attention over a packed sequence of images of mixed sizes, three ways (issue 59, "Pieces").

A packed DiT forward (`gouache/runner/pack_dit.py`) puts every image's tokens, with its own text
tokens, in one sequence; each image attends over its own text and tokens only. Today that is a
break in the graph: one attention call per image size (`attend_each`), whose shapes follow the
step's mix. To compile the packed forward with layout as data, the attention must take the
mix as an input instead. This trial times, for one attention layer of a model's width:

- `each`: one SDPA call per image, eager (what the packed forward does now, less its grouping);
- `each compiled`: the same loop under `torch.compile` (a graph per mix: what a break avoids);
- `dense mask compiled`: the sequence padded to a token bucket (`gouache.runner.buckets`), one
  SDPA call with a boolean mask built from each token's segment id, compiled (a graph per bucket);
- `flex compiled`: `flex_attention` with a block mask from the same segment ids, compiled (a
  graph per bucket; the block mask is built outside the graph, per call), and `flex compiled,
  mask kept` with the block mask built once (a step builds it once for all its layers).

Median milliseconds over repeats after a warm-up call, and each way's largest difference from
`each` on the real tokens. Prints a table, writes JSON.

    .venv-test/bin/python benchmarks/segment_attention.py [--heads 4 --head-dim 32] [--out ...]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from gouache.runner.buckets import TOKEN_ALIGN, Range, choose

MIXES = {  # image sides in pixels; a token is 16x16 pixels (8x VAE, 2x2 patch)
    "small": (64, 96, 128),
    "medium": (256, 384, 512),
    "large": (512, 768, 1024),
}


def segments(sides: tuple[int, ...], text: int) -> list[int]:
    """Tokens of each image's segment: its text and its image tokens."""
    return [text + (side // 16) ** 2 for side in sides]


def timed(fn, repeats: int) -> float:
    fn()  # the compile, or the first call's allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def trial(name: str, sides: tuple[int, ...], heads: int, head_dim: int, text: int, repeats: int) -> dict:
    torch.manual_seed(0)
    lengths = segments(sides, text)
    real = sum(lengths)
    hi = sum(segments(MIXES["large"], text))  # the largest mix: the buckets are a server's for these mixes
    bucket = choose([Range("tokens", 1, hi, TOKEN_ALIGN)]).bucket("tokens", real)
    q, k, v = (torch.randn(1, heads, bucket, head_dim) for _ in range(3))
    ids = torch.full((bucket,), len(lengths), dtype=torch.long)  # padding: a segment of its own, dropped
    start = 0
    for i, n in enumerate(lengths):
        ids[start:start + n] = i
        start += n

    def each() -> torch.Tensor:
        out, at = [], 0
        for n in lengths:
            part = slice(at, at + n)
            out.append(F.scaled_dot_product_attention(q[:, :, part], k[:, :, part], v[:, :, part]))
            at += n
        return torch.cat(out, dim=2)

    def dense(q, k, v, ids):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ids[:, None] == ids[None, :])

    def same_segment(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    each_compiled = torch.compile(each, dynamic=False)
    dense_compiled = torch.compile(dense, dynamic=False)
    flex_compiled = torch.compile(flex_attention, dynamic=False)

    def flex():
        block = create_block_mask(same_segment, None, None, bucket, bucket, device="cpu")
        return flex_compiled(q, k, v, block_mask=block)

    block = create_block_mask(same_segment, None, None, bucket, bucket, device="cpu")  # once a step, for every layer

    reference = each()
    ways = {"each": each, "each compiled": each_compiled,
            "dense mask compiled": lambda: dense_compiled(q, k, v, ids), "flex compiled": flex,
            "flex compiled, mask kept": lambda: flex_compiled(q, k, v, block_mask=block)}
    row = {"mix": name, "sides": list(sides), "tokens": real, "bucket": bucket, "heads": heads,
           "head_dim": head_dim}
    for way, fn in ways.items():
        try:
            ms = timed(fn, repeats)
            diff = (fn()[:, :, :real] - reference).abs().max().item()
        except Exception as error:  # a way the installed torch cannot run here: say why
            row[way] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
            continue
        row[way] = {"ms": round(ms, 3), "max_diff": diff}
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", type=int, default=4, help="attention heads (default: shapes-dit's, %(default)s)")
    p.add_argument("--head-dim", type=int, default=32, help="head width (default: %(default)s)")
    p.add_argument("--text", type=int, default=77, help="text tokens per image (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=20, help="timed calls per way, median (default: %(default)s)")
    p.add_argument("--mixes", default=",".join(MIXES), help="of " + ", ".join(MIXES) + " (default: all)")
    p.add_argument("--out", default="benchmarks/results/segment_attention_cpu.json", help="JSON path (default: "
                   "%(default)s); the table (.md) goes beside it")
    args = p.parse_args()
    rows = [trial(name, MIXES[name], args.heads, args.head_dim, args.text, args.repeats)
            for name in args.mixes.split(",")]
    ways = ("each", "each compiled", "dense mask compiled", "flex compiled", "flex compiled, mask kept")
    lines = [f"`python {' '.join(sys.argv)}` on {torch.get_num_threads()} CPU threads, torch {torch.__version__}",
             "", "| mix | tokens | bucket | " + " | ".join(f"{w} ms" for w in ways) + " | largest difference |",
             "| --- | --- | --- | " + " | ".join("---" for _ in ways) + " | --- |"]
    for row in rows:
        cells = [f"{row[w]['ms']:.2f}" if "ms" in row[w] else "fails" for w in ways]
        diffs = [row[w]["max_diff"] for w in ways if "max_diff" in row[w]]
        lines.append(f"| {row['mix']} {row['sides']} | {row['tokens']} | {row['bucket']} | " + " | ".join(cells)
                     + f" | {max(diffs):.1e} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "machine": platform.processor() or
                               platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "rows": rows}, indent=2))
    out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
