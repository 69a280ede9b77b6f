"""`python -m eyas.train --recipe R [key=value ...]`, so that
`accelerate launch -m eyas.train --recipe R` works."""

import logging
import os
import sys

from eyas.cli import main

code = main(["train", *sys.argv[1:]])
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # Under a launcher the training has ended and its process group is destroyed, but gloo's
    # C++ threads can still abort the interpreter's teardown ("terminate called without an
    # active exception", SIGABRT), failing a run whose every file is written: flush and leave
    # without that teardown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
