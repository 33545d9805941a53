"""What a user runs: the commands, their input checks, the worker's loop and its isolated
children, the launcher of a host's workers, `hpo final`, the summaries, the dashboard, the
hardware report and the console output. Device-blind; nothing below imports it."""
