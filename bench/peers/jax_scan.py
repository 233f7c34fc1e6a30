"""The causal Latte scan of paper 000 (Appendix D, Listing 1), run with JAX on the CPU.

`causal_latte` below is the paper's listing as published (projections included);
`causal_latte_core` is the same scan fed with already-projected Q, K, V, which is
what latte's op computes, so the two are compared on equal work. Rows are
appended to latte-compare's CSV: B=1, H=8, L=64 and D=64 per head (the listing's
L and D are totals split across heads: 512 and 512).

`jax_scan_core_forward_backward` is jax.jit(jax.grad(...)) of the core scan: the
gradients of sum(out * d_out) with respect to Q, K and V (the forward runs inside,
as training runs it), FLOPs 3x the forward's as latte-compare counts them. Reverse
mode through lax.scan keeps every step's L x D carry (B*H*L*D*4 bytes a token,
2 GiB at T = 16K; the process peaked at 15 GB resident there, on a 24 GiB
machine), so it runs up to --backward-max-t.
"""
from functools import partial

import jax
import jax.numpy as jnp

from peer_common import best_time, csv_row, lengths, parser


def accumulate(carry, args):  # Listing 1, lines 15-26
    csum, norm_cumsum, prev_mx = carry
    Qs_t, curr_alph, V_t, c_mx = args
    revert_maxi = jnp.exp(-c_mx + prev_mx)
    add_maxi = jnp.exp(curr_alph - c_mx)
    norm_cumsum = jnp.einsum("BHL,BHL->BHL", norm_cumsum, revert_maxi)
    norm_cumsum += add_maxi
    carry = jnp.einsum("BHLD,BHL->BHLD", csum, revert_maxi)
    carry += jnp.einsum("BHL,BHD->BHLD", add_maxi, V_t)
    y = jnp.einsum("BHL,BHLD->BHD", Qs_t / norm_cumsum, carry)
    return ((carry, norm_cumsum, c_mx), y)


@partial(jax.jit, static_argnums=(3, 5))
def causal_latte(Wq, Wk, Wv, H, X, unroll=100):  # Listing 1, as published
    B, T, D = X.shape
    L = Wk.shape[-1]
    V = jnp.einsum("DM,BTD->TBM", Wv, X).reshape(T, B, H, -1)
    Q = jnp.einsum("DL,BTD->TBL", Wq, X).reshape(T, B, H, -1)
    K = jnp.einsum("DL,BTD->TBL", Wk, X).reshape(T, B, H, -1)
    maxi = jax.lax.cummax(K, axis=0)
    init_alpha = jnp.zeros(shape=(B, H, L // H))
    init_carry = jnp.zeros((B, H, L // H, D // H))
    Qs = jax.nn.softmax(Q, axis=-1)
    _, y = jax.lax.scan(accumulate, unroll=unroll, init=(init_carry, init_alpha, K[0]),
                        xs=[Qs, K, V, maxi])
    y = y.transpose(1, 0, 2, 3)
    return y.reshape(B, T, D)


@partial(jax.jit, static_argnums=(3,))
def causal_latte_core(Q, K, V, unroll=100):  # lines 34-50 on projected [T, B, H, *] inputs
    T, B, H, L = K.shape
    Dv = V.shape[-1]
    maxi = jax.lax.cummax(K, axis=0)
    Qs = jax.nn.softmax(Q, axis=-1)
    _, y = jax.lax.scan(accumulate, unroll=unroll,
                        init=(jnp.zeros((B, H, L, Dv)), jnp.zeros((B, H, L)), K[0]),
                        xs=[Qs, K, V, maxi])
    return y.transpose(1, 0, 2, 3)


def core_loss(Q, K, V, d_out):
    return jnp.sum(causal_latte_core(Q, K, V) * d_out)


core_gradients = jax.jit(jax.grad(core_loss, argnums=(0, 1, 2)))


def run(lengths, min_time, time_cap, backend, backward_max_t=16384):
    """Times both scans at every T in `lengths` and prints latte-compare CSV rows
    labelled `backend`; a scan is skipped once its extrapolated time passes time_cap."""
    B, H, L, D = 1, 8, 64, 64
    key = jax.random.PRNGKey(0)
    previous = {}
    for T in lengths:
        ks = jax.random.split(key, 7)
        X = jax.random.normal(ks[0], (B, T, H * D))
        Wq, Wk = (jax.random.normal(k, (H * D, H * L)) / (H * D) ** 0.5 for k in ks[1:3])
        Wv = jax.random.normal(ks[3], (H * D, H * D)) / (H * D) ** 0.5
        Q, K = (jax.random.normal(k, (T, B, H, L)) for k in ks[4:6])
        V = jax.random.normal(ks[6], (T, B, H, D))
        d_out = jax.random.normal(jax.random.fold_in(key, T), (T, B, H, D))
        flops = 4.0 * B * T * H * L * D
        cases = [("jax_scan_core", flops, lambda: causal_latte_core(Q, K, V)),
                 ("jax_scan_listing1", flops, lambda: causal_latte(Wq, Wk, Wv, H, X))]
        if T <= backward_max_t:
            cases.append(("jax_scan_core_forward_backward", 3 * flops,
                          lambda: core_gradients(Q, K, V, d_out)))
        for name, case_flops, fn in cases:
            if name in previous and previous[name][1] * T / previous[name][0] > time_cap:
                continue
            seconds = best_time(fn, min_time, max_runs=10, wait=jax.block_until_ready)
            previous[name] = (T, seconds)
            print(csv_row(name, "causal", backend, B, T, H, L, D, seconds, case_flops), flush=True)


def main():
    arguments = parser("256,1024,4096,16384,65536", time_cap=60.0, threads=False)
    arguments.add_argument("--backward-max-t", type=int, default=16384)
    args = arguments.parse_args()
    run(lengths(args.t), args.min_time, args.time_cap, "jax",
        args.backward_max_t)


if __name__ == "__main__":
    main()
