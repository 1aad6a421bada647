"""The one physics: what an op set, a transfer, a collective, an optimizer step and a stage's static memory cost
on a resolved cluster, read by the cost model, the DP, the ILP, the baselines and the simulator alike.

`layers` (the per-layer prices of a coarsened module: compute at any rows, host work, split backward,
optimizer step, static bytes with each parameter once), `collectives` (the ring allreduce: its time, its
linear coefficients, its flows), `traffic` (a cut's pieces and the links they load), `host` (the host's work
per instruction and the optimizer step per device kind), `pipeline` (one stage of the pipeline recursion and
the activations each schedule keeps in flight). It imports the IR, the cluster, the schedules and analysis;
the planner, the simulator and the passes import it; it never imports them.
"""
