"""Old import path of :mod:`cp_modules.kernels.decode.mla_gluon_epilogue`: the same module object, so that
attributes set through either name are seen by both."""

import sys

from cp_modules.kernels.decode.mla_gluon_epilogue import *  # noqa: F403

sys.modules[__name__] = sys.modules["cp_modules.kernels.decode.mla_gluon_epilogue"]
