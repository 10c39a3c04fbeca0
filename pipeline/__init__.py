"""The driver: run.py (the loop, one screen), cli.py (the `asyncrl` command), prepare.py (run dir, model, prompts,
Ray: the frozen RunContext; an attempt's actors), trainer_launch.py (the trainer actor), stream.py (the Ray Data
stream's stages as data, and its wiring), clock.py (the VersionClock control actor, with channel.py, its control
messages, and replicas.py, the replicas it supervises), sync.py (push and pull weight sync), validate.py (validation
at sync points), checkpoint.py and finish.py (the end of a run).

Its helpers live in subpackages that never import the driver: config/ (the typed config), tasks/ (prompt sources
and the embedded tasks), observe/ (monitor, metrics, audit, summary, sample tables), sim/ (the discrete-event model
and the planner)."""
