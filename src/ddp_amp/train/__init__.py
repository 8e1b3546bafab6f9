"""The training core: `trainer` (the loop), `step` (one AMP optimizer step), `metrics`, `divergence`, `data`
and `optim`. Nothing here imports typer or rich, nor knows which launcher started the rank."""
