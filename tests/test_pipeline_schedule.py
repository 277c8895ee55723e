"""Pipeline schedules as data, the simulator's bubble against the published formulas, and the
stage split. No processes: these are pure functions."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from meshloom.parallel.pipeline_schedule import (
    SPLIT_BACKWARD,
    Action,
    _interleaved,
    build_schedule,
    compute_lists,
    simulate,
)
from meshloom.parallel.pipeline_stage import split_layers


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 4), (4, 8), (4, 13), (8, 16)])
def test_bubble_gpipe_and_1f1b(schedule, p, m):
    """(p-1)/(m+p-1) on unit costs (Narayanan et al. 2021), also with B twice F."""
    lists = build_schedule(schedule, p, m)
    assert simulate(lists).bubble() == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)
    b2 = simulate(lists, lambda a: 2.0 if a.kind == "B" else 1.0).bubble()
    assert b2 == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 3), (2, 8, 4)])
def test_bubble_interleaved(p, m, v):
    """(p-1)/(v*m+p-1) with v virtual stages per rank, each a 1/v-sized chunk (unit costs)."""
    bubble = simulate(build_schedule("interleaved_1f1b", p, m, v)).bubble()
    assert bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_zero_bubble_is_below_1f1b(p, m):
    """ZB-H1 (F = I = W = 1) against 1F1B with the same backward (B = I + W = 2): the step
    takes 3m + p - 1 units instead of 3m + 3(p - 1), a third of 1F1B's idle time (Qi et al.)."""
    zb = simulate(build_schedule("zb_h1", p, m))
    one = simulate(build_schedule("1f1b", p, m), lambda a: 2.0 if a.kind == "B" else 1.0)
    assert zb.bubble() < one.bubble()
    assert zb.makespan == 3 * m + p - 1 and one.makespan == 3 * m + 3 * (p - 1)
    assert zb.bubble() == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("w_order", ["filled", "lagged"])
@pytest.mark.parametrize("p,m,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 2),
                                   (4, 12, 3), (8, 16, 2), (8, 32, 4), (3, 9, 3), (5, 10, 4)])
def test_interleaved_zero_bubble_fills_interleaved_1f1b_at_1f1b_memory(p, m, v, w_order):
    """interleaved_zb against interleaved 1F1B with the same backward (B = I + W = 2): the step
    takes 3mv + p - 1 units instead of 3mv + 3(p - 1), ZB-H1's bubble with v x m chunks, and
    every rank holds at most p micro-batches of its layers (v x p chunk activations), 1F1B's
    first-rank peak, where interleaved 1F1B's first rank holds v x p + p - 1 (m > p). Both
    placements of the weight passes: meshloom's (filled) and PyTorch's (lagged)."""
    zb = simulate(build_schedule("interleaved_zb", p, m, v, w_order))
    il = simulate(build_schedule("interleaved_1f1b", p, m, v),
                  lambda a: 2.0 if a.kind == "B" else 1.0)
    assert zb.makespan == 3 * m * v + p - 1 and il.makespan == 3 * m * v + 3 * (p - 1)
    assert zb.bubble() == pytest.approx((p - 1) / (3 * m * v + p - 1), abs=1e-12)
    lists = compute_lists("interleaved_zb", p, m, v, w_order=w_order)
    peaks = [_peak_alive(a, release="W") for a in lists]
    assert peaks == [p * v] * p
    assert _peak_alive(compute_lists("interleaved_1f1b", p, m, v)[0]) == min(p * v + p - 1, m * v)
    # The forwards and input gradients keep interleaved 1F1B's order, with the warm-up of a
    # split backward: p - 1 - r forwards beyond (v - 1) x p on rank r, not twice that.
    for r, zl in enumerate(lists):
        fi = [(a.kind.replace("I", "B"), a.stage, a.mb) for a in zl if a.kind != "W"]
        assert fi == [tuple(a) for a in _interleaved(r, p, m, v, offset=1)]
        warm = (v - 1) * p + p - 1 - r
        assert [a[0] for a in fi[:warm + 2]] == ["F"] * (warm + 1) + ["B"]


