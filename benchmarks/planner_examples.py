"""The planner examples that docs/plan.md quotes, written as result files and as the worked
example's block in docs/plan.md (one command regenerates all of them; no hardware needed):

    python benchmarks/planner_examples.py

Each example is a `meshloom plan` command line; its file in benchmarks/results/planner/ is
exactly what that command prints with `--json`, so a user can rerun any one by hand and compare.
The worked example (Llama 3 70B on 64 H100s) also keeps the table and `--explain` text the docs
show (`llama3_70b_64xh100.txt`), and its variants keep the figures the prose quotes (compile,
TP overlap, no recompute, ZeRO-1). tests/test_plan_examples.py checks that every file is what
the code plans now and that the docs quote the files.
"""

from __future__ import annotations

import contextlib
import io
import json
import shlex
from pathlib import Path

from meshloom.commands import main

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "planner"
DOC = HERE.parent / "docs" / "plan.md"
MOE_DOC = HERE.parent / "docs" / "plan-moe.md"  # lists the MoE examples' commands
BEGIN, END = "<!-- worked-example:begin -->", "<!-- worked-example:end -->"

_MOE = "--gpu h100 --seq 4096 --global-batch 512"
_EP8 = "tp=1,pp=1,cp=1,ep=8,zero=2,micro_batch=1,recompute=selective"
_L70 = "--model llama3-70b --gpus 64 --gpu h100 --seq 8192 --global-batch 256"
# The worked example's best layout, pinned, for the variants the prose compares it with.
_BEST = ("tp=4,pp=4,dp=4,cp=1,micro_batch=1,zero=1,recompute=selective,"
         "schedule=interleaved_zb,v=20,sp=true")

_CP4 = ("tp=1,pp=8,dp=4,cp=4,ep=8,micro_batch=1,zero=1,recompute=none,"
        "schedule=interleaved_1f1b,v=7")
_CP = "--model llama3-8b --gpus 16 --gpu h100 --seq 16384 --global-batch 64 --top 1"
_CP_FIX = "tp=1,pp=1,dp={dp},cp={cp},micro_batch=1,zero=1,recompute={rc}"

# meshloom's ZeRO-3 holding the next micro-batch's opening units (`fsdp_carry`), on and off.
_CARRY = ("--model llama3-8b --gpus 16 --gpu h100 --seq 8192 --global-batch 64 --top 1 --fix "
          "tp=1,pp=1,dp=16,cp=1,micro_batch=1,zero=3,recompute=none")

_TT_PP = ("--model llama3-70b --gpus 64 --gpu h100 --seq 8192 --global-batch 128 --top 1 "
          "--trainer torchtitan --fix tp=8,pp=4,dp=2,cp=1,micro_batch=1,zero=3,recompute=full,"
          "schedule=1f1b,sp=true")

_CARRY_FULL = _CARRY.replace("recompute=none", "recompute=full")

# torchtitan's Llama 3 8B on 8 H100 SXMs, compiled, bf16 and with torchao's Float8 (its
# weights gathered in fp8): what Float8 buys on that layout ("Step time", Float8).
_TT_8B = ("--model llama3-8b --gpus 8 --gpu h100 --seq 8192 --global-batch 16 --top 1 "
          "--trainer torchtitan --fix tp=1,pp=1,cp=1,micro_batch=2,zero=3,recompute=selective,"
          "compile=true,cross_entropy=fused")

