"""`tp_ends`: how the token table and the output head run under tp > 1. `split` (meshloom,
Megatron, torchtitan) splits both over the vocabulary; `gathered` (KempnerForge) keeps the
table whole, gathers the head's logits whole onto every rank and runs the loss over all of
them, and without sequence parallel splits neither end (`whole`). Also `eager_bf16`, the
cross entropy of a bf16 model with no autocast."""

from __future__ import annotations

from dataclasses import replace

import pytest

from meshloom.plan import PlanError
from meshloom.plan.compute import CE_BYTES_PER_LOGIT, head_cost, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation, ends_split, loss_kind
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.memory import logits_bytes, outer_params
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate
from meshloom.plan.timing import end_collectives
from meshloom.plan.trainers import trainer_impl

SHAPE = PRESETS["llama3-8b"]  # untied: a token table and a head of V x h each
V, H, SEQ = SHAPE.vocab, SHAPE.hidden, 4096
KF = Implementation(**trainer_impl("kempnerforge"))
SPLIT = replace(KF, tp_ends="split")


def test_how_each_layout_runs_its_ends():
    assert ends_split(KF, Layout(tp=4, sp=True)) == "gathered"
    assert ends_split(KF, Layout(tp=2, pp=2, schedule="1f1b")) == "whole"  # no SP
    assert ends_split(KF, Layout()) == "split"  # tp = 1: nothing to split
    assert ends_split(SPLIT, Layout(tp=4, sp=True)) == "split"
    # every rank holds all the logits: its own loss, not PyTorch's loss_parallel on a slice
    assert loss_kind(KF, Layout(tp=4, sp=True)) == "eager_bf16"
    assert loss_kind(SPLIT, Layout(tp=4, sp=True)) == "loss_parallel"


def test_a_gathered_head_runs_the_loss_over_the_whole_vocabulary_and_reassembles_it():
    """The difference from a split head is exactly the loss over V at 14 bytes a logit
    against loss_parallel's 76 over V/tp, plus DTensor's copies: the gathered pieces laid
    side by side (a read and a write of the whole bf16 logits) and the rank's slice of their
    gradient copied out."""
    rates = rates_for(make_cluster("h200", 4, 4))
    lay = Layout(tp=4, sp=True, micro_batch=2)
    logits = 2 * SEQ * V
    (gf, gb), (sf, sb) = (head_cost(SHAPE, lay, rates, SEQ, impl) for impl in (KF, SPLIT))
    (bf, bb), (pf, pb) = CE_BYTES_PER_LOGIT["eager_bf16"], CE_BYTES_PER_LOGIT["loss_parallel"]
    assert (bf, bb) == (6.0, 8.0)
    assert gf - sf == pytest.approx(rates.stream(bf * logits, 3) + rates.stream(4 * logits, 1)
                                    - rates.stream(pf * logits / 4, 6), rel=1e-9)
    assert gb - sb == pytest.approx(rates.stream(bb * logits, 4) + rates.stream(logits, 1)
                                    - rates.stream(pb * logits / 4, 5), rel=1e-9)


def test_a_head_split_over_no_rank_costs_what_one_gpu_pays():
    rates = rates_for(make_cluster("h200", 4, 4))
    whole = Layout(tp=4, pp=2, schedule="1f1b", micro_batch=2)
    assert head_cost(SHAPE, whole, rates, SEQ, KF) == pytest.approx(
        head_cost(SHAPE, Layout(micro_batch=2), rates, SEQ, KF), rel=1e-12)
    assert head_cost(SHAPE, whole, rates, SEQ, SPLIT)[0] < head_cost(SHAPE, whole, rates, SEQ,
                                                                     KF)[0]


def test_the_ends_collectives_one_by_one():
    """Gathered: the table's lookup is sliced, so its end only all-gathers the gradient
    backward (1 call); the head's gathers its input, reduce-scatters its gradient and gathers
    the whole logits (3 calls, the last exposed). Whole: none at all."""
    cluster = make_cluster("h200", 4, 4)
    lay = Layout(tp=4, sp=True, micro_batch=2)
    logits = cluster.collective("all_gather", 2 * SEQ * V * 2, 4, 1)
    one, start = 0.010, 0.0001
    ends = end_collectives(lay, one, start, 0.0, KF, logits)
    assert (ends.emb_f, ends.emb_b) == (0.0, one / 2)
    assert ends.head_f == pytest.approx(one / 2 + logits.seconds)
    assert ends.head_b == ends.head_b_all == one / 2
    secs, calls, fixed = ends.calls(3, True, True)
    assert calls == 3 * (1 + 3)
    assert secs == pytest.approx(3 * (one / 2 + one + logits.seconds))
    assert fixed == pytest.approx(3 * (3 * start + logits.start))
    split = end_collectives(lay, one, start, 0.0, SPLIT)
    assert split.calls(3, True, True)[1] == 3 * 4 and split.emb_f == one / 2
    whole = end_collectives(Layout(tp=4, pp=2, schedule="1f1b"), one, start, 0.0, KF)
    assert whole.calls(3, True, True) == (0.0, 0, 0.0)


