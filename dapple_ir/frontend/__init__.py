"""From a PyTorch model or a published profile to the IR: capture (torch.fx / torch.export on the
meta device), FLOPs, model specs, profile import, measured profiling and device measurement.

The only package besides `dapple_ir.backends.torch` that imports torch (at the top of its modules);
`profile_import` and `spec_loader` are torch-free, so planning a published profile never
loads torch: `spec_loader.capture_spec` imports `model_spec` (and with it torch) only for a
Python spec. `calibration_fits` is torch-free too: it fits numbers the measuring hands it.
"""
