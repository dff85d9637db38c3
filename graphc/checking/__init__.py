"""The checking room: a graph's steps compared with eager PyTorch. The eager twin and the
first step's check (first_step.py: config.check_microbatching, NOTE: Checked first step),
every step's in check mode (every_step.py: `graphc check`, NOTE: Checked steps; the
setting is graphc/modes.py), and the optimizer's supported settings (optimizer.py)."""
