"""vmap sweeps: `plan` turns a config's `sweep` section into programs (discrete choices loop in
Python, continuous ones stack on one vmapped axis), `run` trains each program, `report` writes the
table and plots. `python -m posattn.sweep` is `posattn.sweep.main`."""

from posattn.sweep.run import main, run_sweep, sweep_mesh

__all__ = ["main", "run_sweep", "sweep_mesh"]
