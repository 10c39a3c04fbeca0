"""The driver: run.py (the loop, one screen), cli.py (the `asyncrl` command), prepare.py (run dir, model, Ray,
trainer), stream.py (the Ray Data stream's wiring), clock.py (the VersionClock control actor), sync.py (push and
pull weight sync), validate.py (validation at sync points), checkpoint.py and finish.py (the end of a run).

Its helpers live in subpackages that never import the driver: config/ (the typed config), tasks/ (prompt sources
and the embedded tasks), observe/ (monitor, metrics, audit, summary, sample tables), sim/ (the discrete-event model
and the planner)."""
