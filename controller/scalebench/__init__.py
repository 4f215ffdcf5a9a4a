"""scalebench: Denali-style server consolidation framework (the controller).

The CLI (cli.py) is a thin layer over these modules, which tests call directly:

- config.py: a run's settings and their validation (ConfigError: one line, exit 2)
- runner.py: one run end to end; densevm.py, zipfperf.py and touch.py drive the
  binaries and the VMs, cgroup.py contains densevm, procs.py owns child processes
- model.py: Denali's performance model (Che's approximation of LRU under Zipf);
  disks.py: the disk models' parameters; diskbench.py: the swap device microbenchmark;
  calibration.py: the stored in-core CPU cost
- result.py: the result document (controller/RESULTS.md); summary.py, plots.py
- sweep.py, tables.py, checks.py, report.py: grids of runs, their tables, plots,
  acceptance checks and HTML report; compare.py, nightly.py: regressions
- db/: database guests and block tracing (`scalebench dbtrace`)
"""
