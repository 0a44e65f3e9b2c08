"""Script mode: a trial that runs the user's own training command, unchanged, with the config
injected and its optimizer steps timed by a hook every Python process of the command loads."""
