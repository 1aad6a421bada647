"""Facts computed from IR that every later layer shares: static memory (`memory`), the memory
timeline of a rank program (`peak_memory`), the stage graph and its cut values (`stage_graph`),
plan checks (`plan_checks`) and the lowering helpers that several passes use (`lowering`).

Imports the IR, the cluster model, the schedule registry, `errors` and `units`; never a pass.
"""
