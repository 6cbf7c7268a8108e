"""What the planner shows a person: one formatting layer shared by the CLI, the HTML report and notebooks.

- `labels`: the plan table's cells, column names and legend, the summary and breakdown rows of one estimate
  (plain strings and lists, no terminal library: the CLI renders them with rich, the report as HTML).
- `compare`: why one plan beats another, term by term, in words (`Plan.compare`).
- `schedule`: a pipeline schedule (1F1B, interleaved) as timed blocks per stage, from an estimate's stages.
- `plots`: matplotlib figures (`PlanResult.plot_*`); matplotlib is imported only when a figure is drawn.
- `files`: a picture written to a .png or .svg file, its target checked first.

This package sits in the bottom layer beside `planner.specs` (whose result types call it): it reads plans and
estimates by their attributes and imports nothing of the project above `planner.errors`.
"""
