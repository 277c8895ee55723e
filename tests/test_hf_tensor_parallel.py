"""The tensor-parallel plan applied to a Hugging Face LlamaForCausalLM built from a config:
on real Gloo ranks (tp 2) its logits, loss and gradients equal the unsharded model's."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

# Imported once here, in the parent: the forked ranks inherit it (it takes seconds to import).
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from conftest import assert_same_gradients  # noqa: E402
from dist_harness import run_ranks  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import meshloom  # noqa: E402
from meshloom.comm import CommCounter  # noqa: E402
from meshloom.mesh import Mesh, ParallelDims  # noqa: E402
from meshloom.models.hf_llama import (  # noqa: E402
    check_hf_llama_tp,
    hf_llama_tp_plan,
    tensor_parallel_hf_llama,
)
from meshloom.parallel.tensor import padded_vocab  # noqa: E402
from meshloom.parallel.tensor_plan import GatheredLogits  # noqa: E402

VOCAB = 101  # odd: padded to 102 at tp 2
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(attn: str = "eager", kv: int = 2, heads: int = 4, hidden: int = 64,
            **extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=hidden, num_hidden_layers=2, num_attention_heads=heads,
                       num_key_value_heads=kv, intermediate_size=128, vocab_size=VOCAB,
                       max_position_embeddings=64, initializer_range=0.1, use_cache=False,
                       attn_implementation=attn, **extra)


def _build(cfg: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).float()


def _mesh(world: int) -> Mesh:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return Mesh(ParallelDims(tp=world), rank, "cpu", CommCounter())


def _batch(pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, 12), generator=g)
    ids[:, 0] = VOCAB - 1  # the last row: the only real one in the second rank's padded slice
    if pad is not None:
        ids[0, -3:] = pad
    return ids, torch.randint(0, VOCAB, (2, 12), generator=g)


def _parity_job(world: int, cfg: LlamaConfig, ids: torch.Tensor, targets: torch.Tensor) -> dict:
    mesh = _mesh(world)
    # The unsharded reference, on this rank alone.
    ref = _build(cfg)
    ref_logits = ref(ids).logits
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    model = _build(cfg)
    tp = tensor_parallel_hf_llama(model, mesh)
    logits = model(ids).logits  # this rank's slice of the padded vocabulary
    loss = tp.loss(logits, targets)
    loss.backward()
    params = dict(model.named_parameters())
    grads = tp.gather_full({n: p.grad for n, p in params.items()}, params)
    with torch.no_grad():
        whole = GatheredLogits(model, tp)(ids)
    emb = model.model.embed_tokens.weight
    attn = model.model.layers[0].self_attn
    return {
        "logits": whole, "ref_logits": ref_logits.detach(), "local_vocab": logits.shape[-1],
        "loss": loss.item(), "ref_loss": ref_loss.item(), "grads": grads, "ref_grads": ref_grads,
        # The vocabulary padding rows (past VOCAB, on the last rank) get no gradient.
        "pad_rows_grad": emb.grad[VOCAB - mesh.coord("tp") * emb.shape[0]:].abs().sum().item(),
        "q_rows": attn.q_proj.weight.shape[0], "k_rows": attn.k_proj.weight.shape[0],
        "tied": model.lm_head.weight is emb,
    }


CASES = {
    "eager-gqa": dict(attn="eager", kv=2),
    "sdpa-gqa": dict(attn="sdpa", kv=2),
    "eager-mha-tied": dict(attn="eager", kv=4, tie_word_embeddings=True),
    "sdpa-mha-tied-pad-bias": dict(attn="sdpa", kv=4, tie_word_embeddings=True, pad_token_id=0,
                                   attention_bias=True, mlp_bias=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hf_llama_tp2_matches_unsharded(case):
    kwargs = CASES[case]
    cfg = _config(**kwargs)
    ids, targets = _batch(kwargs.get("pad_token_id"))
    results = run_ranks(_parity_job, 2, 2, cfg, ids, targets)
    for r in results:
        assert r["local_vocab"] == padded_vocab(VOCAB, 2) // 2
        assert (r["q_rows"], r["k_rows"]) == (2 * 16, kwargs["kv"] // 2 * 16)  # heads split
        assert r["tied"] == kwargs.get("tie_word_embeddings", False)
        torch.testing.assert_close(r["logits"], r["ref_logits"], **TOL)
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5 * abs(r["ref_loss"])
        # Gradients of the shards are the shards of the gradients.
        assert set(r["grads"]) == set(r["ref_grads"])
        # Each against its own scale: a fixed atol of 1e-6 would not see a small tensor's
        # gradient doubled or lost.
        assert_same_gradients(r["ref_grads"], r["grads"])
        assert r["pad_rows_grad"] == 0.0
    if "pad_token_id" in kwargs:  # untouched by its lookups; the tied head still reaches it
        pad_row = results[0]["ref_grads"]["model.embed_tokens.weight"][kwargs["pad_token_id"]]
        assert pad_row.abs().sum() > 0


def test_plan_names_the_installed_modules():
    model = _build(_config())
    names = {n for n, _ in model.named_modules()}
    plan = hf_llama_tp_plan(model)
    for pattern in plan:
        concrete = pattern.replace("*", "0")
        assert concrete in names, pattern


def test_check_hf_llama_tp_messages():
    assert check_hf_llama_tp(_config(), 2) is None
    assert check_hf_llama_tp(_config(kv=4), 4) is None
    msg = check_hf_llama_tp(_config(heads=3, kv=3, hidden=48), 2)
    assert msg == "config.num_attention_heads=3 must be divisible by parallel.tp=2"
    msg = check_hf_llama_tp(_config(kv=1), 2)
    assert msg.startswith("config.num_key_value_heads=1 must be divisible by parallel.tp=2")
    assert "config.num_key_value_heads" in msg.split("(", 1)[1]
    msg = check_hf_llama_tp(_config(kv=2), 4)
    assert msg.startswith("config.num_key_value_heads=2 must be divisible by parallel.tp=4")
    cfg = _config(kv=4)
    cfg.intermediate_size = 130
    assert check_hf_llama_tp(cfg, 4) == "config.intermediate_size=130 must be divisible by " \
                                        "parallel.tp=4"


def _refusals_job(world: int) -> dict:
    mesh = _mesh(world)
    out = {}
    for key, cfg, sp in (("heads", _config(heads=3, kv=3, hidden=48), False),
                         ("sp", _config(), True)):
        try:
            tensor_parallel_hf_llama(_build(cfg), mesh, sequence_parallel=sp)
            out[key] = None
        except ValueError as e:
            out[key] = str(e)
    model = _build(_config())
    tp = tensor_parallel_hf_llama(model, mesh)
    ids, targets = _batch()
    try:
        model(ids, labels=targets)
        out["labels"] = None
    except ValueError as e:
        out["labels"] = str(e)
    tp.set_sequence_parallel(True)  # switched on afterwards: refused at the forward
    try:
        model(ids)
        out["sp_later"] = None
    except ValueError as e:
        out["sp_later"] = str(e)
    return out


def test_refusals_at_tp2():
    for r in run_ranks(_refusals_job, 2, 2):
        assert r["heads"] == "config.num_attention_heads=3 must be divisible by parallel.tp=2"
        assert r["sp"].startswith("sequence_parallel=True is not supported for Hugging Face")
        assert "causal mask and RoPE positions" in r["sp"] and "\n" not in r["sp"]
        assert r["sp_later"] == r["sp"]
        assert r["labels"].startswith("labels= is not supported") and "tp.loss" in r["labels"]


def _module_level_imports(tree: ast.AST) -> list[str]:
    """Modules imported when the file is imported (function bodies excluded)."""
    names, todo = [], list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        todo.extend(ast.iter_child_nodes(node))
    return names


def test_importing_meshloom_does_not_import_transformers():
    """transformers stays optional: no meshloom module imports it at import time (checked on the
    source: this process has imported it already, and a fresh interpreter costs seconds)."""
    root = Path(meshloom.__file__).parent
    for path in sorted(root.rglob("*.py")):
        imported = _module_level_imports(ast.parse(path.read_text(), str(path)))
        assert not [m for m in imported if m.split(".")[0] == "transformers"], path
