"""Planning without GPUs: des.py replays the gate's and the sink's rules as a discrete-event model of a workload
(stages/sim/workload.py); planner.py runs every trainer:rollout split through it (`asyncrl plan`)."""
