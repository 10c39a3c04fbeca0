"""What a run tells its users: monitor.py (MLflow, JSONL), metrics.py (per-step metrics), summary.py (the run's
summary from its logs), audit.py (exactly-once and the staleness bound, proven from the Arrow logs), samples.py and
plots.py (the tables and figures the notebook reads)."""
