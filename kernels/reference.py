"""Pure-PyTorch references of the data-movement ops. They define the semantics that the C++, CUDA and
Triton implementations must match exactly (data movement has no rounding, so tests compare bit for bit).
"""

import torch


def gather_rows_ref(src: torch.Tensor, row_idx: torch.Tensor) -> torch.Tensor:
    """Pack rows: `src: [N, H]`, `row_idx: [T]` -> `[T, H]` with `out[i] = src[row_idx[i]]`."""
    return src.index_select(0, row_idx.long())


def scatter_rows_ref(dst: torch.Tensor, row_idx: torch.Tensor, src: torch.Tensor) -> None:
    """Unpack rows in place: `dst: [N, H]`, `src: [T, H]`, `dst[row_idx[i]] = src[i]`; indices unique."""
    dst.index_copy_(0, row_idx.long(), src)


def gather_host_rows_ref(dst: torch.Tensor, src: torch.Tensor, src_offsets: torch.Tensor,
                         dst_rows: torch.Tensor) -> None:
    """Copy rows out of a host arena in place: `dst: [N, H]` (any dtype, unit stride along H),
    `src: [capacity]` uint8, `src_offsets, dst_rows: [n]` int64; the bytes of `dst[dst_rows[i]]` become
    `src[src_offsets[i] : src_offsets[i] + H * dst.element_size()]`."""
    row_bytes = dst.shape[1] * dst.element_size()
    byte_idx = src_offsets.long()[:, None] + torch.arange(row_bytes)
    rows = src[byte_idx].to(dst.device)  # [n, row_bytes] uint8
    dst.view(torch.uint8).index_copy_(0, dst_rows.long().to(dst.device), rows)


def rope_pairs_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """diffusers' Flux RoPE (`apply_rotary_emb`, use_real, pairs (2i, 2i+1)): `x: [..., S, heads, d]`,
    `cos, sin: [S, d]` -> x's shape and dtype."""
    from diffusers.models.embeddings import apply_rotary_emb

    if x.numel() == 0:  # diffusers cannot reshape an empty tensor
        return x.clone()
    batch = x.shape[:-3].numel()
    flat = x.reshape(batch, *x.shape[-3:])
    return apply_rotary_emb(flat, (cos, sin), sequence_dim=1).reshape(x.shape)


def rms_norm_rope_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
                      sin: torch.Tensor | None) -> torch.Tensor:
    """An attention q/k norm (`torch.rms_norm` over the last dimension) and then, given tables, the Flux
    RoPE of `rope_pairs_ref`: `x: [..., S, heads, d]`, `cos, sin: [S, d]` (or None)."""
    normed = torch.nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    return normed if cos is None else rope_pairs_ref(normed, cos, sin)


def sdpa_ragged_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths_q, lengths_k,
                    scale: float) -> torch.Tensor:
    """Each request's queries against its keys: `q: [T_q, heads, d]`, `k, v: [T_k, heads, d]` split by
    the host `lengths_*`; a request without keys gets zeros."""
    outputs = []
    for qb, kb, vb in zip(q.split(list(lengths_q)), k.split(list(lengths_k)), v.split(list(lengths_k))):
        if kb.shape[0] == 0:
            outputs.append(torch.zeros_like(qb))
            continue
        out = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (qb, kb, vb)),
                                                               scale=scale)
        outputs.append(out[0].transpose(0, 1))
    return torch.cat(outputs)
