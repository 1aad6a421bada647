"""What a plan will do before it runs: the discrete-event simulator (`simulator`), the transfers
sharing the network's links (`link_sharing`), the timeline format shared with the runtime's measured
traces (`trace`) and the pictures (`drawing`).

Imports the IR, analysis, the cluster model, `plan_dir`, `errors` and `units`; never torch.
"""
