"""The policy developer's path: plugin crates, traces, and policy comparisons on pagesim.

- scaffold: `scalebench policy new` (a standalone plugin crate against paging-policy)
- traces: the SBTRACE1 format with metadata, `scalebench trace synth` and `trace record`
- grid: `scalebench policy compare` (pagesim over policies x blocks x alphas)
- commands: the argparse layer the main CLI delegates to
"""
