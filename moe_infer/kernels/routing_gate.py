"""Raw Triton kernel: fused router gating (scores -> optional grouped top-k -> top-k -> weights).

Legend: T tokens, E experts, K top-k, G expert groups (`n_group`).
One program handles BLOCK_T tokens and holds their [BLOCK_T, BLOCK_E] scores in registers.
Every top-k step is an argmax that breaks ties toward the lowest expert id, so the order of the K
outputs equals a stable descending sort (the PyTorch reference, `select_experts_torch`).
Launch wrapper: `moe_infer.routing.triton_select.select_experts_triton`.
"""
import triton
import triton.language as tl

from moe_infer.kernels.pdl import pdl_enter

MASKED = tl.constexpr(-3.0e38)  # choice of an expert outside the kept groups: below any score (+ bias), above a taken one


@triton.jit
def _ordered_key(x):
    """int32 keys with the order of the fp32 values x (an involution on the bits, NaN aside): integer max/min
    reduce across a warp in one `redux.sync` on sm_80+, where fp32 needs five shuffles."""
    b = x.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _key_value(key):
    """Inverse of `_ordered_key`: the fp32 value of a key."""
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _argmax_lowest(x, cand, cols, BIG: tl.constexpr):
    """Per row: (max of x over cand, lowest column holding it). x [B, C], cand bool [B, C]."""
    m = tl.max(tl.where(cand, x, float("-inf")), axis=1)
    idx = tl.min(tl.where(cand & (x == m[:, None]), cols[None, :], BIG), axis=1)
    return m, idx


@triton.jit
def _group_scores_loop(choice_BE, valid_BE, cols_E, gcols_G, per_group, G: tl.constexpr, HAS_BIAS: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_E: tl.constexpr):
    """[BLOCK_T, BLOCK_G] group scores for any E divisible by G: one masked pass per group."""
    group_E = cols_E // per_group
    gscore_BG = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
    for g in tl.static_range(G):
        in_g_BE = (group_E[None, :] == g) & valid_BE
        m1_B, i1_B = _argmax_lowest(choice_BE, in_g_BE, cols_E, BLOCK_E)
        if HAS_BIAS:  # DeepSeek-V3: a group's score is the sum of its top-2 experts
            m2_B = tl.max(tl.where(in_g_BE & (cols_E[None, :] != i1_B[:, None]), choice_BE, float("-inf")), axis=1)
            if per_group < 2:
                m2_B = tl.zeros_like(m1_B)
            s_B = m1_B + m2_B
        else:
            s_B = m1_B
        gscore_BG = tl.where(gcols_G[None, :] == g, s_B[:, None], gscore_BG)
    return gscore_BG


@triton.jit
def _group_scores_reshape(key_BE, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, G: tl.constexpr, PER_G: tl.constexpr):
    """Same scores as `_group_scores_loop` (from the choices' ordered keys) when E = G * PER_G, both powers of 2."""
    k_BGe = tl.reshape(key_BE, (BLOCK_T, G, PER_G))
    m1_BG = tl.max(k_BGe, axis=2)
    if HAS_BIAS:
        j_e = tl.arange(0, PER_G)[None, None, :]
        i1_BG = tl.min(tl.where(k_BGe == m1_BG[:, :, None], j_e, PER_G), axis=2)  # first (lowest) argmax
        m2_BG = tl.max(tl.where(j_e == i1_BG[:, :, None], -2147483648, k_BGe), axis=2)
        if PER_G < 2:
            return _key_value(m1_BG)
        return _key_value(m1_BG) + _key_value(m2_BG)
    return _key_value(m1_BG)


