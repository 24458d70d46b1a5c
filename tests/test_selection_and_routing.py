"""MSA block selection (`msa.index_scores`, `msa.block_scores`, `msa.select_blocks`, `msa.select_blocks_chunked`)
and MoE routing (`moe.route`) against naive Python loops written from the spec (`model.md`, "MiniMax Sparse
Attention" and "Feed-forward"), on small random inputs.

The expected values are computed here, independently: plain loops over batch, heads, tokens, keys, blocks and experts,
in Python floats (float64); the functions under test only produce the values compared. Inputs are integer-valued
where the comparison must be exact (sums of small integer products are exact in fp32 and float64 alike, whatever the
summation order), which also makes ties: equal block scores and equal routing scores.

Ties. The order of tied entries, and which of the tied entries fill the last slots when there are more of them than
slots, are implementation-defined (`torch.topk`; the docstrings of `route` and `msa` say so, and the spec asks only
for "the largest"). So a selection is compared slot by slot on its scores (descending, the same multiset as the naive
top-k), as a set within each group of tied scores, and exactly (ids in order) where no scores tie.
"""

from __future__ import annotations

import math

import pytest
import torch

from minimax_ref.errors import ConfigError
from minimax_ref.model.moe import route
from minimax_ref.model.msa import block_scores, index_scores, select_blocks, select_blocks_chunked

INF = math.inf

# ---------------------------------------------------------------------------------------------- naive MSA


def naive_index_scores(iq: list, ik: list, q_pos: list) -> list:
    """s[b][h][t][l] = sum_d iq[b][t][h][d] * ik[b][l][d], -inf where key l > q_pos[b][t]."""
    out = []
    for b in range(len(iq)):
        per_head = []
        for h in range(len(iq[b][0])):
            rows = []
            for t in range(len(iq[b])):
                row = []
                for key in range(len(ik[b])):
                    if key > q_pos[b][t]:
                        row.append(-INF)
                    else:
                        row.append(sum(a * c for a, c in zip(iq[b][t][h], ik[b][key])))
                rows.append(row)
            per_head.append(rows)
        out.append(per_head)
    return out


