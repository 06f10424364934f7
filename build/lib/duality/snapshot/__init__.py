"""Delta snapshots of a pipeline's table, rebuilt from its compacted changelog (DESIGN §7):
`coverage` (what a version covers), `delta_log` (the table's log, read without Spark), `build`
(full rebuild or incremental MERGE), `publish` (verdicts, the published version, reading it) and
`maintain` (OPTIMIZE, VACUUM); `duality.validate` audits a version before it is published.
"""
