"""Tools that read compiled plans: `graphc plan` dumps, charts, simulation, runtime traces.

Tools never need a process group (see docs/design.md, "Layers"): they take ExecutionPlans,
StagePrograms and measured or modelled costs. The one exception is trace.py, which merges
the ranks' measured timelines over the process group the runtime already has.
"""
