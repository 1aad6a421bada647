"""The machines a plan runs on: the cluster spec and its shorthand (`spec`), the links of its network
and the path of each transfer (`topology`), the TOML file form (`toml_file`), and the roofline that
turns FLOPs and bytes into seconds (`roofline`).

Imports only `errors`, `units` and the IR.
"""
