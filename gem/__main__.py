"""`python -m gem` / `torchrun -m gem train --config ...`"""

import sys

from gem.cli import main

sys.exit(main())