def test_the_step_pays_the_logits_gather_on_the_busiest_rank():
    cluster = make_cluster("h200", 4, 4)
    lay = Layout(tp=4, sp=True, micro_batch=2)
    m = 8 // 2

    def ends(impl: Implementation) -> tuple[float, int]:
        tp = evaluate(SHAPE, lay, cluster, SEQ, 8, impl=impl).timing.detail["comm_s"]["tp"]
        return tp["ops"]["embedding_and_head"], tp["calls"]["embedding_and_head"]["calls"]

    tokens = 2 * SEQ
    one = sum(cluster.collective(op, tokens * H * 2, 4, 1).seconds
              for op in ("all_gather", "reduce_scatter"))
    gather = cluster.collective("all_gather", tokens * V * 2, 4, 1).seconds
    (got, n), (base, n_split) = ends(KF), ends(SPLIT)
    assert (n, n_split) == (m * 4, m * 4)
    # the embedding's forward reduce-scatter gone, the logits' gather added
    assert got - base == pytest.approx(m * (gather - one / 2), rel=1e-9)


def test_memory_holds_the_whole_table_and_every_logit():
    gathered, whole = Layout(tp=4, sp=True), Layout(tp=4, pp=2, schedule="1f1b")
    assert outer_params(SHAPE, gathered, 0, KF) == V * H + H + V * H / 4
    assert outer_params(SHAPE, gathered, 0, SPLIT) == outer_params(SHAPE, gathered, 0) \
        == V * H / 4 + H + V * H / 4
    assert outer_params(SHAPE, whole, 0, KF) == V * H  # the first stage: the table only
    assert outer_params(SHAPE, whole, 1, KF) == H + V * H
    # eager_bf16's peak: the held logits, the log-softmax and two gradients, 2 bytes each
    assert logits_bytes(SHAPE, SEQ, 2, gathered, "bf16", KF) == SEQ * 2 * V * 4 * 2
    assert logits_bytes(SHAPE, SEQ, 2, Layout(), "bf16", KF) == SEQ * 2 * V * 4 * 2
    assert logits_bytes(SHAPE, SEQ, 2, gathered, "bf16", SPLIT) == SEQ * 2 * V / 4 * 20


def test_the_keys_parse_and_bad_values_are_one_line_errors():
    assert parse_fix("tp_ends=gathered,cross_entropy=eager_bf16") == {
        "tp_ends": "gathered", "cross_entropy": "eager_bf16"}
    with pytest.raises(PlanError, match=r"^--fix: tp_ends=both must be one of split, gathered$"):
        parse_fix("tp_ends=both")


def test_a_whole_tied_table_is_summed_whole_across_the_pipeline():
    """A tied table on the first and the last stage: their gradients meet in an all-reduce,
    of V/t x h for a split table and of all of it for one whole on every tp rank."""
    from meshloom.plan.timing import tied_table_sync
    tied = PRESETS["gpt2"]
    assert tied.tied
    cluster, lay = make_cluster("h100", 16, 8), Layout(tp=2, pp=2, dp=4, schedule="1f1b")
    split = tied_table_sync(tied, lay, cluster, "bf16", impl=SPLIT)
    whole = tied_table_sync(tied, lay, cluster, "bf16", impl=KF)
    far = 1 * 4 * 2  # the last stage's rank, (p - 1) x dp x cp x tp ranks from the first
    assert split == tied_table_sync(tied, lay, cluster, "bf16") == cluster.collective(
        "all_reduce", tied.vocab / 2 * tied.hidden * 2, 2, far)
    assert whole == cluster.collective("all_reduce", tied.vocab * tied.hidden * 2, 2, far)
    assert whole.seconds > split.seconds
