"""The Triton kernels of specops.score.kernels against their torch references and the engine's torch paths.

    PYTHONPATH=src python3 benchmarks/score_triton_check.py                  # a CUDA device with triton
    PYTHONPATH=src python3 benchmarks/score_triton_check.py --references     # CPU: the script itself, with
                                                                             # the references as kernels

At the real drafter's shapes (hidden 5120, vocabulary 248,320, intermediate 17,408, 32/8 heads of 128;
the rows the engine hands over: 768 per head pass, 3,840 over all positions, 15 in the oracle) and at
odd ones (rows that are not a multiple of the tile, a vocabulary and a hidden size that are not, a
head_dim of 64 and of 96), in bf16 and fp16, through the engine's own entry points
(`TargetHead.argmax`, `drafter_ops.norm_rope`, `drafter_ops.silu_mul`) with the switches on and off:

- the head: the kernel's tokens against the torch head's. The kernel sums in another order than
  cuBLAS, so a token may differ only at a near-tie: each mismatch's gap between the two tokens' torch
  logits must be under --tie-tolerance. Exact ties across tiles go to the lowest token, a row of zeros
  to token 0, a NaN logit wins as in torch.argmax. Times of both at TIMED_ROWS rows, for a few tile settings.
- SiLU-and-mul and the q/k norm with RoPE: the largest difference from the reference (which computes
  what the kernel does, in torch: at most 2 units of the dtype's last place at max(|value|, 1)), and from
  eager torch (reported: eager rounds twice where the kernels round once). Times of both.
- the one-pass attention (`attend_context`): against its reference (at most 4 units in the last place:
  the online softmax rounds against a running maximum) and one float32 softmax; at the real shape (256
  sequences, 8 key/value heads of 64 query rows, contexts of 368, 752 and 1,128) timed against
  FlashAttention's variable-length kernel with the block merged, at each of ONE_PASS_SETTINGS, with the
  rate at which each reads the context.

Prints a JSON summary (and writes it to --out or $OUT/score_triton_check.json); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

try:
    import specops  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
from torch import nn

import specops.score.drafter_ops as drafter_ops
import specops.score.kernels as kernels
import specops.score.target_head as target_head
from specops.score.drafter_ops import RMSNorm
from specops.score.kernels import reference
from specops.score.target_head import TargetHead

REAL = {"hidden": 5120, "vocab": 248320, "intermediate": 17408, "heads": 32, "kv_heads": 8, "head_dim": 128}
SMALL = {"hidden": 64, "vocab": 1000, "intermediate": 96, "heads": 4, "kv_heads": 2, "head_dim": 16}
TILE_SETTINGS = [
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4},
    {"block_m": 64, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 128, "block_n": 256, "block_k": 64, "num_warps": 8, "num_stages": 4},
    {"block_m": 256, "block_n": 128, "block_k": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 64, "block_n": 256, "block_k": 64, "num_warps": 4, "num_stages": 4},
]
# Rows of the head passes timed: a full first pass at the real batch (256 blocks x 3 positions) and two
# later, smaller ones.
TIMED_ROWS = (768, 349, 140)
NAN, INF = float("nan"), float("inf")
EPS = {torch.bfloat16: 2**-8, torch.float16: 2**-11, torch.float32: 2**-24}  # half a unit in the last place


def references_as_kernels() -> None:
    """The CPU run: the references stand in for the kernels, and the kernels' rule says yes."""
    kernels.applies = lambda *tensors: True  # type: ignore[assignment]
    sys.modules["specops.score.kernels.head_argmax"] = SimpleNamespace(head_argmax=reference.head_argmax)  # type: ignore[assignment]
    sys.modules["specops.score.kernels.silu_mul"] = SimpleNamespace(silu_mul=reference.silu_mul)  # type: ignore[assignment]
    sys.modules["specops.score.kernels.norm_rope"] = SimpleNamespace(norm_rope=reference.norm_rope)  # type: ignore[assignment]
    sys.modules["specops.score.kernels.attend_block"] = SimpleNamespace(attend_block=reference.attend_block)  # type: ignore[assignment]
    sys.modules["specops.score.kernels.attend_context"] = SimpleNamespace(
        attend_context=reference.attend_context
    )  # type: ignore[assignment]


