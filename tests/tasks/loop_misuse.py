"""ddp_amp.loop used wrongly, for the tests, in one process (`python loop_misuse.py --out FILE --checkpoint-of
DIR`): each wrong call's LoopError line, in order, written to --out as JSON; a --resume of a checkpoint of another
model (DIR/checkpoints/step-2.pt, written here first by a model of another shape), steps() without the state
that --resume and --checkpoint-every need, prepare() of a model with nothing to train, and finish() twice
last."""

import argparse
import json

import torch
from torch import nn

from ddp_amp import loop


def errors_of(calls) -> list[str]:
    found = []
    for call in calls:
        try:
            call()
            found.append("no error")
        except loop.LoopError as exc:
            found.append(str(exc))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--run-dir", required=True)
    args = parser.parse_args()
    run = loop.setup(run_dir=args.run_dir, grad_accum=2, async_checkpoint=False)
    net = nn.Linear(4, 3)
    stranger = torch.optim.SGD(nn.Linear(4, 3).parameters(), lr=0.1)
    model, optimizer = run.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))

    def one_backward_then_step():
        for _ in run.accumulate(model):
            run.backward(model(torch.ones(2, 4)).sum())
            break
        run.step(optimizer)

    found = errors_of([
        lambda: run.step(stranger),
        lambda: run.backward(model(torch.ones(2, 4)).sum(), model),  # no accumulate(): every backward would reduce
        one_backward_then_step,
        lambda: run.restore(model=model, steps=3),
        lambda: run.prepare(nn.Linear(2, 2), stranger),
        lambda: run.save(1) if run._checkpoints.parts is None else None,
    ])
    run.restore(model=model, optimizer=optimizer)
    run.save(2)
    other = nn.Linear(4, 5)
    resumed = loop.setup(run_dir=args.run_dir, grad_accum=2, resume=f"{args.run_dir}/checkpoints/step-2.pt")
    other_model, other_optimizer = resumed.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
    found += errors_of([lambda: resumed.restore(model=other_model, optimizer=other_optimizer)])
    # steps() with no state given nor restored, where a setting needs it: the resume, the checkpoints
    for forgetful in (loop.setup(run_dir=args.run_dir, resume="auto"),
                      loop.setup(run_dir=f"{args.run_dir}/fresh", checkpoint_every=2)):
        forgetful.prepare(nn.Linear(4, 3))
        found += errors_of([lambda forgetful=forgetful: next(forgetful.steps(4))])
    found += errors_of([lambda: run.prepare(nn.Linear(4, 3).requires_grad_(False))])
    run.finish()
    found += errors_of([run.finish])
    with open(args.out, "w") as out:
        json.dump(found, out)


if __name__ == "__main__":
    main()
