"""`train_metrics=composer`: Composer's trainer evaluates the model's training metrics over the
logits after every micro-batch's backward; llm-foundry's MPT declares LanguageCrossEntropy and
LanguagePerplexity, two eager cross-entropy forwards (plan/compute.py `head_cost`)."""

from __future__ import annotations

import pytest

from meshloom.plan import PlanError
from meshloom.plan.compute import CE_BYTES_PER_LOGIT, CE_KERNELS, head_cost, rates_for
from meshloom.plan.hardware import make_cluster
from meshloom.plan.implementation import Implementation
from meshloom.plan.layout import Layout, parse_fix
from meshloom.plan.models import PRESETS
from meshloom.plan.search import evaluate

SEQ, BATCH = 2048, 64
SHAPE = PRESETS["llama3-1b"]
LOOP = dict(meshloom_block=False, cross_entropy="xentropy")


@pytest.mark.parametrize("lay", [Layout(dp=8, zero=3, micro_batch=4),
                                 Layout(tp=2, dp=4, zero=1, micro_batch=2)])
def test_two_eager_cross_entropy_forwards_per_micro_batch(lay):
    """Each metric reads the micro-batch's logits as the eager loss's forward does (18 bytes a
    logit, 4 kernels), after the backward: the head's forward is unchanged."""
    rates = rates_for(make_cluster("h100", 8))
    base_f, base_b = head_cost(SHAPE, lay, rates, SEQ, Implementation(**LOOP))
    f, b = head_cost(SHAPE, lay, rates, SEQ, Implementation(**LOOP, train_metrics="composer"))
    logits = lay.micro_batch * SEQ * SHAPE.vocab / lay.tp
    one = rates.stream(CE_BYTES_PER_LOGIT["eager"][0] * logits, CE_KERNELS["eager"][0])
    assert f == base_f
    assert b - base_b == pytest.approx(2 * one, rel=1e-12)


def test_the_step_pays_it_on_every_micro_batch():
    lay = Layout(dp=8, zero=3, micro_batch=4)
    cl = make_cluster("h100", 8)
    m = BATCH // (8 * lay.micro_batch)
    plain = evaluate(SHAPE, lay, cl, SEQ, BATCH, impl=Implementation(**LOOP))
    metrics = evaluate(SHAPE, lay, cl, SEQ, BATCH,
                       impl=Implementation(**LOOP, train_metrics="composer"))
    logits = lay.micro_batch * SEQ * SHAPE.vocab
    one = rates_for(cl).stream(CE_BYTES_PER_LOGIT["eager"][0] * logits, CE_KERNELS["eager"][0])
    got = (metrics.timing.detail["compute_s"]["head_and_loss"]
           - plain.timing.detail["compute_s"]["head_and_loss"])
    assert got == pytest.approx(2 * m * one, rel=1e-9)
    assert metrics.timing.step_time_s > plain.timing.step_time_s
    assert metrics.memory.total == plain.memory.total


def test_the_key_parses_and_refuses_an_unknown_value():
    assert parse_fix("train_metrics=composer") == {"train_metrics": "composer"}
    assert Implementation().train_metrics == "none"
    with pytest.raises(PlanError, match="train_metrics=accuracy must be one of none, composer"):
        parse_fix("train_metrics=accuracy")
