import sys

from .base.stop import FLAG, unblock  # first, and cheap: a stop during start-up is kept, not fatal

if sys.argv[1:2] in (["train"], ["launch"]):
    FLAG.install()
unblock()  # `hpctrain launch` starts ranks with the stop signals blocked: what came meanwhile is delivered now

from .cli.main import main  # noqa: E402

main()
