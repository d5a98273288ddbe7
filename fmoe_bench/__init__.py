"""The benchmarks (replay, live, overhead, quality, matcher, CPU kernels), the tiny model families and the demo
model's trainer: they measure and build for the runtime (fmoe_local), which never imports them
(tests/test_layering.py). `fmoe-local bench …` reaches them through app.py, which hands cli.py this package's
`bench` command."""