@pytest.mark.parametrize("p,m", [(1, 3), (2, 2), (2, 6), (4, 4), (4, 8), (8, 24)])
def test_interleaved_zero_bubble_with_one_chunk_is_zb_h1(p, m):
    assert compute_lists("interleaved_zb", p, m, 1) == compute_lists("zb_h1", p, m)
    assert compute_lists("interleaved_zb", p, m, 1, w_order="lagged") == compute_lists(
        "zb_h1", p, m)


def test_lagged_weight_passes_run_r_input_passes_behind():
    """PyTorch's placement: on rank r the W of its k-th input-gradient pass follows its
    (k + r)-th, the last r at the end; the rest of the list is meshloom's."""
    p, m, v = 4, 8, 2
    filled = compute_lists("interleaved_zb", p, m, v)
    for r, acts in enumerate(compute_lists("interleaved_zb", p, m, v, w_order="lagged")):
        inputs = [a for a in acts if a.kind == "I"]
        for k, i in enumerate(inputs[:len(inputs) - r]):
            after = inputs[k + r]
            w = Action("W", i.stage, i.mb)
            assert acts.index(w) == acts.index(after) + 1
        assert acts[-r:] == [Action("W", a.stage, a.mb) for a in inputs[len(inputs) - r:]] \
            if r else True
        assert [a for a in acts if a.kind != "W"] == [a for a in filled[r] if a.kind != "W"]
    with pytest.raises(ValueError, match="unknown w_order 'late'"):
        compute_lists("interleaved_zb", p, m, v, w_order="late")


def test_interleaved_zero_bubble_runs_with_uneven_costs_and_latency():
    """The lists are laid out on a unit clock; on any other (a heavy last stage, W cheaper than
    I, a transfer latency) they still run to the end and beat interleaved 1F1B."""
    p, m, v = 4, 8, 2

    def cost(a):
        base = 1.5 if a.stage == p * v - 1 else 1.0
        return base * {"F": 1.0, "B": 2.2, "I": 1.4, "W": 0.8}[a.kind]

    zb = simulate(build_schedule("interleaved_zb", p, m, v), cost, latency=0.3)
    il = simulate(build_schedule("interleaved_1f1b", p, m, v), cost, latency=0.3)
    assert zb.makespan < il.makespan


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1),
                                            ("interleaved_1f1b", 4, 8, 2), ("zb_h1", 4, 8, 1),
                                            ("interleaved_zb", 4, 8, 2),
                                            ("interleaved_zb", 2, 6, 3)])
def test_every_micro_batch_runs_once_on_its_stage(schedule, p, m, v):
    lists = compute_lists(schedule, p, m, v)
    kinds = ("F", "I", "W") if schedule in SPLIT_BACKWARD else ("F", "B")
    for r, acts in enumerate(lists):
        assert all(a.stage % p == r for a in acts)  # stage s lives on rank s % p
        counts = Counter((a.kind, a.stage, a.mb) for a in acts)
        stages = [c * p + r for c in range(v)]
        assert set(counts) == {(k, s, mb) for k in kinds for s in stages for mb in range(m)}
        assert set(counts.values()) == {1}


def _peak_alive(acts, release="B"):
    alive = peak = 0
    for a in acts:
        alive += a.kind == "F"
        alive -= a.kind == release
        peak = max(peak, alive)
    return peak


def test_activation_budget_of_each_schedule():
    """1F1B's first stage holds at most p micro-batches' activations; GPipe holds m; ZB-H1
    holds p on every stage (activations live until W): 1F1B's peak."""
    p, m = 4, 8
    assert _peak_alive(compute_lists("1f1b", p, m)[0]) == p
    assert _peak_alive(compute_lists("gpipe", p, m)[0]) == m
    assert [_peak_alive(a, release="W") for a in compute_lists("zb_h1", p, m)] == [p] * p
    assert [_peak_alive(a) for a in compute_lists("1f1b", p, m)] == [4, 3, 2, 1]


def test_simulator_reports_a_deadlock():
    # Rank 1 waits for micro-batch 1 first, rank 0 waits for rank 1's gradient of 0 first.
    lists = build_schedule("1f1b", 2, 2)
    lists[1] = [a for a in lists[1] if a.mb == 1] + [a for a in lists[1] if a.mb == 0]
    lists[0] = [a for a in lists[0] if not (a.kind == "F" and a.mb == 1)
                and a != Action("SEND_F", 0, 1)]
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(lists)


