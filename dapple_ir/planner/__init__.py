"""The DAPPLE planner: the analytic cost model (`cost_model`) and the bytes a plan puts on each link
(`traffic`), dynamic programming (`dp`), the CP-SAT model (`ilp`), the baselines it must beat
(`baselines`) and the search that ranks them all (`search`). Plans are scored by a callback the
caller gives (the `plan` pass lowers and simulates), so the planner never builds passes.

Imports the IR, analysis, the cluster model, the schedule registry (`dapple_ir.schedules`), `errors`
and `units`; never the pass registry, the pass manager, a pass or the simulator.
"""