EXAMPLES: dict[str, str] = {
    "moe_mixtral_8x7b_64xh100": f"{_MOE} --model mixtral-8x7b --gpus 64 --top 5",
    "moe_mixtral_8x7b_64xh100_balanced":
        f"{_MOE} --model mixtral-8x7b --gpus 64 --top 5 --moe-imbalance 1.0",
    "moe_mixtral_8x7b_ep8_node8": f"{_MOE} --model mixtral-8x7b --gpus 64 --top 1 --fix {_EP8}",
    "moe_mixtral_8x7b_ep8_node4":
        f"{_MOE} --model mixtral-8x7b --gpus 64 --gpus-per-node 4 --top 1 --fix {_EP8}",
    "moe_mixtral_8x22b_128xh100": f"{_MOE} --model mixtral-8x22b --gpus 128 --top 5",
    # Two layouts the MoE prose compares with the searches' picks.
    "moe_mixtral_8x7b_64xh100_pp4": f"{_MOE} --model mixtral-8x7b --gpus 64 --top 1 --fix "
    "tp=1,pp=4,dp=16,cp=1,ep=1,zero=2,micro_batch=1,recompute=none,"
    "schedule=interleaved_1f1b,v=8",
    "moe_mixtral_8x22b_128xh100_zero3": f"{_MOE} --model mixtral-8x22b --gpus 128 --top 1 "
    "--fix tp=1,pp=1,dp=128,cp=1,ep=1,zero=3,micro_batch=4,recompute=full",
    # The 8x22B pipeline with cp 4 that the search ranked second before the ring was priced
    # as meshloom runs it, with meshloom's ring and with TransformerEngine's.
    "moe_mixtral_8x22b_128xh100_cp4": f"{_MOE} --model mixtral-8x22b --gpus 128 --top 1 "
    f"--fix {_CP4}",
    "moe_mixtral_8x22b_128xh100_cp4_te": f"{_MOE} --model mixtral-8x22b --gpus 128 --top 1 "
    f"--fix {_CP4},cp_ring=te",
    # Context parallel's ring (docs/plan.md, "Context parallel's ring"): Llama 3 8B at 16384
    # tokens on 16 H100s with selective recompute, without cp (does not fit), with meshloom's
    # ring at cp 2, and with TransformerEngine's ring on cuDNN's kernel (NeMo's Llama 3.1
    # rows); and without cp under full recompute, which fits.
    "cp_llama3_8b_16xh100_cp1": f"{_CP} --fix {_CP_FIX.format(dp=16, cp=1, rc='selective')}",
    "cp_llama3_8b_16xh100_cp1_full": f"{_CP} --fix {_CP_FIX.format(dp=16, cp=1, rc='full')}",
    "cp_llama3_8b_16xh100_cp2": f"{_CP} --fix {_CP_FIX.format(dp=8, cp=2, rc='selective')}",
    "cp_llama3_8b_16xh100_cp2_te": f"{_CP} --fix {_CP_FIX.format(dp=8, cp=2, rc='selective')}"
    ",cp_ring=te,attention_kernel=cudnn",
    "fsdp_carry_llama3_8b_16xh100": _CARRY,
    "fsdp_carry_llama3_8b_16xh100_off": f"{_CARRY},fsdp_carry=false",
    # ZeRO-3 without resharding after forward: every unit gathered at the peak, once a step.
    "zero3_kept_llama3_8b_16xh100": f"{_CARRY},reshard_after_forward=false",
    "zero3_kept_llama3_8b_16xh100_full": f"{_CARRY_FULL},reshard_after_forward=false",
    # (pinned: the search would otherwise pick the held units, which fit and are faster)
    "zero3_resharded_llama3_8b_16xh100_full": f"{_CARRY_FULL},reshard_after_forward=true",
    # torchtitan's FSDP2 under a pipeline as PyTorch's pipelining drives it (`pp_fsdp`), as
    # meshloom's ZeRO-3 runs a pipeline, and as the planner priced it before (ZeRO-2).
    "torchtitan_llama3_70b_64xh100_pp4": _TT_PP,
    "torchtitan_llama3_70b_64xh100_pp4_meshloom": f"{_TT_PP},pp_fsdp=meshloom",
    "torchtitan_llama3_70b_64xh100_pp4_zero2": _TT_PP.replace("zero=3", "zero=2"),
    "torchtitan_llama3_8b_8xh100": _TT_8B,
    "torchtitan_llama3_8b_8xh100_float8": f"{_TT_8B},float8=tensorwise,float8_all_gather=true",
    "llama3_70b_64xh100": f"{_L70} --top 5",
    "llama3_70b_64xh100_compile": f"{_L70} --top 1 --fix {_BEST},compile=true",
    "llama3_70b_64xh100_tp_overlap": f"{_L70} --top 1 --fix {_BEST},tp_overlap=true",
    "llama3_70b_64xh100_no_recompute":
        f"{_L70} --top 1 --fix {_BEST.replace('selective', 'none')}",
    "llama3_70b_64xh100_zero2": f"{_L70} --top 1 --fix {_BEST.replace('zero=1', 'zero=2')}",
}
WORKED = "llama3_70b_64xh100"


