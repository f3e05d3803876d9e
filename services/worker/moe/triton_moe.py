"""The mixture-of-experts layer in Triton: one grouped GEMM launch per projection.

Rows (token, k) are grouped by expert into blocks of BLOCK_M rows (routing.group_by_expert), so
one program computes a BLOCK_M x BLOCK_N tile of one expert's product and a launch covers every
expert at once; blocks past the used ones exit at once. The first launch computes gate and up
tiles side by side and stores act(gate) * up (the intermediate never exists unactivated); the
second multiplies by w_down and by each row's routing weight. The k rows of a token are then
summed in a fixed order (deterministic, no atomics). Shapes depend on the token count only and
nothing is read back to the host, so decode steps can be captured in CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from services.worker.attention.triton.common import compute_dtype, dot_precision, next_pow2
from services.worker.moe.backend import check_moe_args
from services.worker.moe.routing import ExpertGroups, group_by_expert, route


@triton.jit
def _block_rows(rows_by_expert, block_expert, num_rows, BLOCK_M: tl.constexpr):
    """-> (expert of program_id(0)'s block or -1, its row ids, which of them are real)."""
    block = tl.program_id(0)
    expert = tl.load(block_expert + block)
    rows = tl.load(rows_by_expert + block * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, rows.to(tl.int64), rows < num_rows


@triton.jit
def _gate_up_kernel(hidden, w_gate_up, act, rows_by_expert, block_expert, num_rows, top_k,
                    hidden_size, intermediate, stride_ht, stride_we, stride_wn, stride_at,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    DTYPE: tl.constexpr, PRECISION: tl.constexpr, GELU: tl.constexpr):
    """act[row, n] = a(x . gate[n]) * (x . up[n]), x = hidden[row // top_k], a SiLU or (GELU)
    tanh-approximated GELU = g * sigmoid(2 sqrt(2 / pi) (g + 0.044715 g^3))."""
    expert, rows, row_ok = _block_rows(rows_by_expert, block_expert, num_rows, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < intermediate
    x_rows = hidden + (rows // top_k) * stride_ht
    gate_cols = w_gate_up + expert.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    up_cols = gate_cols + intermediate * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden_size
        x = tl.load(x_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(DTYPE)                                    # [BLOCK_M, BLOCK_K]
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(gate_cols[None, :] + k[:, None], mask=w_mask, other=0.0).to(DTYPE)
        up = tl.load(up_cols[None, :] + k[:, None], mask=w_mask, other=0.0).to(DTYPE)
        acc_gate += tl.dot(x, gate, input_precision=PRECISION)
        acc_up += tl.dot(x, up, input_precision=PRECISION)
    if GELU:
        z = 1.5957691216057308 * (acc_gate + 0.044715 * acc_gate * acc_gate * acc_gate)
    else:
        z = acc_gate
    y = acc_gate / (1.0 + tl.exp(-z)) * acc_up
    tl.store(act + rows[:, None] * stride_at + n[None, :], y.to(act.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(act, w_down, out, row_weights, rows_by_expert, block_expert, num_rows,
                 hidden_size, intermediate, stride_at, stride_we, stride_wn, stride_ot,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """out[row, n] = weight[row] * (act[row] . down[n])."""
    expert, rows, row_ok = _block_rows(rows_by_expert, block_expert, num_rows, BLOCK_M)
    if expert < 0:
        return
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden_size
    a_rows = act + rows * stride_at
    w_cols = w_down + expert.to(tl.int64) * stride_we + n.to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, intermediate, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < intermediate
        a = tl.load(a_rows[:, None] + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0).to(DTYPE)
        w = tl.load(w_cols[None, :] + k[:, None], mask=k_ok[:, None] & n_ok[None, :],
                    other=0.0).to(DTYPE)
        acc += tl.dot(a, w, input_precision=PRECISION)
    weight = tl.load(row_weights + rows, mask=row_ok, other=0.0)
    tl.store(out + rows[:, None] * stride_ot + n[None, :],
             (acc * weight[:, None]).to(out.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def choose_block_m(num_rows: int, num_experts: int) -> int:
    """Rows per block: about the mean group size, 16..64 (a tl.dot needs >= 16 rows; bigger
    blocks reuse each weight tile over more rows but pad small groups more)."""
    return min(64, max(16, next_pow2(-(-num_rows // num_experts))))


def choose_block_n(num_rows: int) -> int:
    """Output columns per program: decode-sized steps touch few experts, so narrower tiles give
    more programs to stream those experts' weights in parallel. A first guess, for the GPU
    bench (bench/gpu/moe.py) to tune."""
    return 32 if num_rows <= 64 else 64


def _block_k(width: int) -> int:
    return min(64, max(16, next_pow2(width)))


class TritonFusedMoE:
    name = "triton"

    def __init__(self, block_n: int | None = None):
        """block_n: output columns per program (default: choose_block_n)."""
        self.block_n = block_n

    def __call__(self, hidden: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor, top_k: int, renormalize: bool,
                 activation: str = "silu") -> torch.Tensor:
        check_moe_args(hidden, router_logits, w_gate_up, w_down, top_k, activation)
        for name, t in (("hidden", hidden), ("w_gate_up", w_gate_up), ("w_down", w_down)):
            if t.stride(-1) != 1:
                raise ValueError(f"{name} must be contiguous in its last dimension")
        num_tokens, hidden_size = hidden.shape
        if num_tokens == 0:
            return torch.empty_like(hidden)
        routing = route(router_logits, top_k, renormalize)
        num_experts = w_gate_up.shape[0]
        groups = group_by_expert(routing.experts, num_experts,
                                 choose_block_m(num_tokens * top_k, num_experts))
        return self.experts(hidden, routing.weights.flatten(), groups, w_gate_up, w_down,
                            activation).view(num_tokens, top_k, hidden_size).sum(1)

    def experts(self, hidden: torch.Tensor, row_weights: torch.Tensor, groups: ExpertGroups,
                w_gate_up: torch.Tensor, w_down: torch.Tensor, activation: str) -> torch.Tensor:
        """-> [num_rows, hidden_size]: each row's expert output times its routing weight."""
        num_tokens, hidden_size = hidden.shape
        intermediate = w_down.shape[2]
        top_k = groups.num_rows // num_tokens
        dtype = compute_dtype(w_gate_up.dtype)
        block_n = self.block_n or choose_block_n(groups.num_rows)
        common = dict(BLOCK_M=groups.block_m, BLOCK_N=block_n, DTYPE=dtype,
                      PRECISION=dot_precision(dtype))
        num_blocks = groups.block_expert.shape[0]
        act = torch.empty(groups.num_rows, intermediate, dtype=hidden.dtype, device=hidden.device)
        _gate_up_kernel[(num_blocks, triton.cdiv(intermediate, block_n))](
            hidden, w_gate_up, act, groups.rows, groups.block_expert, groups.num_rows, top_k,
            hidden_size, intermediate, hidden.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
            act.stride(0), BLOCK_K=_block_k(hidden_size), GELU=activation == "gelu_tanh", **common)
        out = torch.empty(groups.num_rows, hidden_size, dtype=hidden.dtype, device=hidden.device)
        _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
            act, w_down, out, row_weights, groups.rows, groups.block_expert, groups.num_rows,
            hidden_size, intermediate, act.stride(0), w_down.stride(0), w_down.stride(1),
            out.stride(0), BLOCK_K=_block_k(intermediate), **common)
        return out
