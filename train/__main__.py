"""`python -m eyas.train --recipe R [key=value ...]`, so that
`accelerate launch -m eyas.train --recipe R` works."""

import sys

from eyas.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
