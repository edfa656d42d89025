"""gem: the GEM model and everything that runs inside a training pod.

Importing `gem` (or `gem.api`, `gem.launcher`) never imports torch: the SDK and the operator
use the API types and the launcher contract without the training stack.
"""

__version__ = "0.1.0"