def test_unknown_schedule_and_bad_virtual_stages():
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        compute_lists("zigzag", 2, 4)
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs parallel.pp_schedule=inter"):
        compute_lists("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match=r"count \(6\) to be a multiple of parallel.pp=4"):
        compute_lists("interleaved_1f1b", 4, 6, 2)
    with pytest.raises(ValueError, match=r"interleaved_zb needs the micro-batch count \(6\)"):
        compute_lists("interleaved_zb", 4, 6, 2)
    with pytest.raises(ValueError, match="pp_virtual_stages=2 needs .* or interleaved_zb"):
        compute_lists("zb_h1", 2, 4, 2)


# ---------------------------------------------------------------- stage split


def test_split_balances_flops_with_the_head_on_the_last_stage():
    # 8 equal blocks; the head costs two blocks: the last stage gets fewer blocks.
    assert split_layers(8, 2, [1.0] * 8, 2.0) == [(0, 5), (5, 8)]
    assert split_layers(8, 4, [1.0] * 8, 0.0) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # Uneven: 5 blocks over 2 stages, every block in exactly one stage.
    bounds = split_layers(5, 2, [1.0] * 5, 0.0)
    assert bounds[0][0] == 0 and bounds[-1][1] == 5
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:], strict=False))
    assert all(hi > lo for lo, hi in bounds)


def test_split_explicit_and_impossible():
    assert split_layers(6, 3, explicit=[1, 2, 3]) == [(0, 1), (1, 3), (3, 6)]
    with pytest.raises(ValueError, match="must list 3 stage sizes"):
        split_layers(6, 3, explicit=[3, 3])
    with pytest.raises(ValueError, match="must list 2 stage sizes"):
        split_layers(6, 2, explicit=[6, 0])
    with pytest.raises(ValueError, match="need at least as many layers"):
        split_layers(3, 4)


def _split_by_trying_every_cut(n_layers, n_stages, costs, head):
    """split_layers' dynamic programme as first written, every j tried: the reference its
    binary search must reproduce cut for cut (ties included)."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for i in range(s, n_layers + 1):
            for j in range(s - 1, i):
                tail = prefix[i] - prefix[j] + (head if s == n_stages and i == n_layers else 0.0)
                if max(best[s - 1][j], tail) < best[s][i]:
                    best[s][i], cut[s][i] = max(best[s - 1][j], tail), j
    bounds, i = [], n_layers
    for s in range(n_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def test_split_layers_matches_trying_every_cut():
    rng = random.Random(0)
    for _ in range(1500):
        n = rng.randint(1, 24)
        stages = rng.randint(1, n)
        kind = rng.random()
        costs = ([1.0] * n if kind < 0.3 else [float(rng.randint(0, 3)) for _ in range(n)]
                 if kind < 0.5 else [rng.random() for _ in range(n)])
        head = rng.choice([0.0, 0.1, 1.0, 2.5, 5 * rng.random()])
        assert split_layers(n, stages, costs, head) == _split_by_trying_every_cut(
            n, stages, costs, head), (n, stages, costs, head)


@pytest.mark.parametrize("tied", [False, True])
def test_chunks_split_a_ranks_parameters_exactly(tied):
    """A pipeline rank's chunks (`chunk_parameters`, what each backward may reduce) cover every
    parameter it holds exactly once, with the embedding in the first stage's chunk and the head
    in the last one's."""
    from meshloom.models.llama import build_model, config_from_preset
    from meshloom.parallel.pipeline_stage import PipelineStageModel

    pp, v = 2, 2
    bounds = split_layers(4, pp * v)
    for rank in range(pp):
        full = build_model(config_from_preset("tiny", n_layers=4, tie_embeddings=tied), 0)
        stage = PipelineStageModel(full, [c * pp + rank for c in range(v)], bounds)
        chunks = [{id(p) for p in stage.chunk_parameters(c)} for c in range(v)]
        assert not chunks[0] & chunks[1]
        assert chunks[0] | chunks[1] == {id(p) for p in stage.parameters()}
        if rank == 0:
            assert id(stage.tok_embeddings.weight) in chunks[0]
        else:
            assert id(stage.output.weight) in chunks[1]
