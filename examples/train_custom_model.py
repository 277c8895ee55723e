"""Your own decoder, optimizer and loop on meshloom's layouts: FSDP (ZeRO-3) x tensor parallel.

    torchrun --nproc-per-node 4 examples/train_custom_model.py             # dp_shard 2 x tp 2
    python examples/train_custom_model.py --dp-shard 1 --tp 1 --zero-stage 0   # one process

`Decoder` below is not one of meshloom's model families: it is plain PyTorch plus what the model
contract asks (docs/model.md): its pieces, a tensor-parallel plan, and where it may be cut. It
has no `init_tensor`, so `parallelize` trains global rank 0's weights (it broadcasts them), and
the same seed gives the same model on one process as on four. docs/library.md walks through it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

import meshloom as ml


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        # Heads from the projected width: under tp each rank holds some of them.
        q, k, v = (f(x).unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        return self.o(self.core(q, k, v).transpose(1, 2).flatten(2))

    @staticmethod
    def core(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # context parallel swaps this for a ring
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(dim), Attention(dim, heads)
        self.norm2 = nn.RMSNorm(dim)
        self.mlp = nn.Sequential()
        self.mlp.up, self.mlp.act = nn.Linear(dim, 3 * dim, bias=False), nn.SiLU()
        self.mlp.down = nn.Linear(3 * dim, dim, bias=False)

    def forward(self, h: Tensor) -> Tensor:
        h = h + self.attn(self.norm1(h))
        return h + self.mlp(self.norm2(h))


class Decoder(nn.Module):
    """Learned positions, RMSNorm, a SiLU MLP; the contract's methods are the last five."""

    TP_PLAN = {"tok": "vocab", "blocks.*.attn": "input", "blocks.*.mlp": "input",
               "blocks.*.attn.q": "colwise", "blocks.*.attn.k": "colwise",
               "blocks.*.attn.v": "colwise", "blocks.*.attn.o": "rowwise",
               "blocks.*.mlp.up": "colwise", "blocks.*.mlp.down": "rowwise",
               "blocks.*.norm1": "sequence", "blocks.*.norm2": "sequence", "norm": "sequence",
               "out": "colwise_vocab"}

    def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_seq: int):
        super().__init__()
        self.hidden_size, self.vocab_size = dim, vocab
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.out = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: Tensor, positions: Tensor | None = None) -> Tensor:
        h = self.embed(tokens, positions)
        for block in self.blocks:
            h = block(h, *self.block_context(tokens.shape[1], positions))
        return self.head(h)

    def pieces(self) -> ml.Pieces:
        return ml.Pieces(input=("tok", "pos"), blocks="blocks", output=("norm", "out"))

    def embed(self, tokens: Tensor, positions: Tensor | None) -> Tensor:
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)

    def block_context(self, seq_len: int, positions: Tensor | None) -> tuple:
        return ()

    def head(self, h: Tensor) -> Tensor:
        return self.out(self.norm(h))

    def pipeline_cut_points(self) -> list[str]:
        return [f"blocks.{i}" for i in range(len(self.blocks))]

    def layer_costs(self, seq_len: int) -> tuple[list[float], float]:
        d = self.hidden_size
        return [6.0 * 10 * d * d + 6.0 * seq_len * d] * len(self.blocks), 6.0 * self.vocab_size * d

    def flops_per_token(self, seq_len: int) -> float:
        blocks, head = self.layer_costs(seq_len)
        return sum(blocks) + head


def counting_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> tuple[Tensor, Tensor]:
    """Toy data every rank can draw alike: runs of consecutive token ids from random starts."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, vocab, (batch, 1), generator=g)
    data = (starts + torch.arange(seq + 1)) % vocab
    return data[:, :-1], data[:, 1:]


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("steps", 20), ("dim", 64), ("heads", 4), ("layers", 2), ("vocab", 96),
                          ("seq", 32), ("batch", 16), ("micro-batch", 4), ("dp-shard", 2),
                          ("tp", 2), ("zero-stage", 3), ("seed", 0)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--checkpoint", type=Path, help="run folder to save the last step in")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint's newest")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, list[float]]:
    """Train; every rank returns each step's loss over the global batch and gradient norm."""
    args = parse(argv)
    layout = ml.ParallelConfig(dp_shard=args.dp_shard, tp=args.tp, zero_stage=args.zero_stage)
    mesh = ml.init_mesh(layout, device=args.device)  # joins torchrun's process group
    torch.manual_seed(args.seed)
    model = Decoder(args.vocab, args.dim, args.heads, args.layers, args.seq).to(mesh.device)
    par = ml.parallelize(model, mesh, layout)  # the model now holds this rank's slice
    decay, no_decay = par.grads.optim_param_groups()  # what this rank updates
    params = decay + no_decay
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    dp_rank, dp = mesh.coord("dp"), mesh.size("dp")  # tp ranks of one replica see the same rows
    rows = slice(dp_rank * args.batch // dp, (dp_rank + 1) * args.batch // dp)
    start = 0
    if args.resume:  # any layout's checkpoint: entries are whole tensors by parameter name
        meta = ml.load_checkpoint(ml.latest_checkpoint(args.checkpoint), par.model, optimizer,
                                  par.grads)
        start = meta["step"]
    history: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for step in range(start, args.steps):
        x, y = counting_batch(step, args.batch, args.seq, args.vocab, args.seed)
        mb = args.micro_batch
        micro = list(zip(x[rows].split(mb), y[rows].split(mb), strict=True))
        total = 0.0
        for i, (xb, yb) in enumerate(micro):
            last = i == len(micro) - 1  # gradients are reduced after the last micro-batch only
            with contextlib.nullcontext() if last else par.grads.no_sync():
                loss = par.loss(par.model(xb.to(mesh.device)), yb.to(mesh.device)) / len(micro)
                loss.backward()
            total += loss.item()
        par.grads.finish()
        norm = ml.grad_norm(params, mesh, par.grads.norm_axes)  # global, across every axis
        ml.clip_grads(params, args.grad_clip, norm)
        optimizer.step()
        par.grads.after_step()  # updated shards -> the parameters the model computes with
        par.grads.zero_grad()
        mean = torch.tensor([total], device=mesh.device)
        dist.all_reduce(mean, group=mesh.group("dp"))  # each replica saw its own rows
        history["loss"].append(mean.item() / dp)
        history["grad_norm"].append(norm)
        if mesh.rank == 0:
            print(f"step {step + 1}: loss {mean.item() / dp:.4f}, grad norm {norm:.3f}", flush=True)
    if args.checkpoint:
        ml.save_checkpoint(args.checkpoint, args.steps, par.model, optimizer, par.grads, {})
    return history


if __name__ == "__main__":
    main()
    # The model and its strategy's hooks reference each other: collect them (and the process
    # groups they hold) now, not during interpreter shutdown, where Gloo's teardown can abort.
    gc.collect()
    dist.destroy_process_group()
