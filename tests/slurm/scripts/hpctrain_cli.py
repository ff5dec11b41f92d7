"""`hpctrain` with the Slurm commands registered, whether or not cli/main.py registers them yet."""

from hpctrain.cli import submit
from hpctrain.cli.main import app

names = {c.name or (c.callback.__name__ if c.callback else None) for c in app.registered_commands}
if "submit" not in names:
    submit.register(app)
app(prog_name="hpctrain")
