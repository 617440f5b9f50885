"""Start-up notes once per mesh, not once per rank: the ranks other than the driver log warnings and errors only.

Every rank runs the same start-up (the same plan, backends, graphs and cost figures), so each INFO note of
`moe_infer` came once per rank, N identical lines. Rank 0, the driver, keeps them; a warning or an error still
comes from every rank (a rank's trouble is its own). The level is set on the package's logger, so it holds for
loggers made later too; a level already at WARNING or above is left as it is.
"""
from __future__ import annotations

import logging

PACKAGE_LOGGER = "moe_infer"


def quiet_follower_logs(rank: int) -> None:
    if rank == 0:
        return
    package = logging.getLogger(PACKAGE_LOGGER)
    if package.getEffectiveLevel() < logging.WARNING:
        package.setLevel(logging.WARNING)
