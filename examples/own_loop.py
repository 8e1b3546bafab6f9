"""A training script with a loop of its own and two optimizers, AdamW and Adam (a small GAN that learns points on a
ring), written with ddp_amp.loop: the AMP step, agreed stops, checkpoints that resume exactly, progress.

    ddp-amp spawn -n 2 examples/own_loop.py --steps 200                       # Ctrl-C: stops, saves
    ddp-amp spawn -n 2 --resume auto examples/own_loop.py --steps 200         # continues, bit for bit
    ddp-amp spawn -n 2 --amp on --dtype fp16 examples/own_loop.py --steps 200
    torchrun --standalone --nproc-per-node 2 examples/own_loop.py --steps 200  # the same script
    python examples/own_loop.py --steps 200                                    # one process

At the end rank 0 writes both models' weights to RUN_DIR/model.pt ({"generator": ..., "discriminator": ...}).
The loop takes 10 of ddp_amp.loop's calls: setup, prepare, loader, steps, accumulate, autocast, backward, step,
log, finish.
"""

import argparse
import math

import torch
from torch import nn

from ddp_amp import loop

NOISE = 8


class Ring(torch.utils.data.Dataset):
    """Points on the unit circle, a little noisy: what the generator must learn to produce."""

    def __init__(self, size: int = 4096) -> None:
        generator = torch.Generator().manual_seed(1234)
        angle = torch.rand(size, generator=generator) * 2 * math.pi
        self.points = torch.stack([angle.cos(), angle.sin()], 1) + 0.02 * torch.randn(size, 2, generator=generator)

    def __len__(self) -> int:
        return len(self.points)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.points[index]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    run = loop.setup(checkpoint_every=50)
    torch.manual_seed(0)  # the same initial weights on every rank
    generator = nn.Sequential(nn.Linear(NOISE, 64), nn.ReLU(), nn.Linear(64, 2))
    discriminator = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Dropout(0.1), nn.Linear(64, 1))
    generator, opt_g = run.prepare(generator, torch.optim.AdamW(generator.parameters(), lr=2e-3, betas=(0.5, 0.9),
                                                                weight_decay=1e-4))
    discriminator, opt_d = run.prepare(discriminator,
                                       torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.9)))
    sched_g = torch.optim.lr_scheduler.CosineAnnealingLR(opt_g, T_max=args.steps)
    sched_d = torch.optim.lr_scheduler.CosineAnnealingLR(opt_d, T_max=args.steps)
    data = run.loader(Ring(), batch_size=args.batch_size)
    bce = nn.BCEWithLogitsLoss()
    # steps() resumes this state (--resume, a restart), saves it every 50 steps, and ends at a stop signal
    for _ in run.steps(args.steps, generator=generator, discriminator=discriminator, opt_g=opt_g, opt_d=opt_d,
                       sched_g=sched_g, sched_d=sched_d, data=data):
        for real in run.accumulate(discriminator, data):  # the discriminator: real points against generated ones
            noise = torch.randn(len(real), NOISE, device=run.device)
            with run.autocast():
                with torch.no_grad():
                    fake = generator(noise)
                scores = discriminator(torch.cat([real, fake]))
                labels = torch.cat([torch.ones(len(real), 1), torch.zeros(len(fake), 1)]).to(scores.device)
                loss_d = bce(scores.float(), labels)
            run.backward(loss_d, discriminator)
        run.step(opt_d, sched_d)
        for _ in run.accumulate(generator):  # the generator: fool the discriminator
            noise = torch.randn(args.batch_size, NOISE, device=run.device)
            with run.autocast():
                scores = discriminator(generator(noise))
                loss_g = bce(scores.float(), torch.ones_like(scores, dtype=torch.float32))
            run.backward(loss_g, generator)
        opt_d.zero_grad(set_to_none=True)  # the generator's backward went through the discriminator
        run.step(opt_g, sched_g)
        run.log(loss_d=loss_d, loss_g=loss_g)
    run.finish(generator=generator, discriminator=discriminator)  # model.pt, unless stopped

if __name__ == "__main__":
    main()
