"""Settings and helpers of the server tests.

Every server here is the real console command on a free loopback port, waited on
through `/health` (harness.engine_server.ServerProcess); its log goes to a file that
failures print.
"""

from __future__ import annotations

from harness.engine_server import (MAX_MODEL_LEN, MODEL, NUM_KV_BLOCKS, ServerProcess,  # noqa: F401
                                   scrape, shapeshift_command, value)

MAX_NUM_SEQS = 8
