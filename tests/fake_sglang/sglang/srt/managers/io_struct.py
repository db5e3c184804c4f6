"""``sglang.srt.managers.io_struct`` of the stand-in."""

from tests.sglang_standin.io_struct import *  # noqa: F401,F403
