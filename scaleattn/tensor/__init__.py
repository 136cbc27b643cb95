"""Tensor (2-simplicial) attention: exact streamed forward/backward and the polynomial fast path.

Math: DESIGN §8, after [C25] Y. Cao, Y. Liang, Z. Shi, Z. Song, "Training Tensor Attention Efficiently: From Cubic
to Almost Linear Time", arXiv:2405.16411 (Def. of tensor attention, §3-§4; gradient, §4-§5), which builds on the
polynomial method of J. Alman and Z. Song, "How to Capture Higher-order Correlations? Generalizing Matrix Softmax
Attention to Kronecker Computation", ICLR 2024, arXiv:2310.04064.

For Q, K1, K2, V1, V2 of shape (..., n, d) (leading axes = batch and heads):

    S[i,j,k] = s <q_i, k1_j * k2_k>,  P[i,j,k] = exp(S[i,j,k]) / sum_{j',k'} exp(S[i,j',k']),
    O_i = sum_{j,k} P[i,j,k] (v1_j * v2_k)          i.e.  Att = D^-1 A (V1 (/) V2)

with s = 1/d by default ([C25]), ``scale="sqrt"`` for 1/sqrt(d), or any finite float.

Masks (``causal`` / ``window``), our convention: with ``causal=True`` query i sees the pairs (j, k) with j <= i and
k <= i. ``window=(w1, w2)`` gives causal *windows*: i - w1 < j <= i and i - w2 < k <= i (so w = 1 means "only the
query's own position"; a ``None`` entry means unbounded on that side). A window always implies the causal mask,
whatever ``causal`` says. Every query row keeps at least the pair (i, i), so no row is empty.

Exact path: streamed over (query, key1, key2) blocks with an online softmax (running row max m_i and row sum l_i,
as in FlashAttention) so memory is O(n d + block) rather than n^3; the backward recomputes P per block from the
saved log-sum-exp. Windowed attention only visits blocks that intersect the windows: O(n w1 w2 d) time.

Fast path (``poly_*``): exp(S) is replaced by its Taylor polynomial of degree g. Because
exp(s <q, k1*k2>) = exp(sum_t x_t) with x_t = s q_t k1_t k2_t, the multinomial expansion gives
T_g(S) = sum_{|alpha|<=g} (s q)^alpha / alpha! * k1^alpha * k2^alpha = U1 (U2 (/) U3)^T with rank
r = C(d+g, g) [Alman & Song, Lemma on low-rank exp approximation; C25 §5]. With
(A (/) B)^T (C (/) D) = (A^T C) * (B^T D) the forward and all five gradients cost O(n r d) time and
O(block*r + r*d) memory. With ``causal=True`` the r x d key statistics become prefix sums over j, k <= i (and the
backward needs suffix sums over queries i >= j), still O(n r d) time, O(block*r*d + r*d) memory
(``_poly_core_causal``); finite windows are not implemented on this path. It is only accurate while the logits
are bounded (C25: |S| <= o(log n) regime); outside it
no subcubic algorithm exists under SETH, so we detect it and fall back to the exact path or refuse (``on_large``).

Error estimate (a-priori, used by ``poly_error_bound`` and ``degree="auto"``): with |S| <= B,
|T_g(x) - e^x| <= eps_g e^x for |x| <= B where eps_g = e^B B^(g+1) / (g+1)! (Lagrange remainder). If eps_g < 1 the
approximate row sums are positive and every row of the attention matrix moves by at most
||P~_i - P_i||_1 <= 2 eps_g / (1 - eps_g), so |O~ - O| <= 2 eps_g/(1 - eps_g) * max|V1| * max|V2| entrywise.

All arithmetic is float64 (DESIGN §3); outputs are cast back to the inputs' common float dtype. Arrays may be numpy,
CuPy, torch or any array API array, all in one namespace and on one device (``scaleattn._backend.get_xp``); the
code path is the same, written against the array API standard, and the outputs stay on the inputs' device.
"""
from __future__ import annotations

from .bounds import choose_degree, logit_bound, poly_error_bound
from .exact import attention, attention_grad
from .poly import poly_attention, poly_attention_grad
from .weights import TensorWeights, khatri_rao, train, weight_grad

__all__ = [
    "attention",
    "attention_grad",
    "poly_attention",
    "poly_attention_grad",
    "poly_error_bound",
    "logit_bound",
    "choose_degree",
    "TensorWeights",
    "khatri_rao",
    "weight_grad",
    "train",
]
