"""Train the course's small GPT with any ZeRO stage, on this machine or under torchrun.

    python -m zero_lab.train --nproc 2 --stage 1            # zero_lab.launch starts 2 ranks
    torchrun --nproc-per-node 2 -m zero_lab.train --stage 1  # torchrun starts them (any number of machines)
    python -m zero_lab.train --stage 3 --offload nvme       # ZeRO-Infinity's (simulated) NVMe tier
    python -m zero_lab.train --nproc 3 --stage 2 --checkpoint-dir ckpt --save-every 5
                                                            # resumes from ckpt's last checkpoint, of any world size

Both run the same `train` function: it joins the process group from the environment
(`init_distributed`), takes its shard of each global batch, and prints the loss and the
bytes communicated on rank 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

import torch
import torch.distributed as dist

from zero_lab.comm_ledger import CommLedger
from zero_lab.data import shard_batch, token_batches
from zero_lab.launcher import init_distributed, launch
from zero_lab.models import GPT, GPTConfig
from zero_lab.stages import STAGES


def train(stage: int, steps: int, global_batch: int, lr: float, seed: int = 0, checkpoint_dir: str | None = None,
          save_every: int | None = None, **zero_options) -> list[float]:
    """Train on this rank; return the global mean loss of every step it ran. zero_options go to prepare
    (ranks_per_node=, qwz=, ... for lesson 09). With checkpoint_dir (stages 1-3, lesson 16), it resumes from the
    last finished checkpoint there, saved at any world size, and saves one every save_every steps (step-NNNNNN)."""
    from zero_lab.prepare import prepare  # lesson 03 onwards

    device = init_distributed()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = GPTConfig()
    model, optimizer = prepare(GPT(config, seed=seed).to(device), torch.optim.AdamW, stage=stage, lr=lr,
                               **zero_options)
    batches = token_batches(steps, global_batch, config.block_size, config.vocab_size, seed=seed)
    done = _resume(optimizer, checkpoint_dir) if checkpoint_dir else 0
    rank_losses = []
    try:
        with CommLedger() as ledger:  # counts the training's collectives only
            for step, (tokens, targets) in enumerate(batches, 1):
                if step <= done:  # the checkpoint's steps: their batches are skipped
                    continue
                tokens, targets = (t.to(device) for t in shard_batch((tokens, targets), rank, world_size))
                _, loss = model(tokens, targets)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                rank_losses.append(loss.detach())
                if save_every and step % save_every == 0:
                    from zero_lab.reshard import save_resharded  # lesson 16
                    save_resharded(optimizer, os.path.join(checkpoint_dir, f"step-{step:06d}"))
    finally:
        if hasattr(optimizer, "close"):  # offload="nvme": the tier's files
            optimizer.close()
    losses = torch.stack(rank_losses) if rank_losses else torch.zeros(0)
    dist.all_reduce(losses)  # the mean over ranks is the global batch's mean loss
    losses = (losses / world_size).tolist()
    if rank == 0 and losses:
        setup = "".join(f" {k}={v}" for k, v in zero_options.items())
        if checkpoint_dir and losses:
            print(f"steps {done + 1}-{steps} on {world_size} ranks; the last step's loss {losses[-1]!r}")
        print(f"stage {stage}{setup}, {world_size} ranks: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps")
        print(f"bytes sent per rank in {steps} steps (ring convention, docs/communication.md):")
        print(ledger.table())
    return losses


def _resume(optimizer, checkpoint_dir: str) -> int:
    """Load the last finished checkpoint in checkpoint_dir (of any world size); return its step (0: none yet)."""
    from zero_lab.reshard import METADATA, load_resharded  # lesson 16

    finished = sorted(name for name in os.listdir(checkpoint_dir) if name.startswith("step-")
                      and os.path.exists(os.path.join(checkpoint_dir, name, METADATA))) if os.path.isdir(checkpoint_dir) else []
    if not finished:
        return 0
    load_resharded(optimizer, os.path.join(checkpoint_dir, finished[-1]))
    if dist.get_rank() == 0:
        print(f"resumed from {os.path.join(checkpoint_dir, finished[-1])}")
    return int(finished[-1].removeprefix("step-"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", type=int, default=1, choices=sorted(STAGES),
                        help=", ".join(f"{number} = {row.name}" for number, row in STAGES.items())
                        + " (zero_lab/stages.py)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=12, help="split evenly over the ranks")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    parser.add_argument("--ranks-per-node", type=int, help="stage 3 on nodes of this many ranks (lesson 09)")
    parser.add_argument("--zeropp", default="", help="with --ranks-per-node: any of qwz,hpz,qgz (comma-separated)")
    parser.add_argument("--hsdp", action="store_true", help="with --ranks-per-node: shard in the node, replicate across")
    parser.add_argument("--offload", choices=["cpu", "nvme"],
                        help="cpu: ZeRO-Offload, stages 1-2 (lesson 06); nvme: ZeRO-Infinity's simulated NVMe tier, "
                             "stage 3 (lesson 10)")
    parser.add_argument("--nvme-dir", help="with --offload nvme: where each rank's tier keeps its files "
                                           "(default: the system's temporary directory)")
    parser.add_argument("--nvme-bandwidth", type=float, help="with --offload nvme: the tier's bytes/s (default: unthrottled)")
    parser.add_argument("--checkpoint-dir", help="stages 1-3 (lesson 16): resume from the last checkpoint there, "
                                                 "saved at any world size; save one every --save-every steps")
    parser.add_argument("--save-every", type=int, help="with --checkpoint-dir: steps between checkpoints")
    args = parser.parse_args(argv)
    run = (args.stage, args.steps, args.global_batch, args.lr)
    techniques = [t for t in args.zeropp.split(",") if t]
    if (techniques or args.hsdp) and args.ranks_per_node is None:
        parser.error("--zeropp and --hsdp need --ranks-per-node")
    if unknown := sorted(set(techniques) - {"qwz", "hpz", "qgz"}):
        parser.error(f"--zeropp takes qwz, hpz, qgz (comma-separated), not {','.join(unknown)}")
    if args.save_every and not args.checkpoint_dir:
        parser.error("--save-every needs --checkpoint-dir")
    if args.checkpoint_dir and (args.stage not in (1, 2, 3) or args.offload or args.ranks_per_node):
        parser.error("--checkpoint-dir works with --stage 1, 2 or 3, without --offload or --ranks-per-node")
    options = dict.fromkeys(techniques, True)
    if args.checkpoint_dir:
        options.update(checkpoint_dir=args.checkpoint_dir, save_every=args.save_every)
    if args.ranks_per_node is not None:
        options.update(ranks_per_node=args.ranks_per_node, replicate_across_nodes=args.hsdp)
    nvme = {"nvme_dir": args.nvme_dir, "nvme_bandwidth": args.nvme_bandwidth}
    if args.offload != "nvme" and any(v is not None for v in nvme.values()):
        parser.error("--nvme-dir and --nvme-bandwidth need --offload nvme")
    if args.offload:
        offloading = [s for s, row in STAGES.items() if (row.nvme if args.offload == "nvme" else row.offload)]
        if args.stage not in offloading:
            parser.error(f"--offload {args.offload} works with --stage {' or '.join(map(str, offloading))}")
        options.update(offload=args.offload, **{k: v for k, v in nvme.items() if v is not None})
    if "TORCHELASTIC_RUN_ID" in os.environ or "RANK" in os.environ:  # started by torchrun
        # torchrun stops the other ranks with SIGTERM when one fails: unwind, so that `finally` blocks run
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
        train(*run, **options)
        dist.destroy_process_group()
        # Leave without the interpreter's teardown: there, about one run in ten on a loaded machine
        # aborted in C++ ("terminate called without an active exception") after training and the
        # group were done, and torchrun reported the run as failed.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    else:
        launch(train, args.nproc, *run, timeout=600, **options)


if __name__ == "__main__":
    main()
