"""The machines a plan runs on: the cluster spec and its shorthand (`spec`), the TOML file form
(`toml_file`), and the roofline that turns FLOPs and bytes into seconds (`roofline`).

Imports only `errors`, `units` and the IR.
"""
