"""scalebench: Denali-style server consolidation framework (the controller).

The CLI (cli.py) is a thin layer over these modules, which tests call directly.
Every module, one line each:

- __main__.py: `python -m scalebench`, the same as the `scalebench` command
- cli.py: the command line; each subcommand parses its flags and calls the library
- config.py: a run's settings, defaults and validation (ConfigError: one line, exit 2)
- errors.py: ConfigError, the error for bad input that every checking module raises
- binaries.py: where the repository and its built binaries are
- runner.py: one run end to end: boot, calibrate, touch, settle, warm up, measure, model
- densevm.py: densevm's one launcher (DenseVM) and its control API, for runs and sessions
- zipfperf.py: zipfperf as a load phase, its JSON document back
- touch.py: the touch phase, one request per VM in the order the pager expects
- cgroup.py: the memory-limited cgroup densevm runs in, and its pressure counters
- procs.py: child processes in their own process groups, always torn down
- progress.py: progress of long phases on stderr
- model.py: Denali's performance model (Che's approximation of LRU under Zipf), with
  hibernation's wake term, and model_input, the one builder of its input from a configuration
- calibration.py: the stored per-host CPU costs, and the one fallback that chooses the
  cost the model uses (flag, measurement, stored, default)
- disks.py: the disk models' parameters as the model charges them
- diskbench.py: the swap device microbenchmark
- describe.py: densevm's own facts (`densevm describe --json`) the model relies on
- units.py: byte sizes as flags and experiment files write them ("32k", "1G")
- webobject.py: the objects the webguest serves, byte for byte
- result.py: the result document (controller/RESULTS.md)
- summary.py: the short summary printed after a run
- plots.py: PNG plots of a run and of a sweep
- sweep.py: grids of runs from an experiment file, resumable
- tables.py: tables derived from a sweep's rows (groups, cliff positions)
- checks.py: a sweep's acceptance checks (`[[check]]` tables)
- report.py: the HTML page of a sweep or of the nightly history
- cluster.py: sweeps on a fleet of hosts (dask), one point per host
- cluster_worker.py: one sweep point on a cluster worker
- compare.py: regression check between two results or sweeps
- nightly.py: `scalebench nightly`, scaling regressions in a noisy history (docs/nightly.md)
- scaling.py: densevm sessions, load windows and hibernated VMs' density, shared by the
  nightly and the benches
- nginx.py: a throw-away nginx, the host's reference server
- history.py: the nightly history (SQLite)
- changepoint.py: bootstrap medians and E-Divisive change points for the nightly
- db/: database guests and block tracing (`scalebench dbtrace`)
- policydev/: policy crates, traces and comparisons on pagesim (`scalebench policy`, `trace`)
"""