def printed(argv: list[str]) -> str:
    """What `meshloom ARGV` prints, run in this process."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    if code != 0:
        raise SystemExit(f"meshloom {' '.join(argv)}: exit {code}")
    return buf.getvalue()


def plan_json(name: str) -> dict:
    """The example's `--json` output, parsed."""
    return json.loads(printed(["plan", *shlex.split(EXAMPLES[name]), "--json"]))


def worked_text() -> str:
    """The worked example as docs/plan.md shows it: the command, its table and `--explain`."""
    argv = f"{EXAMPLES[WORKED]} --explain"
    return f"$ meshloom plan {argv}\n" + printed(["plan", *shlex.split(argv)])


def render(text: str) -> str:
    """The worked example's block in docs/plan.md, from the text file alone."""
    return "\n".join([BEGIN, "", "Written by `python benchmarks/planner_examples.py` as "
                      f"[{WORKED}.txt](../benchmarks/results/planner/{WORKED}.txt) (with "
                      f"[{WORKED}.json](../benchmarks/results/planner/{WORKED}.json)).", "",
                      "```", text.rstrip("\n"), "```", "", END])


def figures(files: dict[str, dict]) -> dict[str, str]:
    """The variants' figures as the worked example's prose quotes them."""
    best = {k: files[k]["candidates"][0] for k in files if k.startswith(WORKED)}

    def step(key: str) -> str:
        return f"{best[key]['step_time_s']:.1f} s"

    def total(key: str) -> str:
        return f"{best[key]['memory_per_gpu_bytes']['total'] / 1e9:.1f} GB"

    def acts(key: str) -> str:
        return f"{best[key]['memory_per_gpu_bytes']['activations'] / 1e9:.1f} GB"

    def optimizer(key: str) -> str:
        return f"{best[key]['time_breakdown_s']['optimizer']:.1f} s"

    return {"step": step(WORKED), "optimizer": optimizer(WORKED),
            "compile step": step(f"{WORKED}_compile"),
            "tp_overlap step": step(f"{WORKED}_tp_overlap"),
            "no recompute total": total(f"{WORKED}_no_recompute"),
            "no recompute activations": acts(f"{WORKED}_no_recompute"),
            "zero2 total": total(f"{WORKED}_zero2"),
            "zero2 optimizer": optimizer(f"{WORKED}_zero2")}


def write(out: Path = OUT, doc: Path = DOC) -> dict[str, dict]:
    files = {}
    for name in EXAMPLES:
        files[name] = plan_json(name)
        # Written whole then renamed, as every result file: never half a file.
        tmp = out / f".{name}.json.tmp"
        tmp.write_text(json.dumps(files[name], indent=1) + "\n")
        tmp.replace(out / f"{name}.json")
        print(f"wrote {out / name}.json")
    text = worked_text()
    (out / f"{WORKED}.txt").write_text(text)
    page = doc.read_text()
    start, end = page.index(BEGIN), page.index(END) + len(END)
    doc.write_text(page[:start] + render(text) + page[end:])
    print(f"wrote {out / WORKED}.txt and its block in {doc}")
    for key, value in figures(files).items():
        print(f"  {key:<26}{value}")
    return files


if __name__ == "__main__":
    write()