def naive_block_row(scores: list, pos: int, block_size: int, local_blocks: int, init_blocks: int) -> list:
    """Block scores of one query: the max of each block's keys (the last block may be partial), +inf for the
    `local_blocks` blocks ending at the query's block and the first `init_blocks` blocks at or before it."""
    num_blocks = -(-len(scores) // block_size)
    q_block = pos // block_size
    row = []
    for j in range(num_blocks):
        best = -INF
        for key in range(j * block_size, min((j + 1) * block_size, len(scores))):
            best = max(best, scores[key])
        if q_block - local_blocks < j <= q_block or (j < init_blocks and j <= q_block):
            best = INF
        row.append(best)
    return row


def naive_block_scores(scores: list, q_pos: list, block_size: int, local_blocks: int, init_blocks: int) -> list:
    return [[[naive_block_row(scores[b][h][t], q_pos[b][t], block_size, local_blocks, init_blocks)
              for t in range(len(scores[b][h]))] for h in range(len(scores[b]))] for b in range(len(scores))]


def naive_topk(values: list, k: int) -> list:
    """The k largest entries with a score above -inf, as (id, score) in descending score order (ties by id: one of
    the orders the comparison accepts)."""
    order = sorted((j for j in range(len(values)) if values[j] > -INF), key=lambda j: (-values[j], j))
    return [(j, values[j]) for j in order[:k]]


def check_selection(got: list, values: list, k: int, tol: float = 0.0) -> None:
    """`got` (k ids, -1 = empty slot) is a top-k of `values` (-inf = not selectable): the valid ids left-packed and
    distinct, their scores slot by slot those of the naive top-k (so descending, and the same multiset), every entry
    scoring above the k-th score selected, and the ids exactly the naive ones where no score in it ties. Scores within
    `tol` count as tied (routing compares fp32 scores with float64 ones)."""
    expected = naive_topk(values, k)
    n = len(expected)
    assert len(got) == k
    assert got[n:] == [-1] * (k - n), f"{got}: slots past the {n} selectable entries must be -1"
    chosen = got[:n]
    assert min(chosen, default=0) >= 0 and len(set(chosen)) == n, f"{got}: ids must be valid and distinct"
    for slot, (g, (_, score)) in enumerate(zip(chosen, expected)):
        assert values[g] == pytest.approx(score, abs=tol, rel=0), f"slot {slot}: {got} vs {expected}"
    if n:
        last = expected[-1][1]
        above = {j for j in range(len(values)) if values[j] > last + tol}
        assert above <= set(chosen), f"{got}: every entry above the k-th score ({last}) must be chosen"

    def ties(j: int) -> int:  # entries scoring as entry j (itself included; +inf equals +inf)
        return sum(values[i] == values[j] or abs(values[i] - values[j]) <= tol
                   for i in range(len(values)) if values[i] > -INF)

    for slot, (j, _) in enumerate(expected):
        if ties(j) == 1:
            assert chosen[slot] == j, f"slot {slot}: untied entry {j} expected, got {got}"


def make_ints(shape: tuple, generator: torch.Generator, low: int = -3, high: int = 3) -> torch.Tensor:
    return torch.randint(low, high + 1, shape, generator=generator).float()


def query_positions(batch: int, L: int, block_size: int, generator: torch.Generator) -> torch.Tensor:
    """Positions per batch row: the first block (0, 1, block_size - 1), the second block's first key, the last key
    (in the last, partial block) and random ones; each row its own."""
    fixed = [0, 1, block_size - 1, block_size, L - 1]
    rows = [fixed + torch.randint(0, L, (3,), generator=generator).tolist() for _ in range(batch)]
    rows[-1] = rows[-1][::-1]
    return torch.tensor(rows)


# (block_size, L, topk, local_blocks, init_blocks): every L leaves a last partial block
SELECTION_CASES = {
    "default-local": (8, 45, 3, 1, 0),
    "local2-init2": (8, 61, 4, 2, 2),
    "local3-init1": (4, 30, 5, 3, 1),
    "topk-over-blocks": (8, 20, 16, 1, 0),  # 3 blocks: k = min(16, 3)
    "topk1-init1": (4, 23, 1, 1, 1),
}


def test_index_scores_float_against_loops():
    """Index scores of random float queries and keys: fp32 dot products (within fp32 rounding of the float64 loop
    sums), exactly -inf at every future key and only there."""
    g = torch.Generator().manual_seed(0)
    B, T, Hi, Di, L = 2, 6, 3, 16, 19
    iq, ik = torch.randn(B, T, Hi, Di, generator=g), torch.randn(B, L, Di, generator=g)
    q_pos = torch.tensor([[0, 3, 7, 8, 15, 18], [18, 2, 0, 11, 5, 9]])
    got = index_scores(iq, ik, q_pos)
    assert got.dtype == torch.float32 and got.shape == (B, Hi, T, L)
    want = naive_index_scores(iq.tolist(), ik.tolist(), q_pos.tolist())
    for b in range(B):
        for h in range(Hi):
            for t in range(T):
                for key in range(L):
                    w, v = want[b][h][t][key], got[b, h, t, key].item()
                    if w == -INF:
                        assert v == -INF, (b, h, t, key)
                    else:
                        assert v == pytest.approx(w, rel=1e-5, abs=1e-5), (b, h, t, key)


def test_index_scores_bf16_inputs_scored_in_fp32():
    """bf16 queries and keys are scored in fp32: integer values whose products sum past bf16's 8 mantissa bits
    (257 is not a bf16 value) come out exact."""
    iq = torch.full((1, 1, 1, 2), 16.0, dtype=torch.bfloat16)
    ik = torch.tensor([[[16.0, 0.0625]]], dtype=torch.bfloat16)  # 16 * 16 + 16 * 0.0625 = 257
    assert index_scores(iq, ik, torch.tensor([[0]])).item() == 257.0


@pytest.mark.parametrize("values", ["ints", "floats"])
@pytest.mark.parametrize("case", list(SELECTION_CASES))
def test_block_scores_and_select_blocks_against_loops(case, values):
    """`block_scores` and `select_blocks` on the same index scores as the loops: block maxima exactly, the forced
    blocks at +inf, and a top-k that checks as above (ties among integer scores and the +inf forced blocks: sets)."""
    bs, L, topk, local, init = SELECTION_CASES[case]
    g = torch.Generator().manual_seed(list(SELECTION_CASES).index(case) * 2 + (values == "floats"))
    B, Hi, Di = 2, 2, 4
    q_pos = query_positions(B, L, bs, g)
    T = q_pos.shape[1]
    if values == "ints":
        iq, ik = make_ints((B, T, Hi, Di), g), make_ints((B, L, Di), g)
    else:
        iq, ik = torch.randn(B, T, Hi, Di, generator=g), torch.randn(B, L, Di, generator=g)
    # the scores fed to both: the naive loop's (float64 -> fp32 tensor), so both see the same values
    naive = naive_index_scores(iq.tolist(), ik.tolist(), q_pos.tolist())
    scores = torch.tensor(naive, dtype=torch.float32)
    scores32 = scores.tolist()  # the fp32 values, as the loops below read them
    want_blocks = naive_block_scores(scores32, q_pos.tolist(), bs, local, init)
    got_blocks = block_scores(scores, q_pos, bs, local, init)
    assert got_blocks.tolist() == want_blocks

    got = select_blocks(scores, q_pos, bs, topk, local, init)
    k = min(topk, -(-L // bs))
    assert got.dtype == torch.long and got.shape == (B, Hi, T, k)
    for b in range(B):
        for h in range(Hi):
            for t in range(T):
                check_selection(got[b, h, t].tolist(), want_blocks[b][h][t], k)


@pytest.mark.parametrize("case", list(SELECTION_CASES))
def test_selection_end_to_end_against_loops(case):
    """From integer index queries and keys to block ids: `select_blocks(index_scores(...))` and
    `select_blocks_chunked` at several chunk sizes, against the loops from the same iq / ik (exact: integer sums)."""
    bs, L, topk, local, init = SELECTION_CASES[case]
    g = torch.Generator().manual_seed(len(case) * 1000 + L)
    B, Hi, Di = 2, 2, 8
    q_pos = query_positions(B, L, bs, g)
    T = q_pos.shape[1]
    iq, ik = make_ints((B, T, Hi, Di), g), make_ints((B, L, Di), g)
    want = naive_block_scores(naive_index_scores(iq.tolist(), ik.tolist(), q_pos.tolist()), q_pos.tolist(), bs,
                              local, init)
    k = min(topk, -(-L // bs))
    candidates = [select_blocks(index_scores(iq, ik, q_pos), q_pos, bs, topk, local, init)]
    candidates += [select_blocks_chunked(iq, ik, q_pos, bs, topk, local, init, chunk) for chunk in (1, 3, T)]
    for got in candidates:
        for b in range(B):
            for h in range(Hi):
                for t in range(T):
                    check_selection(got[b, h, t].tolist(), want[b][h][t], k)


def test_select_blocks_by_hand():
    """A worked example (block size 4, 10 keys: blocks 0, 1 and a partial block 2 of keys 8, 9; top-2; one head):
    the local block first (+inf), then the best other causal block; a query in the first block has one causal block,
    so its second slot is -1; with init_blocks=1 block 0 is forced too; with local_blocks=2 the block before the
    query's is forced too."""
    s = [5.0, 1.0, 0.0, 2.0, 3.0, 9.0, 1.0, 0.0, 4.0, 7.0]  # block maxima 5, 9, 7
    q_pos = torch.tensor([[0, 3, 6, 9]])
    scores = torch.tensor([[[s] * 4]])  # [1, 1, 4, 10]
    scores = scores.masked_fill(torch.arange(10) > q_pos[:, None, :, None], -INF)

    def sel(local: int = 1, init: int = 0) -> list:
        return select_blocks(scores, q_pos, 4, 2, local, init)[0, 0].tolist()

    # pos 0, 3: block 0 only; pos 6: local block 1 (+inf), then block 0 (5); pos 9: local block 2, then block 1 (9)
    assert sel() == [[0, -1], [0, -1], [1, 0], [2, 1]]
    # two forced blocks (both +inf) fill the two slots: their order is implementation-defined, so compare sorted
    init1, local2 = sel(init=1), sel(local=2)
    assert init1[:2] == [[0, -1], [0, -1]] and sorted(init1[2]) == [0, 1] and sorted(init1[3]) == [0, 2]
    assert local2[:2] == [[0, -1], [0, -1]]  # no block before block 0 to force
    assert sorted(local2[2]) == [0, 1] and sorted(local2[3]) == [1, 2]
    assert block_scores(scores, q_pos, 4)[0, 0, 3].tolist() == [5.0, 9.0, INF]
    assert block_scores(scores, q_pos, 4)[0, 0, 2].tolist() == [5.0, INF, -INF]  # block 2 is in the future


def test_select_blocks_equal_scores():
    """Every key scores the same, so every causal block other than the forced ones ties. With more tied blocks than
    slots, which of them fill the slots is implementation-defined: the selection must be the local block, then
    distinct causal blocks (a subset of the tied ones); with fewer causal blocks than slots, exactly the causal blocks
    as a set, then -1."""
    bs, L, topk = 4, 26, 3  # 7 blocks, the last of 2 keys
    iq = torch.ones(1, 4, 1, 2)
    ik = torch.ones(1, L, 2)
    q_pos = torch.tensor([[25, 13, 5, 2]])
    got = select_blocks(index_scores(iq, ik, q_pos), q_pos, bs, topk)[0, 0].tolist()
    want = naive_block_scores(naive_index_scores(iq.tolist(), ik.tolist(), q_pos.tolist()), q_pos.tolist(), bs, 1, 0)
    for t, pos in enumerate(q_pos[0].tolist()):
        check_selection(got[t], want[0][0][t], topk)
        q_block = pos // bs
        assert got[t][0] == q_block
        causal = set(range(q_block + 1))
        if len(causal) >= topk:
            assert set(got[t]) <= causal and len(set(got[t])) == topk
        else:
            assert set(got[t][:len(causal)]) == causal and got[t][len(causal):] == [-1] * (topk - len(causal))


# ---------------------------------------------------------------------------------------------- naive routing


def naive_route(x: list, w: list, bias: list | None, top_k: int, mask: list | None = None
                ) -> tuple[list, list, list]:
    """Per token: logits l[e] = sum_h x[h] w[e][h], scores p = 1 / (1 + exp(-l)), the choice p + bias with masked
    experts at -inf; returns (logits, scores, choice values) per token, in float64."""
    logits, scores, choice = [], [], []
    for row in x:
        lt = [sum(a * c for a, c in zip(row, we)) for we in w]
        pt = [1.0 / (1.0 + math.exp(-v)) for v in lt]
        ct = [p + (bias[e] if bias is not None else 0.0) for e, p in enumerate(pt)]
        if mask is not None:
            ct = [c if mask[e] else -INF for e, c in enumerate(ct)]
        logits.append(lt)
        scores.append(pt)
        choice.append(ct)
    return logits, scores, choice


def check_routing(routing, x: torch.Tensor, w: torch.Tensor, bias, top_k: int, mask=None, tol: float = 1e-5) -> None:
    """The engine's routing against the loops: logits, a top-k of the choice values (`check_selection`: ties as sets),
    and each slot's weight = its expert's sigmoid score / the sum over the chosen experts (paired with the engine's
    own ids, so the check holds whichever tied expert it took)."""
    logits, scores, choice = naive_route(x.float().tolist(), w.float().tolist(),
                                         None if bias is None else bias.float().tolist(), top_k,
                                         None if mask is None else mask.tolist())
    assert routing.expert_ids.shape == (len(logits), top_k) and routing.weights.dtype == torch.float32
    assert routing.logits.dtype == torch.float32
    for t in range(len(logits)):
        assert routing.logits[t].tolist() == pytest.approx(logits[t], rel=1e-5, abs=1e-5)
        ids = routing.expert_ids[t].tolist()
        check_selection(ids, choice[t], top_k, tol=tol)
        total = sum(scores[t][e] for e in ids)
        assert routing.weights[t].tolist() == pytest.approx([scores[t][e] / total for e in ids], rel=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_random_against_loops(dtype):
    """Random tokens, router and selection bias (x in fp32 or bf16; the router works in fp32 either way)."""
    g = torch.Generator().manual_seed(1)
    T, H, E, k = 7, 16, 12, 3
    x = torch.randn(T, H, generator=g).to(dtype)
    w = torch.randn(E, H, generator=g) * 0.3
    bias = torch.randn(E, generator=g) * 0.05
    check_routing(route(x, w, bias, k), x, w, bias, k)
    check_routing(route(x, w, None, k), x, w, None, k)


def test_route_equal_scores():
    """Experts 1, 4 and 6 have the same router row, so the same score for every token (integer inputs: exact). Which
    of the tied experts fill the last slots, and in which order, is implementation-defined (`route`'s docstring: as
    `torch.topk` breaks ties): the chosen ids must be the untied best ones plus distinct tied ones, their weights
    equal, each slot's weight its own expert's score over the chosen sum."""
    g = torch.Generator().manual_seed(2)
    T, H, E, k = 5, 6, 8, 4
    x = make_ints((T, H), g, -2, 2)
    w = make_ints((E, H), g, -2, 2) / 8  # dot products are multiples of 1/8: exact in fp32
    w[4] = w[1]
    w[6] = w[1]
    r = route(x, w, None, k)
    check_routing(r, x, w, None, k, tol=0.0)
    # all experts tied (one row for all): any k distinct experts, weights 1/k each
    same = w[:1].expand(E, H).contiguous()
    r = route(x, same, None, k)
    check_routing(r, x, same, None, k, tol=0.0)
    for t in range(T):
        assert len(set(r.expert_ids[t].tolist())) == k
        assert r.weights[t].tolist() == pytest.approx([1 / k] * k)


def test_route_masked_experts():
    """Experts the mask marks False are never chosen, even the best ones; the choice and the weights are the top-k of
    the others. A mask that keeps fewer experts than k is refused."""
    g = torch.Generator().manual_seed(3)
    T, H, E, k = 6, 8, 10, 3
    x = torch.randn(T, H, generator=g)
    w = torch.randn(E, H, generator=g) * 0.3
    bias = torch.randn(E, generator=g) * 0.05
    best = route(x, w, bias, k).expert_ids
    mask = torch.ones(E, dtype=torch.bool)
    mask[best[0, 0]] = False  # the first token's favourite
    mask[torch.tensor([2, 5, 7])] = False
    r = route(x, w, bias, k, mask)
    check_routing(r, x, w, bias, k, mask)
    assert not (~mask)[r.expert_ids].any()
    with pytest.raises(ConfigError, match="expert_mask keeps 2 experts"):
        route(x, w, bias, k, torch.tensor([True, True] + [False] * (E - 2)))


def test_route_bias_chooses_but_does_not_weigh():
    """The selection bias only chooses: a bias that lifts the lowest-scoring expert puts it in the top-k, with the
    weight of its sigmoid score (not score + bias) over the chosen sum; a bias equal for every expert changes neither
    the choice nor the weights."""
    # one token; scores sigmoid(l) for logits 3, 2, 1, 0, -1, -2 (x = 1, router rows = the logits)
    logits = [3.0, 2.0, 1.0, 0.0, -1.0, -2.0]
    x = torch.ones(1, 1)
    w = torch.tensor(logits)[:, None]
    p = [1 / (1 + math.exp(-v)) for v in logits]
    k = 2
    plain = route(x, w, None, k)
    assert plain.expert_ids.tolist() == [[0, 1]]
    assert plain.weights[0].tolist() == pytest.approx([p[0] / (p[0] + p[1]), p[1] / (p[0] + p[1])], rel=1e-6)

    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # expert 5: 0.119 + 1 beats expert 0's 0.953
    r = route(x, w, bias, k)
    assert r.expert_ids.tolist() == [[5, 0]]
    want = [p[5] / (p[5] + p[0]), p[0] / (p[5] + p[0])]
    assert r.weights[0].tolist() == pytest.approx(want, rel=1e-6)
    biased = [p[5] + 1.0, p[0]]  # what weights from score + bias would be: the test tells them apart
    assert r.weights[0].tolist() != pytest.approx([v / sum(biased) for v in biased], rel=1e-3)
    check_routing(r, x, w, bias, k)

    shifted = route(x, w, torch.full((6,), 0.25), k)
    assert shifted.expert_ids.tolist() == plain.expert_ids.tolist()
    assert torch.equal(shifted.weights, plain.weights)


def test_fast_router_in_a_compiled_region_against_loops():
    """`FastRouter` traced by torch.compile: the logits as a broadcast product summed (no matmul in the graph, so
    inductor makes one reduction of it), the choice and the weights against the loops (the ids come unsorted)."""
    from minimax_ref.fast import FastPaths, apply
    from minimax_ref.model.moe import Router

    g = torch.Generator().manual_seed(4)
    T, H, E, k = 6, 32, 12, 4
    router = Router(H, E, k, use_bias=True)
    router.weight.data = torch.randn(E, H, generator=g) * 0.3
    router.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.05
    apply(router, FastPaths(moe=True))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    routed = torch.compile(router, backend=record, fullgraph=True)(x)
    targets = {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
    assert not any("linear" in t or "matmul" in t or "mm" in t.split(".")[-1] for t in targets), targets
    # the slots in decreasing order of the choice, as `check_routing` reads them
    choice = torch.sigmoid(routed.logits) + router.e_score_correction_bias
    order = choice.gather(-1, routed.expert_ids).argsort(dim=-1, descending=True)
    check_routing(type(routed)(routed.expert_ids.gather(-1, order), routed.weights.gather(-1, order), routed.logits),
                  x, router.weight, router.e_score_correction_bias, k)


def test_sort_topk_in_a_compiled_region_against_loops():
    """`FastPaths.sort_topk`: in a compiled region the routing and the block choice take a stable sort (no topk in the
    graph); the routing against the loops, the blocks a top-k of their scores with -inf blocks left out and ties to
    the lower index (in slot order: the sort's order)."""
    from minimax_ref.fast import FastPaths, apply
    from minimax_ref.fast.attention import top_blocks
    from minimax_ref.model.moe import Router

    g = torch.Generator().manual_seed(6)
    T, H, E, k = 6, 32, 12, 4
    router = Router(H, E, k, use_bias=True)
    router.weight.data = torch.randn(E, H, generator=g) * 0.3
    router.e_score_correction_bias.data = torch.randn(E, generator=g) * 0.05
    apply(router, FastPaths(moe=True, sort_topk=True))
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def targets() -> set:
        return {str(n.target) for n in graphs[-1].graph.nodes if n.op == "call_function"}

    routed = torch.compile(router, backend=record, fullgraph=True)(x)
    assert any("sort" in t for t in targets()) and not any("topk" in t for t in targets()), targets()
    check_routing(routed, x, router.weight, router.e_score_correction_bias, k)
    # block scores with ties (two equal pairs) and -inf blocks (future ones); fewer valid blocks than slots in a row
    scores = torch.randn(2, 3, 4, 9, generator=g)
    scores[..., 3] = scores[..., 5]
    scores[0, 0, 0, 2:] = float("-inf")
    scores[1, :, :, 7:] = float("-inf")
    blocks = torch.compile(lambda s: top_blocks(s, 4, by_sort=True), backend=record, fullgraph=True)(scores)
    assert any("sort" in t for t in targets()) and not any("topk" in t for t in targets()), targets()
    for row, got in zip(scores.reshape(-1, 9).tolist(), blocks.reshape(-1, 4).tolist()):
        check_selection(got, row, 4)
        assert got == [j for j, _ in naive_topk(row, 4)] + [-1] * (4 - len(naive_topk(row, 4)))
