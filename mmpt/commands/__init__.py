"""mmpt's command-line tools, one module each with a `main(argv)`; installed as `mmpt-<name>` commands
(pyproject's [project.scripts]) and run from a checkout as `python launch/<name>.py`."""
