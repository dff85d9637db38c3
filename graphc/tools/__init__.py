"""Tools that read compiled plans: `graphc plan` dumps, charts, simulation, runtime traces.

Tools never need a process group (see docs/design.md, "Layers"): they take ExecutionPlans,
StagePrograms and measured or modelled costs. The ranks' measured timelines are merged by
the runtime (graphc/runtime/trace.py); trace.py here reads the merged file back.
"""
