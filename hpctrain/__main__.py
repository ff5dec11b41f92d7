import sys

if sys.argv[1:2] == ["train"]:  # before anything slow: a stop during start-up waits for the first step
    from .stop import FLAG

    FLAG.install()

from .cli.main import main  # noqa: E402

main()