@triton.jit(do_not_specialize=["T", "num_slots"])
def routing_gate_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, tile_counts_ptr, hist_ptr, within_ptr, sorted_rows_ptr,
    T, E, stride_lt, stride_le, routed_scaling_factor, num_slots,
    K: tl.constexpr, G: tl.constexpr, TOPK_GROUP: tl.constexpr,
    IS_SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr, GROUP_RESHAPE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    TILE_COUNTS: tl.constexpr, FILL: tl.constexpr, GROUP_TILES: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    """TILE_COUNTS: also the permutation's launch 1 for this program's BLOCK_T*K routed rows (one tile):
    within[t, e] (int8 [T, BLOCK_E]) <- the tile's tokens before t that chose e, FILL padded slots of sorted_rows <- the sentinel
    T*K, and the tile's expert histogram: GROUP_TILES == 1: tile_counts[pid, e] <- rows of expert e;
    else hist[pid, e] (int8) <- rows of expert e, and tile_counts[pid // GROUP_TILES, e] += the same
    (atomics into a zeroed buffer: integer sums, deterministic), so the scan sees one row per group.
    USE_PDL: launched with programmatic dependent launch (`moe_infer.kernels.pdl`)."""
    pdl_enter(USE_PDL)
    pid = tl.program_id(0)
    t_B = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols_E = tl.arange(0, BLOCK_E)
    is_tok_B = t_B < T
    is_col_E = cols_E < E
    mask_BE = is_tok_B[:, None] & is_col_E[None, :]
    x_BE = tl.load(
        logits_ptr + t_B[:, None] * stride_lt + cols_E[None, :] * stride_le, mask=mask_BE, other=0.0
    ).to(tl.float32)  # bf16/fp16 arithmetic is not used anywhere: upcast once
    x_BE = tl.where(is_col_E[None, :], x_BE, float("-inf"))  # padding columns; padding tokens read 0

    if IS_SIGMOID:
        scores_BE = tl.sigmoid(x_BE)
    else:
        xmax_B = tl.max(x_BE, axis=1)
        e_BE = tl.exp(x_BE - xmax_B[:, None])
        xsum_B = tl.sum(e_BE, axis=1)
        scores_BE = e_BE / xsum_B[:, None]
    scores_BE = tl.where(mask_BE, scores_BE, 0.0)
    if HAS_BIAS:
        bias_E = tl.load(bias_ptr + cols_E, mask=is_col_E, other=0.0).to(tl.float32)
        choice_BE = scores_BE + bias_E[None, :]
    else:
        choice_BE = scores_BE
    valid_BE = is_col_E[None, :] & (t_B[:, None] >= 0)  # [BLOCK_T, BLOCK_E]: real expert columns
    choice_BE = tl.where(valid_BE, choice_BE, float("-inf"))

    if G > 1:  # DeepSeek grouped top-k: keep the TOPK_GROUP best groups, mask the others
        gcols_G = tl.arange(0, BLOCK_G)
        if GROUP_RESHAPE:  # E == BLOCK_E and G a power of 2: one [BLOCK_T, G, E/G] pass per statistic
            gscore_BG = _group_scores_reshape(_ordered_key(choice_BE), HAS_BIAS, BLOCK_T, BLOCK_G, BLOCK_E // BLOCK_G)
        else:
            gscore_BG = _group_scores_loop(choice_BE, valid_BE, cols_E, gcols_G, E // G, G, HAS_BIAS, BLOCK_T, BLOCK_G, BLOCK_E)
        gkey_BG = _ordered_key(gscore_BG)
        gcolidx_G = tl.where(gcols_G < G, gcols_G, BLOCK_G)  # padding groups never win a tie
        for _j in tl.static_range(TOPK_GROUP):  # a kept group's key drops to INT_MIN
            gm_B = tl.max(gkey_BG, axis=1)
            gi_B = tl.min(tl.where(gkey_BG == gm_B[:, None], gcolidx_G[None, :], BLOCK_G), axis=1)
            gkey_BG = tl.where(gcols_G[None, :] == gi_B[:, None], -2147483648, gkey_BG)
        gtaken_BG = gkey_BG == -2147483648
        if GROUP_RESHAPE:
            keep_BGe = tl.broadcast_to(gtaken_BG[:, :, None], (BLOCK_T, BLOCK_G, BLOCK_E // BLOCK_G))
            keep_BE = tl.reshape(keep_BGe, (BLOCK_T, BLOCK_E))
        else:
            group_E = cols_E // (E // G)
            keep_BE = cols_E[None, :] < 0
            for g in tl.static_range(G):
                kept_B = tl.sum(tl.where(gtaken_BG & (gcols_G[None, :] == g), 1, 0), axis=1) > 0
                keep_BE = keep_BE | ((group_E[None, :] == g) & kept_B[:, None])
        choice_BE = tl.where(keep_BE, choice_BE, MASKED)  # finite: ties among masked experts go to the lowest id
        choice_BE = tl.where(is_col_E[None, :], choice_BE, float("-inf"))

    kcols_K = tl.arange(0, BLOCK_K)
    out_mask_BK = is_tok_B[:, None] & (kcols_K[None, :] < K)
    colidx_E = tl.where(is_col_E, cols_E, BLOCK_E)  # padding columns never win a tie
    ids_BK = tl.zeros((BLOCK_T, BLOCK_K), tl.int32)
    w_BK = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    key_BE = _ordered_key(choice_BE)
    for k in tl.static_range(K):  # the k-th pick drops to INT_MIN + k, below every real (or group-masked) choice
        m_B = tl.max(key_BE, axis=1)
        idx_B = tl.min(tl.where(key_BE == m_B[:, None], colidx_E[None, :], BLOCK_E), axis=1)
        key_BE = tl.where(cols_E[None, :] == idx_B[:, None], -2147483648 + k, key_BE)
        ids_BK = tl.where(kcols_K[None, :] == k, idx_B[:, None], ids_BK)
        if not (HAS_BIAS or G > 1):  # the choice is the score itself
            w_BK = tl.where(kcols_K[None, :] == k, _key_value(m_B)[:, None], w_BK)
    if HAS_BIAS or G > 1:  # the weight is the chosen expert's score: recompute it from its logit (same ops, same bits)
        xk_BK = tl.load(logits_ptr + t_B[:, None] * stride_lt + ids_BK * stride_le, mask=out_mask_BK, other=0.0)
        xk_BK = xk_BK.to(tl.float32)
        if IS_SIGMOID:
            w_BK = tl.sigmoid(xk_BK)
        else:
            w_BK = tl.exp(xk_BK - xmax_B[:, None]) / xsum_B[:, None]
        w_BK = tl.where(kcols_K[None, :] < K, w_BK, 0.0)  # padding columns stay out of the renormalisation
    if RENORMALIZE:
        w_BK = w_BK / tl.maximum(tl.sum(w_BK, axis=1), 1e-20)[:, None]
    w_BK = w_BK * routed_scaling_factor

    offs_BK = t_B[:, None] * K + kcols_K[None, :]
    tl.store(weights_ptr + offs_BK, w_BK, mask=out_mask_BK)
    tl.store(ids_ptr + offs_BK, ids_BK, mask=out_mask_BK)
    if TILE_COUNTS:  # the chosen experts are exactly the knocked-out keys
        is_taken_BE = (key_BE < -2147483648 + K) & is_tok_B[:, None]  # the k-th pick holds INT_MIN + k (k < K)
        if BLOCK_T * BLOCK_E > 1024:  # counts <= BLOCK_T < 256: PACK neighbouring experts share an int64
            # (8 bits each), so the cross-warp sum and scan over the tile's tokens move PACK times fewer words
            PACK: tl.constexpr = 8 if BLOCK_E >= 8 else BLOCK_E
            shift_j = tl.arange(0, PACK).to(tl.int64) * 8
            taken_BCj = tl.reshape(is_taken_BE.to(tl.int64), (BLOCK_T, BLOCK_E // PACK, PACK))
            taken_BC = tl.sum(taken_BCj << shift_j[None, None, :], axis=2)
            total_C = tl.sum(taken_BC, axis=0)
            before_BC = tl.cumsum(taken_BC, axis=0) - taken_BC  # earlier tokens of the tile choosing each expert
            counts_E = tl.reshape((total_C[:, None] >> shift_j[None, :]) & 255, (BLOCK_E,)).to(tl.int32)
            before_BE = tl.reshape((before_BC[:, :, None] >> shift_j[None, None, :]) & 255, (BLOCK_T, BLOCK_E))
        else:  # a few rows in one warp: plain counts
            taken_BE = is_taken_BE.to(tl.int32)
            counts_E = tl.sum(taken_BE, axis=0)
            before_BE = tl.cumsum(taken_BE, axis=0) - taken_BE
        if GROUP_TILES == 1:
            tl.store(tile_counts_ptr + pid * BLOCK_E + cols_E, counts_E)
        else:
            tl.store(hist_ptr + pid * BLOCK_E + cols_E, counts_E.to(tl.int8))
            tl.atomic_add(tile_counts_ptr + (pid // GROUP_TILES) * BLOCK_E + ids_BK, 1, mask=out_mask_BK, sem="relaxed")
        # dense int8 [T, BLOCK_E] (a masked store of the K taken columns costs more): the scatter reads
        # within[t, e] for its rows
        tl.store(within_ptr + t_B[:, None] * BLOCK_E + cols_E[None, :], before_BE.to(tl.int8), mask=is_tok_B[:, None])
        p_F = pid * FILL + tl.arange(0, FILL)
        tl.store(sorted_rows_ptr + p_F, tl.full((FILL,), 0, tl.int32) + T * K, mask=p_F < num_slots)