def timed_ms(fn, device: str, repeat: int = 10) -> float:
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat * 1e3


def ulps(found: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest difference in units of the dtype's last place at max(|expected|, 1)."""
    scale = expected.float().abs().clamp_min(1.0) * 2 * EPS[expected.dtype]
    return float(((found.float() - expected.float()).abs() / scale).max()) if found.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------


def head_tokens(head: TargetHead, rows: torch.Tensor, multiplier: float, kernel: str) -> torch.Tensor:
    saved = target_head.ARGMAX_KERNEL
    target_head.ARGMAX_KERNEL = kernel
    try:
        return head.argmax(rows, multiplier)
    finally:
        target_head.ARGMAX_KERNEL = saved


def head_case(head: TargetHead, rows: torch.Tensor, multiplier: float, tolerance: float) -> dict:
    """The kernel's tokens against the torch head's on rows: mismatches, and the torch logits' gap at each."""
    expected = head_tokens(head, rows, multiplier, "torch")
    found = head_tokens(head, rows, multiplier, "triton")
    wrong = (found != expected).nonzero().flatten()
    gap = 0.0
    if len(wrong):
        logits = head.logits(rows[wrong], multiplier)
        gaps = logits.gather(-1, expected[wrong, None]) - logits.gather(-1, found[wrong, None])
        gap = float(gaps.abs().max())
    return {
        "rows": rows.shape[0],
        "hidden": rows.shape[1],
        "vocab": head.vocab_size,
        "dtype": str(rows.dtype).removeprefix("torch."),
        "multiplier": multiplier,
        "mismatches": len(wrong),
        "largest_gap_at_a_mismatch": gap,
        "ok": gap <= tolerance,
    }


def random_head(vocab: int, hidden: int, dtype, device, seed: int) -> TargetHead:
    generator = torch.Generator(device=device).manual_seed(seed)
    weight = torch.randn(vocab, hidden, device=device, generator=generator) * hidden**-0.5
    return TargetHead(weight.to(dtype), weight.to(dtype))


def random_rows(rows: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(rows, hidden, device=device, generator=generator).to(dtype)


def head_checks(shape: dict, dtype, device: str, tolerance: float, timing: bool) -> dict:
    H, V = shape["hidden"], shape["vocab"]
    cases = []
    real = random_head(V, H, dtype, device, seed=0)
    for rows in (768, 3840, 15, 1):
        cases.append(head_case(real, random_rows(rows, H, dtype, device, rows), 1.0, tolerance))
    # Rows and a vocabulary that are not a multiple of the tile, hidden sizes that are not a multiple of
    # BLOCK_K, a negative multiplier (the epilogue's scaling turns the order).
    for rows, hidden, vocab, multiplier in ((130, H, V - 5, 0.7), (37, 200, 1000, -1.3), (17, 96, 129, 1.0)):
        head = random_head(vocab, hidden, dtype, device, seed=rows)
        cases.append(
            head_case(head, random_rows(rows, hidden, dtype, device, rows + 1), multiplier, tolerance)
        )
    found = {"cases": cases, "ties_and_nan": head_ties(dtype, device)}
    if timing:
        for rows in TIMED_ROWS:
            found[f"timing_{rows}_rows"] = head_timing(real, random_rows(rows, H, dtype, device, 9), device)
    found["ok"] = all(c["ok"] for c in cases) and found["ties_and_nan"]["ok"]
    return found


def head_ties(dtype, device: str) -> dict:
    """Exact ties across tiles (one row shared by tokens 5, 300 and the last), a row of zeros, a NaN logit."""
    vocab, hidden = 1000, 64
    head = random_head(vocab, hidden, dtype, device, seed=3)
    lead = torch.ones(hidden, device=device, dtype=dtype)
    for token in (5, 300, vocab - 1):
        head.lm_head_weight[token] = lead
    rows = torch.zeros(3, hidden, device=device, dtype=dtype)
    rows[0] = lead
    rows[2, 7] = float("nan")
    found = {"ties_then_zeros_then_nan_row": head_tokens(head, rows, 1.0, "triton").tolist()}
    found["torch"] = head_tokens(head, rows, 1.0, "torch").tolist()
    head.lm_head_weight[777] = float("nan")
    found["nan_logit"] = head_tokens(head, rows[:2], 1.0, "triton").tolist()
    found["ok"] = found["ties_then_zeros_then_nan_row"] == found["torch"] == [5, 0, 0] and found[
        "nan_logit"
    ] == [777, 777]
    return found


def head_timing(head: TargetHead, rows: torch.Tensor, device: str) -> dict:
    timing = {"torch_ms": timed_ms(lambda: head_tokens(head, rows, 1.0, "torch"), device)}
    if device != "cuda":
        return timing
    from specops.score.kernels.head_argmax import head_argmax

    expected = head_tokens(head, rows, 1.0, "torch")
    for tiles in TILE_SETTINGS:
        name = "triton " + " ".join(f"{k}={v}" for k, v in tiles.items())
        try:
            tokens = head_argmax(rows, head.lm_head_weight, 1.0, **tiles)
            ms = timed_ms(lambda tiles=tiles: head_argmax(rows, head.lm_head_weight, 1.0, **tiles), device)
            timing[name] = {"ms": ms, "mismatches_vs_torch": int((tokens != expected).sum())}
        except Exception as error:  # a setting this device cannot hold (shared memory): recorded
            timing[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
    return timing


# ---------------------------------------------------------------------------------------------
# SiLU-and-mul and the q/k norm with RoPE
# ---------------------------------------------------------------------------------------------


def elementwise(kind: str, fn):
    saved = drafter_ops.ELEMENTWISE
    drafter_ops.ELEMENTWISE = kind
    try:
        return fn()
    finally:
        drafter_ops.ELEMENTWISE = saved


def silu_case(rows: int, n: int, dtype, device: str, timing: bool) -> dict:
    generator = torch.Generator(device=device).manual_seed(rows)
    # The fused gate-up product's two halves, as DFlashLayer.feed_forward hands them over.
    product = (torch.randn(rows, 2 * n, device=device, generator=generator) * 2).to(dtype)
    gate, up = product.chunk(2, dim=-1)
    act = nn.SiLU()
    found = elementwise("triton", lambda: drafter_ops.silu_mul(act, gate.clone(), up))
    eager = elementwise("eager", lambda: drafter_ops.silu_mul(act, gate.clone(), up))
    case = {
        "rows": rows,
        "intermediate": n,
        "dtype": str(dtype).removeprefix("torch."),
        "ulps_vs_reference": ulps(found, reference.silu_mul(gate, up)),
        "ulps_vs_eager": ulps(found, eager),
        "elements_unlike_eager": float((found != eager).float().mean()),
    }
    if timing:
        # Eager overwrites gate: on a copy of the product, as strided as the original.
        gate_copy, up_copy = product.clone().chunk(2, dim=-1)
        case["eager_ms"] = timed_ms(lambda: act(gate_copy).mul_(up_copy), device)
        case["triton_ms"] = timed_ms(
            lambda: elementwise("triton", lambda: drafter_ops.silu_mul(act, gate, up)), device
        )
    case["ok"] = case["ulps_vs_reference"] <= 2
    return case


def rope_angles(positions: torch.Tensor, d: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1e6 ** -(torch.arange(0, d, 2, device=positions.device).float() / d)
    angles = positions.float()[..., None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def norm_rope_case(
    name: str,
    tokens: tuple[int, ...],
    heads: int,
    d: int,
    columns: tuple[int, int],
    cos_tokens,
    dtype,
    device,
    timing,
    groups: int = 0,
) -> dict:
    """x: heads x d columns [first, first + heads * d) of a wider product (a strided view, as q and k are);
    cos/sin per token of cos_tokens (x's last token dimensions). groups: also written folded, as the
    queries of heads // groups kv heads are (must equal the contiguous output)."""
    generator = torch.Generator(device=device).manual_seed(heads * d)
    first, width = columns
    product = torch.randn(*tokens, width, device=device, generator=generator).to(dtype)
    x = product[..., first : first + heads * d].view(*tokens, heads, d)
    norm = RMSNorm(d, eps=1e-6).to(device=device, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d, device=device, generator=generator) + 0.5)
    positions = torch.arange(int(torch.tensor(cos_tokens).prod()), device=device).view(cos_tokens) + 7
    cos, sin = rope_angles(positions, d, dtype)
    with torch.inference_mode():
        found = elementwise("triton", lambda: drafter_ops.norm_rope(x, norm, cos, sin))
        eager = elementwise("eager", lambda: drafter_ops.norm_rope(x, norm, cos, sin))
        folded = None
        if groups and len(tokens) == 2:
            # The queries written straight into the attention's folded order (block_attention.query_buffer).
            buffer = torch.empty(tokens[0], groups, tokens[1], heads // groups, d, device=device, dtype=dtype)
            out = buffer.permute(0, 2, 3, 1, 4)
            elementwise("triton", lambda: drafter_ops.norm_rope(x, norm, cos, sin, out=out))
            folded = out.reshape(x.shape)
        rows = drafter_ops.per_token(cos, sin, tuple(tokens))
        expected = reference.norm_rope(x.reshape(-1, heads, d), norm.weight, 1e-6, *rows).view(x.shape)
    case = {
        "name": name,
        "x": list(x.shape),
        "cos": list(cos.shape),
        "dtype": str(dtype).removeprefix("torch."),
        "ulps_vs_reference": ulps(found, expected),
        "ulps_vs_eager": ulps(found, eager),
        "elements_unlike_eager": float((found != eager).float().mean()),
    }
    if folded is not None:
        case["folded_equals_contiguous"] = bool(torch.equal(folded, found))
    if timing:
        with torch.inference_mode():
            for kind in ("eager", "triton"):
                case[f"{kind}_ms"] = timed_ms(
                    lambda kind=kind: elementwise(kind, lambda: drafter_ops.norm_rope(x, norm, cos, sin)),
                    device,
                )
    case["ok"] = case["ulps_vs_reference"] <= 2 and case.get("folded_equals_contiguous", True)
    return case


def attention_case(name: str, q, bs: int, context: int, found, expected, exact) -> dict:
    """An attention kernel's case: its shape and its distance from its reference and from one float32
    softmax, in units of the last place of the queries' dtype."""
    return {
        "name": name,
        "queries": list(q.shape),
        "block": bs,
        "context": context,
        "dtype": str(q.dtype).removeprefix("torch."),
        "ulps_vs_reference": ulps(found, expected),
        "ulps_vs_one_softmax": ulps(found, exact.to(q.dtype)),
    }


def attend_block_case(
    name: str, B: int, groups: int, bs: int, heads: int, d: int, context: int, dtype, device, timing
) -> dict:
    """The block merge (kernels.attend_block) against its reference, and against one float32 softmax over
    the context and the block together (reported: the context's output reaches the kernel rounded)."""
    from specops.score.kernels.attend_block import attend_block

    generator = torch.Generator(device=device).manual_seed(B * bs + d)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    rows, scale = groups * bs, d**-0.5
    q, k_ctx, v_ctx = randn(B, rows, heads, d), randn(B, context, heads, d), randn(B, context, heads, d)
    k_blk, v_blk = randn(B, bs, heads, d), randn(B, bs, heads, d)
    scores = torch.einsum("brhd,bthd->bhrt", q.float(), k_ctx.float()) * scale
    o_ctx = torch.einsum("bhrt,bthd->brhd", scores.softmax(-1), v_ctx.float()).to(dtype)
    # FlashAttention's layout for a variable-length call: [heads, sequences x rows].
    lse = scores.logsumexp(-1).permute(1, 0, 2).reshape(heads, B * rows)
    lse_view = lse.view(heads, B, rows).permute(1, 2, 0)

    def merged(kernel):
        out = torch.empty(B, bs, heads, groups, d, device=device, dtype=dtype)
        kernel(q, k_blk, v_blk, o_ctx, lse_view, scale, out.permute(0, 3, 1, 2, 4))
        return out.permute(0, 3, 1, 2, 4).reshape(B, rows, heads, d)

    found, expected = merged(attend_block), merged(reference.attend_block)
    keys, values = torch.cat([k_ctx, k_blk], 1).float(), torch.cat([v_ctx, v_blk], 1).float()
    whole = torch.einsum("brhd,bthd->bhrt", q.float(), keys) * scale
    exact = torch.einsum("bhrt,bthd->brhd", whole.softmax(-1), values)
    case = attention_case(name, q, bs, context, found, expected, exact)
    if timing:
        case["kernel_ms"] = timed_ms(lambda: merged(attend_block), device)
    case["ok"] = case["ulps_vs_reference"] <= 2
    return case


# The one-pass attention's settings timed at the real shape (the kernel's keys per tile, warps, stages).
ONE_PASS_SETTINGS = [
    {"BLOCK_N": n, "NUM_WARPS": w, "NUM_STAGES": st}
    for n in (32, 64, 128)
    for w in (4, 8)
    for st in (2, 3, 4)
]


def attend_context_case(
    name: str,
    B: int,
    groups: int,
    bs: int,
    heads: int,
    d: int,
    context: int,
    dtype,
    device,
    timing,
    none_before_first: bool = False,
) -> dict:
    """The one-pass attention (kernels.attend_context) against its reference and against one float32 softmax
    over the context before each start and the block; on CUDA, timed against FlashAttention's
    variable-length kernel with the block merged (the engine's `flash`), at each of ONE_PASS_SETTINGS."""
    from specops.score.kernels import attend_context as module

    generator = torch.Generator(device=device).manual_seed(B * bs + d + context)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator).to(dtype)

    rows, scale, slots = groups * bs, d**-0.5, context + bs
    q, keys, values = randn(B, rows, heads, d), randn(B, slots, heads, d), randn(B, slots, heads, d)
    k_blk, v_blk = randn(B, bs, heads, d), randn(B, bs, heads, d)
    # Starts spread over the last quarter of the context (at least one position before each block).
    starts = torch.randint(
        max(1, context - context // 4), context + 1, (B,), device=device, generator=generator
    )
    if none_before_first:
        starts[0] = 0

    def attended(kernel):
        out = torch.empty(B, bs, heads, groups, d, device=device, dtype=dtype)
        kernel(q, keys, values, starts, k_blk, v_blk, scale, out.permute(0, 3, 1, 2, 4))
        return out.permute(0, 3, 1, 2, 4).reshape(B, rows, heads, d)

    found = attended(module.attend_context)
    expected = attended(reference.attend_context)
    exact = torch.empty_like(expected, dtype=torch.float32)
    for b in range(B):
        k = torch.cat([keys[b, : starts[b]], k_blk[b]]).float()
        v = torch.cat([values[b, : starts[b]], v_blk[b]]).float()
        scores = torch.einsum("rhd,thd->hrt", q[b].float(), k) * scale
        exact[b] = torch.einsum("hrt,thd->rhd", scores.softmax(-1), v)
    case = attention_case(name, q, bs, context, found, expected, exact)
    # The online softmax rounds each tile's probabilities against the running maximum, the reference
    # against the row's: a unit or two apart.
    case["ok"] = case["ulps_vs_reference"] <= 4
    if timing and device == "cuda":
        import specops.score.block_attention as block_attention
        from specops.score.kernels.attend_block import attend_block

        cu_q, cu_k = block_attention.sequence_offsets(B, rows, slots, q.device)
        used = starts.to(torch.int32)

        def flash_merged():
            out, lse = block_attention.varlen_attention(
                q.view(B * rows, heads, d), keys.view(B * slots, heads, d), values.view(B * slots, heads, d),
                cu_q, cu_k, rows, slots, scale, used,
            )  # fmt: skip
            merged = torch.empty(B, bs, heads, groups, d, device=device, dtype=dtype)
            lse = block_attention.lse_rows(lse, B, rows, heads)
            attend_block(
                q, k_blk, v_blk, out.view(B, rows, heads, d), lse, scale, merged.permute(0, 3, 1, 2, 4)
            )
            return merged.permute(0, 3, 1, 2, 4).reshape(B, rows, heads, d)

        case["flash_merged_ulps_vs_one_softmax"] = ulps(flash_merged(), exact.to(dtype))
        case["flash_merged_ms"] = timed_ms(flash_merged, device)
        read = 2 * B * heads * d * q.element_size() * float(starts.sum()) / B
        settings = []
        for setting in ONE_PASS_SETTINGS:
            saved = {key: getattr(module, key) for key in setting}
            try:
                for key, value in setting.items():
                    setattr(module, key, value)
                ms = timed_ms(lambda: attended(module.attend_context), device)
                settings.append({**setting, "ms": ms, "context_read_tb_per_s": read / ms / 1e9})
            except Exception as error:  # noqa: BLE001 (a setting this device cannot build: reported)
                settings.append({**setting, "error": str(error).splitlines()[0][:200]})
            finally:
                for key, value in saved.items():
                    setattr(module, key, value)
        timed = [t for t in settings if "ms" in t]
        case["kernel_ms"] = next(t["ms"] for t in timed if all(t[k] == getattr(module, k) for k in saved))
        case["flash_merged_context_read_tb_per_s"] = read / case["flash_merged_ms"] / 1e9
        case["settings"] = settings
        case["fastest_setting"] = min(timed, key=lambda t: t["ms"])
    return case


def attend_context_checks(shape: dict, dtype, device: str, timing: bool) -> dict:
    groups, kv_heads, d = shape["heads"] // shape["kv_heads"], shape["kv_heads"], shape["head_dim"]
    checks = [
        attend_context_case(f"real, context {c}", 256, groups, 16, kv_heads, d, c, dtype, device, timing)
        for c in (368, 752, 1128)
    ]
    checks += [
        # Rows and a block that are not powers of two; a context of one position; none before the block.
        attend_context_case("odd", 3, 3, 5, 2, 64, 7, dtype, device, False, none_before_first=True),
        attend_context_case("one context position", 2, 2, 16, 2, 64, 1, dtype, device, False),
    ]
    return {"cases": checks, "ok": all(c["ok"] for c in checks)}


def elementwise_checks(shape: dict, dtype, device: str, timing: bool) -> dict:
    n, heads, kv_heads, d = shape["intermediate"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    qkv = (heads + 2 * kv_heads) * d
    silu = [silu_case(rows, n, dtype, device, timing) for rows in (4096, 15)]
    silu.append(silu_case(37, 1003, dtype, device, False))
    rope = [
        # The blocks' queries and keys: 256 blocks of 16, columns of the fused q/k/v product.
        norm_rope_case("block queries", (256, 16), heads, d, (0, qkv), (256, 16), dtype, device, timing),
        norm_rope_case(
            "block queries, folded",
            (256, 16),
            heads,
            d,
            (0, qkv),
            (256, 16),
            dtype,
            device,
            False,
            heads // kv_heads,
        ),
        norm_rope_case(
            "block keys", (256, 16), kv_heads, d, (heads * d, qkv), (256, 16), dtype, device, False
        ),
        # The context's keys: one cos row per position, shared by the sequences.
        norm_rope_case(
            "context keys", (8, 1128), kv_heads, d, (0, 2 * kv_heads * d), (1128,), dtype, device, timing
        ),
        # 15 rows (not a multiple of the kernel's 16), head_dim 64; head_dim 96 (half not a power of 2).
        norm_rope_case("odd rows, head_dim 64", (5,), 3, 64, (0, 3 * 64), (5,), dtype, device, False),
        norm_rope_case("head_dim 96", (2, 7), 5, 96, (96, 7 * 96), (7,), dtype, device, False),
    ]
    groups = heads // kv_heads
    merge = [
        attend_block_case("real", 256, groups, 16, kv_heads, d, 600, dtype, device, timing),
        # Rows, keys and head_dim that are not powers of two; a context of one position.
        attend_block_case("odd", 3, 3, 5, 2, 96, 7, dtype, device, False),
        attend_block_case("one context position", 2, 2, 16, 2, 64, 1, dtype, device, False),
    ]
    checks = silu + rope + merge
    return {"silu_mul": silu, "norm_rope": rope, "attend_block": merge, "ok": all(c["ok"] for c in checks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--references", action="store_true", help="CPU: the references in the kernels' place")
    parser.add_argument("--small", action="store_true", help="small shapes instead of the real drafter's")
    parser.add_argument(
        "--tie-tolerance", type=float, default=1e-3, help="largest torch logit gap at a mismatch"
    )
    parser.add_argument(
        "--only", choices=("head", "elementwise", "attend_context"), help="one group of checks alone"
    )
    parser.add_argument(
        "--out", help="JSON file to write (default $OUT/score_triton_check.json when OUT is set)"
    )
    args = parser.parse_args()
    if args.references:
        references_as_kernels()
        device = "cpu"
    elif not (torch.cuda.is_available() and kernels.triton_available()):
        sys.exit("score_triton_check.py needs a CUDA device and triton (or --references on the CPU)")
    else:
        device = "cuda"
    shape = SMALL if args.small or args.references else REAL
    dtypes = (torch.bfloat16, torch.float16)
    summary: dict = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": "PYTHONPATH=src python3 benchmarks/score_triton_check.py " + " ".join(sys.argv[1:]),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (references as kernels)",
        "torch": torch.__version__,
        "triton": __import__("triton").__version__ if device == "cuda" else None,
        "shape": shape,
        "tie_tolerance": args.tie_tolerance,
    }
    with torch.inference_mode():
        for dtype in dtypes:
            name = str(dtype).removeprefix("torch.")
            timing = dtype == torch.bfloat16
            if args.only in (None, "head"):
                summary[f"head_{name}"] = head_checks(shape, dtype, device, args.tie_tolerance, timing)
            if args.only in (None, "elementwise"):
                summary[f"elementwise_{name}"] = elementwise_checks(shape, dtype, device, timing)
            if args.only in (None, "attend_context"):
                summary[f"attend_context_{name}"] = attend_context_checks(shape, dtype, device, timing)
            if device == "cuda":
                torch.cuda.empty_cache()
    summary["ok"] = all(
        v["ok"] for k, v in summary.items() if k.startswith(("head_", "elementwise_", "attend_context_"))
    )
    text = json.dumps(summary, indent=2)
    print(text)
    out = args.out or (
        os.path.join(os.environ["OUT"], "score_triton_check.json") if os.environ.get("OUT") else None
    )
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    if not summary["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
