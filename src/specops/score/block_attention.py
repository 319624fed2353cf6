"""A drafted block's attention over its sequence's context before the block and over itself.

Two kernels compute the same thing, chosen through one function (`block_attention`):

- `reference`: the plain statement: scores of the block's queries against the whole (padded) context
  and against the block, the hidden keys masked, softmax, the mix of the values. It materialises the
  scores, [B, kv_heads, m, groups, bs, T + bs], and passes over them several times. It handles any
  number of blocks per sequence and is what the fast kernel is checked against (tests/unit).
- `sdpa`: torch's scaled_dot_product_attention over the context buffer with the block's own keys and
  values written into spare slots at its end (`context_kv(..., block_slots=True)`), and an additive
  mask that hides the context at and after each block's start and the unused slots. The fused kernels
  never write the scores out. It needs one block per sequence (the frontier walk) and a context built
  with the slots; otherwise the reference runs. Torch picks the backend: cuDNN's on the H200 (which
  builds a plan for every new batch size, and the frontier's batch shrinks as sequences finish), flash
  on the CPU. `sdpa-efficient` and `sdpa-cudnn` hold a CUDA device to one backend (elsewhere they are
  `sdpa`). Every key of the padded buffer is read, the hidden ones too.
- `flash`: FlashAttention's variable-length kernel (torch's own build) over the real context only, so
  keys after the block are never read and no mask exists. Where the block's own keys go is
  `BLOCK_KEYS`: "merged" attends the queries to the context before the start alone (`seqused_k` =
  start) and to the block's keys in a Triton kernel that merges the two softmaxes by the log-sum-exp
  FlashAttention returns (`specops.score.kernels.attend_block`), writing o_proj's layout; nothing is
  written into the buffers. "in_context" (and wherever the Triton kernel does not apply) writes the
  block's keys and values right after its start, keeps aside what was there and puts it back after the
  call, with `start + block` keys per sequence. It needs the buffers token-major (each position's heads
  side by side, `context_slots`, which CUDA devices get) and a layer that sees its whole block and the
  context before it (no causal rule, no window); elsewhere `sdpa-efficient` runs.

The query heads of one key/value head are folded into the query length (g x bs queries against one
key/value head), so no kernel needs grouped-query support and each key is read once per group. Where
`flash` is the kernel, the queries are written in that folded order in the first place
(`query_buffer`), so the kernel reads them without a copy.

- `triton`: the same attention over the real context in one Triton kernel
  (`specops.score.kernels.attend_context`), the block's own keys included: exactly a key/value head's
  g x bs query rows a program (FlashAttention's tiles are 128 rows), no log-sum-exp, no merge. It reads
  the same folded queries and token-major buffers; `flash` runs where it does not apply.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from specops.score import kernels

if TYPE_CHECKING:
    from specops.score.drafter import DFlashAttention

# Spare positions after the context hold the block's keys and values; the buffer's length is rounded up
# to this multiple (the memory-efficient kernel wants its mask's rows aligned to 16 elements).
SLOT_ALIGNMENT = 16

# kernel(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len) -> [B, m, bs, heads * head_dim]
# q [B, m, bs, kv_heads, groups, head_dim] (normed and rotated, not scaled); k_blk, v_blk
# [B, m, kv_heads, bs, head_dim]; starts [B, m]; ctx_k, ctx_v [B, kv_heads, T', head_dim] with the
# context at positions 0..context_len-1 (T' >= context_len; the rest spare slots).
Kernel = Callable[..., torch.Tensor]

# The kernel used where it applies, chosen by measurement at the real drafter's shape (per layer call at 256
# x 1,128 tokens): on an H100 (benchmarks/score_real_h100_2026-12-05_night.json) `flash` 0.631 ms,
# cuDNN 0.692, sdpa 0.703, sdpa-efficient 0.844, reference 5.45, and flash's first call at a new batch
# size 0.81 ms against cuDNN's 34 ms (it builds a plan for every size, and the frontier's batch shrinks as
# sequences finish); on the H200 (benchmarks/score_real_h200_2026-12-04.json, before `flash` existed) cuDNN
# 0.71-0.74 ms, sdpa-efficient 0.95, reference 2.02. Where `flash` does not apply (the CPU, a causal or
# sliding layer, a torch without the kernel) it runs `sdpa-efficient`, which is `sdpa` off CUDA.
# "reference" forces the plain path everywhere. `triton` (which runs `flash` where triton does not
# apply) then measured 0.339 ms against flash's 0.435, and the engine 2.0% faster with it, alternated
# three rounds (an H100, benchmarks/score_real_h100_2026-12-06_one_pass.json).
KERNEL = "triton"

# The kernels that read the real context only (the context before each start, no padded scores).
REAL_CONTEXT_KERNELS = ("flash", "triton")

# Where `flash` attends the block's own keys (module docstring): "merged" where the Triton kernel applies
# (CUDA, half precision, triton importable), "in_context" elsewhere and when set so.
BLOCK_KEYS = "merged"

# Devices whose context buffers are laid out token-major ([B, T', kv_heads, head_dim] in memory, handed
# out as a [B, kv_heads, T', head_dim] view): what the variable-length kernel reads. The CPU keeps
# head-major buffers, which its kernels read without a copy.
TOKEN_MAJOR_DEVICES = ("cuda",)


def slots_length(context_len: int, block_size: int) -> int:
    """The context buffer's length with room for one block after the context, aligned."""
    need = context_len + block_size
    return -(-need // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def empty_slots(shape, block_size: int, device, dtype) -> torch.Tensor:
    """A zero buffer for keys or values of shape [B, kv_heads, T, head_dim] with room for one block after
    the context, laid out for the device's kernels (`TOKEN_MAJOR_DEVICES`), as a [B, kv_heads, T',
    head_dim] view."""
    B, heads, T, d = shape
    slots = slots_length(T, block_size)
    if torch.device(device).type in TOKEN_MAJOR_DEVICES:
        return torch.zeros(B, slots, heads, d, device=device, dtype=dtype).transpose(1, 2)
    return torch.zeros(B, heads, slots, d, device=device, dtype=dtype)


def context_slots(k: torch.Tensor, v: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The context's keys and values [B, kv_heads, T, head_dim] copied into `empty_slots` buffers."""
    T = k.shape[-2]
    buffers = []
    for x in (k, v):
        buffer = empty_slots(x.shape, block_size, x.device, x.dtype)
        buffer[..., :T, :] = x
        buffers.append(buffer)
    return buffers[0], buffers[1]


def token_major(buffer: torch.Tensor) -> bool:
    """Whether a [B, kv_heads, T', head_dim] buffer is a view of token-major memory."""
    return buffer.transpose(-2, -3).is_contiguous()


def select_sequences(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The buffer's sequences at index, in the same memory layout (indexing a view would not keep it)."""
    if token_major(buffer) and not buffer.is_contiguous():
        return buffer.transpose(-2, -3)[index].transpose(-2, -3)
    return buffer[index]


def reference(attn: DFlashAttention, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len=None):
    """The plain path (module docstring); spare slots past the context are hidden like any key
    at or after a block's start."""
    B, m, bs, h, g, d = q.shape
    T = ctx_k.shape[-2]
    # The scale goes on the queries: one product over bs positions instead of one over every score.
    q = (q * attn.scaling).permute(0, 3, 1, 4, 2, 5).contiguous()  # [B, h, m, g, bs, d]
    k_blk, v_blk = k_blk.transpose(1, 2), v_blk.transpose(1, 2)  # [B, h, m, bs, d]
    s_ctx = torch.matmul(q.view(B, h, m * g * bs, d), ctx_k.transpose(-1, -2)).view(B, h, m, g, bs, T)
    s_blk = torch.matmul(q.view(B, h, m, g * bs, d), k_blk.transpose(-1, -2)).view(B, h, m, g, bs, bs)
    # The scores stay in the compute dtype; softmax accumulates in float32.
    scores = torch.cat([s_ctx, s_blk], dim=-1)

    key_pos = torch.arange(T, device=q.device)
    starts_ = starts[:, None, :, None, None, None]
    ctx_hidden = key_pos >= starts_  # [B, 1, m, 1, 1, T]
    if attn.sliding_window is not None:
        query_pos = starts_ + torch.arange(bs, device=q.device)[:, None]
        ctx_hidden = ctx_hidden | (query_pos - key_pos >= attn.sliding_window)
    ctx_hidden = ctx_hidden.expand(B, 1, m, 1, bs, T)
    block = torch.arange(bs, device=q.device)
    blk_visible = attn.visibility(block, block)
    blk_hidden = (
        torch.zeros(bs, bs, dtype=torch.bool, device=q.device) if blk_visible is None else ~blk_visible
    ).expand(B, 1, m, 1, bs, bs)
    mask = torch.cat([ctx_hidden, blk_hidden], dim=-1)
    probs = scores.masked_fill_(mask, float("-inf")).softmax(dim=-1)

    out = torch.matmul(probs[..., :T].reshape(B, h, m * g * bs, T), ctx_v).view(B, h, m, g, bs, d)
    out = out + torch.matmul(probs[..., T:].reshape(B, h, m, g * bs, bs), v_blk).view(B, h, m, g, bs, d)
    return out.permute(0, 2, 4, 1, 3, 5).reshape(B, m, bs, h * g * d)


def slot_mask(attn: DFlashAttention, starts: torch.Tensor, context_len: int, slots: int, bs: int, dtype):
    """Additive mask [B, 1, 1 or groups * bs, slots]: 0 where a query sees the key, -inf elsewhere.

    Keys 0..context_len-1 are the context (seen before the block's start, and within the sliding
    window), context_len..context_len+bs-1 the block (the layer's rule inside a block), the rest unused.
    """
    device = starts.device
    key = torch.arange(slots, device=device)
    start = starts[:, :1]  # [B, 1]
    in_block = key - context_len
    block_rule = attn.visibility(torch.arange(bs, device=device), torch.arange(bs, device=device))
    if block_rule is None and attn.sliding_window is None:
        visible = (key < start) | ((in_block >= 0) & (in_block < bs))  # [B, slots]
        visible = visible[:, None, None, :]
    else:
        query = torch.arange(bs, device=device)[:, None]  # [bs, 1]
        ctx = key[None, None, :] < start[:, :, None]  # [B, 1, slots]
        if attn.sliding_window is not None:
            ctx = ctx & (start[:, :, None] + query - key < attn.sliding_window)
        rule = torch.ones(bs, bs, dtype=torch.bool, device=device) if block_rule is None else block_rule
        blk = torch.zeros(bs, slots, dtype=torch.bool, device=device)
        blk[:, context_len : context_len + bs] = rule
        visible = (ctx & (key < context_len)) | blk  # [B, bs, slots]
        visible = (
            visible[:, None, None]
            .expand(-1, 1, attn.groups, bs, slots)
            .reshape(-1, 1, attn.groups * bs, slots)
        )
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(visible, zero, torch.tensor(float("-inf"), dtype=dtype, device=device))


def sdpa(attn: DFlashAttention, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len):
    """The fused path (module docstring); one block per sequence, the context built with slots."""
    B, _, bs, h, g, d = q.shape
    slots = ctx_k.shape[-2]
    ctx_k[:, :, context_len : context_len + bs] = k_blk[:, 0]
    ctx_v[:, :, context_len : context_len + bs] = v_blk[:, 0]
    queries = q[:, 0].permute(0, 2, 3, 1, 4).reshape(B, h, g * bs, d)
    mask = slot_mask(attn, starts, context_len, slots, bs, q.dtype)
    out = F.scaled_dot_product_attention(queries, ctx_k, ctx_v, attn_mask=mask, scale=attn.scaling)
    return out.view(B, h, g, bs, d).permute(0, 3, 1, 2, 4).reshape(B, 1, bs, h * g * d)


def varlen_attention(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, seqused_k):
    """FlashAttention's variable-length forward (torch's build, CUDA only): query [total_q, heads, d],
    key/value [total_k, heads, d]; sequence i's queries are rows cu_seq_q[i]..cu_seq_q[i+1] and its keys
    the first seqused_k[i] rows from cu_seq_k[i]. Returns (out [total_q, heads, d], each row's log-sum-exp
    in float32, [heads, total_q] or [sequences, heads, max_q] as the build lays it out: `lse_rows`)."""
    out = torch.ops.aten._flash_attention_forward(
        query,
        key,
        value,
        cu_seq_q,
        cu_seq_k,
        max_q,
        max_k,
        0.0,
        False,
        False,
        scale=scale,
        seqused_k=seqused_k,
    )
    return out[0], out[1]


def lse_rows(lse: torch.Tensor, sequences: int, rows: int, heads: int) -> torch.Tensor:
    """The log-sum-exp of `varlen_attention` as a [sequences, rows, heads] view, from either layout."""
    if lse.shape == (heads, sequences * rows):
        return lse.view(heads, sequences, rows).permute(1, 2, 0)
    if lse.dim() == 3 and lse.shape[:2] == (sequences, heads) and lse.shape[2] >= rows:
        return lse[:, :, :rows].transpose(1, 2)
    raise RuntimeError(f"FlashAttention returned a log-sum-exp of shape {tuple(lse.shape)}: unknown layout")


def query_buffer(lead: tuple[int, ...], heads: int, groups: int, head_dim: int, like: torch.Tensor):
    """Where the queries [*lead, kv_heads, groups, head_dim] (lead = B, m, bs) go when `flash` will read
    them: a view of memory laid out [B, m, groups, bs, kv_heads, head_dim], each kv head's groups x block
    queries one run of rows (the fold in the module docstring); None where the kernel is another or the
    buffers are not token-major (the kernel then permutes as it needs)."""
    if KERNEL not in REAL_CONTEXT_KERNELS or like.device.type not in TOKEN_MAJOR_DEVICES or len(lead) != 3:
        return None
    B, m, bs = lead
    folded = torch.empty(B * m, groups, bs, heads, head_dim, dtype=like.dtype, device=like.device)
    return folded.permute(0, 2, 3, 1, 4).view(B, m, bs, heads, groups, head_dim)


# Why the Triton kernel that attends the block's own keys failed here, or None (then "in_context" runs).
MERGE_FAILED: str | None = None


def _merge_applies(q: torch.Tensor) -> bool:
    return BLOCK_KEYS == "merged" and MERGE_FAILED is None and kernels.applies(q)


def _merge_failed(error: Exception) -> None:
    global MERGE_FAILED
    MERGE_FAILED = kernels.failure(
        error,
        "the Triton kernel for the block's own keys failed ({}); the block's keys are written into the "
        "context buffers instead",
    )


def sequence_offsets(sequences: int, rows: int, slots: int, device: torch.device):
    """cu_seq_q, cu_seq_k for `sequences` runs of `rows` queries and `slots` keys: the same in every layer,
    so kept (except while a CUDA graph is being captured: what it computes exists only in its replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _offsets(sequences, rows, slots, device)
    return _kept_offsets(sequences, rows, slots, device)


def _offsets(sequences: int, rows: int, slots: int, device: torch.device):
    index = torch.arange(sequences + 1, device=device, dtype=torch.int32)
    return index * rows, index * slots


_kept_offsets = functools.lru_cache(maxsize=64)(_offsets)


# What FlashAttention computes in.
FLASH_DTYPES = (torch.bfloat16, torch.float16)
# Why the variable-length kernel failed on this torch (then `flash` runs `sdpa-efficient`), or None.
FLASH_UNAVAILABLE: str | None = None


def _flash_unavailable(error: Exception) -> None:
    global FLASH_UNAVAILABLE
    FLASH_UNAVAILABLE = str(error).splitlines()[0] if str(error) else type(error).__name__
    warnings.warn(
        f"FlashAttention's variable-length kernel is not usable here ({FLASH_UNAVAILABLE}); "
        "the drafter's attention uses the memory-efficient kernel with a mask",
        RuntimeWarning,
        stacklevel=3,
    )


def flash(attn: DFlashAttention, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len):
    """The variable-length path (module docstring); `sdpa-efficient` where it does not apply."""
    B, _, bs, h, g, d = q.shape
    fits = (
        not attn.is_causal
        and attn.sliding_window is None
        and q.dtype in FLASH_DTYPES
        and token_major(ctx_k)
        and token_major(ctx_v)
        and FLASH_UNAVAILABLE is None
    )
    if not fits:
        return KERNELS["sdpa-efficient"](attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
    slots = ctx_k.shape[-2]
    keys = ctx_k.transpose(1, 2).view(B * slots, h, d)
    values = ctx_v.transpose(1, 2).view(B * slots, h, d)
    # A kv head's groups x block queries are one sequence of g * bs rows (module docstring); a view where
    # the queries were written folded (`query_buffer`).
    queries = q[:, 0].permute(0, 3, 1, 2, 4).reshape(B * g * bs, h, d)
    cu_seq_q, cu_seq_k = sequence_offsets(B, g * bs, slots, q.device)
    if _merge_applies(q):
        try:
            used, scale = starts[:, 0].to(torch.int32), attn.scaling
            out, lse = varlen_attention(queries, keys, values, cu_seq_q, cu_seq_k, g * bs, slots, scale, used)
        except (RuntimeError, TypeError) as error:
            _flash_unavailable(error)
            return KERNELS["sdpa-efficient"](attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
        try:
            return _merge_block(attn, queries, k_blk, v_blk, out, lse)
        except Exception as error:  # noqa: BLE001 (any failure to build the kernel: the in-context path)
            _merge_failed(error)
    first = torch.arange(B, device=q.device) * slots
    rows = ((first + starts[:, 0])[:, None] + torch.arange(bs, device=q.device)).view(-1)
    kept_k, kept_v = keys[rows], values[rows]
    keys[rows] = k_blk[:, 0].transpose(1, 2).reshape(B * bs, h, d)
    values[rows] = v_blk[:, 0].transpose(1, 2).reshape(B * bs, h, d)
    try:
        used = (starts[:, 0] + bs).to(torch.int32)
        scale = attn.scaling
        out, _ = varlen_attention(queries, keys, values, cu_seq_q, cu_seq_k, g * bs, slots, scale, used)
    except (RuntimeError, TypeError) as error:
        # A torch built without FlashAttention or without seqused_k: the mask-based kernel, said once.
        _flash_unavailable(error)
        return KERNELS["sdpa-efficient"](attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
    finally:
        keys[rows], values[rows] = kept_k, kept_v
    return out.view(B, g, bs, h, d).permute(0, 2, 3, 1, 4).reshape(B, 1, bs, h * g * d)


def _merge_block(attn: DFlashAttention, queries, k_blk, v_blk, out, lse) -> torch.Tensor:
    """BLOCK_KEYS "merged": the block's own keys attended and merged with the context's output `out` and
    log-sum-exp `lse` (from `varlen_attention` over the context before each start), in o_proj's layout."""
    B, _, h, bs, d = k_blk.shape
    rows = queries.shape[0] // B
    from specops.score.kernels.attend_block import attend_block

    merged = torch.empty(B, 1, bs, h, rows // bs, d, dtype=queries.dtype, device=queries.device)
    attend_block(
        queries.view(B, rows, h, d),
        k_blk[:, 0].transpose(1, 2),
        v_blk[:, 0].transpose(1, 2),
        out.view(B, rows, h, d),
        lse_rows(lse, B, rows, h),
        attn.scaling,
        merged[:, 0].permute(0, 3, 1, 2, 4),
    )
    return merged.view(B, 1, bs, -1)


# Why the one-pass Triton kernel failed here, or None (then `triton` runs `flash`).
ONE_PASS_FAILED: str | None = None


def one_pass(attn: DFlashAttention, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len):
    """`triton` (module docstring); `flash` where it does not apply."""
    B, _, bs, h, g, d = q.shape
    fits = (
        not attn.is_causal
        and attn.sliding_window is None
        and token_major(ctx_k)
        and token_major(ctx_v)
        and _one_pass_applies(q, k_blk, v_blk, ctx_k, ctx_v)
    )
    if not fits:
        return flash(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
    out = torch.empty(B, 1, bs, h, g, d, dtype=q.dtype, device=q.device)
    try:
        from specops.score.kernels.attend_context import attend_context

        attend_context(
            q[:, 0].permute(0, 3, 1, 2, 4).reshape(B, g * bs, h, d),
            ctx_k.transpose(1, 2),
            ctx_v.transpose(1, 2),
            starts[:, 0],
            k_blk[:, 0].transpose(1, 2),
            v_blk[:, 0].transpose(1, 2),
            attn.scaling,
            out[:, 0].permute(0, 3, 1, 2, 4),
        )
    except Exception as error:  # noqa: BLE001 (any failure to build the kernel: FlashAttention's path)
        _one_pass_failed(error)
        return flash(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
    return out.view(B, 1, bs, -1)


def _one_pass_applies(*tensors: torch.Tensor) -> bool:
    return ONE_PASS_FAILED is None and kernels.applies(*tensors)


def _one_pass_failed(error: Exception) -> None:
    global ONE_PASS_FAILED
    ONE_PASS_FAILED = kernels.failure(
        error, "the one-pass Triton attention failed ({}); FlashAttention's variable-length kernel runs"
    )


def _on_backend(backend: SDPBackend) -> Kernel:
    def kernel(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len):
        if not q.is_cuda:
            return sdpa(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
        with sdpa_kernel([backend]):
            return sdpa(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)

    return kernel


KERNELS: dict[str, Kernel] = {
    "reference": reference,
    "sdpa": sdpa,
    "sdpa-efficient": _on_backend(SDPBackend.EFFICIENT_ATTENTION),
    "sdpa-cudnn": _on_backend(SDPBackend.CUDNN_ATTENTION),
    "flash": flash,
    "triton": one_pass,
}


def block_attention(
    attn: DFlashAttention, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len: int | None = None
) -> torch.Tensor:
    """The attention's output before o_proj, [B, m, bs, heads * head_dim], through `KERNEL` where it
    applies (one block per sequence, a context with its block slots) and the reference elsewhere."""
    if KERNEL not in KERNELS:
        raise ValueError(f"block attention kernel {KERNEL!r} is not one of {sorted(KERNELS)}")
    bs = q.shape[2]
    fits = context_len is not None and q.shape[1] == 1 and ctx_k.shape[-2] >= context_len + bs
    kernel = KERNELS[KERNEL] if fits else reference
    return kernel(attn, q, k_blk, v_blk, starts, ctx_k, ctx_v, context_len)
